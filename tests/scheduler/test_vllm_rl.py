"""vLLM's RL routes (issue 50): /pause, /resume, /is_paused, /sleep, /wake_up, /is_sleeping, /reset_prefix_cache,
prime-rl's /update_weights and vLLM's /weight_info,
driven as the frameworks' sources drive vLLM (each client below names the file it reproduces and sends what it
sends, with the HTTP library it uses), and checked by what the server does: requests frozen, ended or finished,
memory released and brought back, greedy outputs against transformers.

One stack for the module (its weights change under the tests), with no keys, as a vLLM development server runs
(TRL's client sends none); the admin key's guard on these routes is checked on the gateway's middleware alone.
"""

import asyncio
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
import requests
import torch
from flatwire_client import FlatwireClient
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness.checkpoints import perturbed_checkpoint
from harness.stack import running
from services.common.auth import AccessKeys
from services.gateway.http.auth import ApiKeyMiddleware
from tests.scheduler.test_rollout_control import Streaming, prompt, wait_until

pytestmark = pytest.mark.slow
NEW_TOKENS = 24
VLLM_ROUTES = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"),
               ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache"),
               ("POST", "/update_weights"), ("GET", "/weight_info")]


class SkyRL:
    """SkyRL's RemoteInferenceClient control plane, at a95645 of
    skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py: _call_server's aiohttp request (json
    body, query params) and what pause, resume, sleep, wake_up and reset_prefix_cache pass it."""

    def __init__(self, server_url: str):
        self.server_url = server_url

    def _call_server(self, endpoint: str, json: dict | None = None, method: str = "POST",
                     params: dict | None = None) -> dict:
        async def call() -> dict:
            async with aiohttp.ClientSession() as session, session.request(
                    method, f"{self.server_url}{endpoint}", json=json, params=params) as resp:
                body = await resp.json() if resp.content_length else None
                assert resp.status < 400, (endpoint, resp.status, await resp.text())
                return {"status": resp.status, "body": body}
        return asyncio.run(call())

    def pause(self, mode: str = "keep", clear_cache: bool = False) -> dict:
        return self._call_server("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    def resume(self) -> dict:
        return self._call_server("/resume")

    def sleep(self, level: int = 2) -> dict:
        return self._call_server("/sleep", params={"level": str(level)})

    def wake_up(self, tags: list[str] | None = None) -> dict:
        return self._call_server("/wake_up", params={"tags": tags} if tags else {})

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict:
        return self._call_server("/reset_prefix_cache", {"reset_running_requests": reset_running_requests})


class PrimeRL:
    """prime-rl's admin client (prime_rl/utils/client.py at 559b44): setup_admin_clients' httpx.AsyncClient (the
    base URL without /v1, a Bearer header when an API key is set), check_health, maybe_check_has_model, and
    _pause_engines / _resume_engines through _admin_post (raise_for_status)."""

    def __init__(self, base_url: str, api_key: str = "EMPTY"):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "EMPTY" else {}

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=httpx.Timeout(None),
                                 limits=httpx.Limits(max_connections=4, max_keepalive_connections=1))

    def _run(self, call):
        async def run():
            async with self._client() as client:
                return await call(client)
        return asyncio.run(run())

    def check_health(self) -> None:
        self._run(lambda client: client.get("/health")).raise_for_status()

    def has_model(self, model_name: str) -> bool:
        models = self._run(lambda client: client.get("/v1/models")).json()["data"]
        return any(model["id"] == model_name for model in models)

    def _admin_post(self, path: str, **kwargs) -> None:
        timeout = httpx.Timeout(connect=10.0, read=300.0, write=60.0, pool=10.0)
        self._run(lambda client: client.post(path, timeout=timeout, **kwargs)).raise_for_status()

    def pause_engines(self) -> None:
        self._admin_post("/pause", params={"mode": "keep", "clear_cache": "false"})

    def resume_engines(self) -> None:
        self._admin_post("/resume")

    def update_weights(self, weight_dir: Path) -> None:
        """update_weights without a LoRA name: pause, the NCCL_READY marker in weight_dir, /update_weights with the
        directory (its vLLM server's own route: the filesystem worker loads it), resume whatever happened."""
        self.pause_engines()
        try:
            (weight_dir / "NCCL_READY").touch()
            self._admin_post("/update_weights", json={"weight_dir": weight_dir.as_posix()})
        finally:
            self.resume_engines()


class TRL:
    """TRL's async GRPO VLLMClient (trl/experimental/async_grpo/vllm_client.py at f2cd57): requests, no key; pause
    and resume do not look at the answer."""

    def __init__(self, server_url: str):
        self.server_url = server_url.rstrip("/")

    def health(self) -> int:
        return requests.get(f"{self.server_url}/health", timeout=5).status_code

    def get_max_model_len(self) -> int:
        response = requests.get(f"{self.server_url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["max_model_len"]

    def pause(self) -> None:
        requests.post(f"{self.server_url}/pause", params={"mode": "keep"})

    def resume(self) -> None:
        requests.post(f"{self.server_url}/resume")


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    with running(model_dir, log_dir, scheduler_args=("--max-running-requests", "8")) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def perturbed_dir(model_dir, tmp_path_factory) -> Path:
    return perturbed_checkpoint(model_dir, tmp_path_factory.mktemp("trained"), 5050, (".layers.1.",))


@pytest.fixture(scope="module")
def references(model_dir, perturbed_dir) -> dict:
    """Greedy outputs of transformers, on the served and on the perturbed weights, per prompt seed."""
    out = {}
    for name, path in (("served", model_dir), ("perturbed", perturbed_dir)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            for seed in range(1, 5):
                ids = prompt(seed)
                generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
                out[name, seed] = generated[0, len(ids):].tolist()
    return out


def greedy(http, seed: int) -> httpx.Response:
    return http.post("/generate", json={"input_ids": prompt(seed), "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})


def state(http) -> tuple[bool, bool]:
    """(is_paused, is_sleeping), as vLLM's routes answer them."""
    return http.get("/is_paused").json()["is_paused"], http.get("/is_sleeping").json()["is_sleeping"]


def test_admin_key_guards_every_vllm_route():
    """The routes are admin operations (http/auth.py ADMIN_PATHS): with --admin-api-key, only that key opens them."""
    async def call(method: str, path: str, token: str | None) -> int:
        sent: list[dict] = []

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        scope = {"type": "http", "method": method, "path": path, "headers": headers}
        await ApiKeyMiddleware(app, AccessKeys("api", "admin"))(scope, receive, send)
        return sent[0]["status"]

    for method, path in VLLM_ROUTES:
        assert [asyncio.run(call(method, path, token)) for token in (None, "api", "admin")] == [401, 401, 200], path


def test_skyrl_keep_pause_freezes_requests_that_finish_whole_after_resume(stack, http, references):
    streams = [Streaming(stack.http_url, prompt(seed), NEW_TOKENS) for seed in (1, 2)]
    wait_until(lambda: all(s.tokens >= 2 for s in streams), what="the streams' first tokens")
    skyrl = SkyRL(stack.http_url)
    assert skyrl.pause(mode="keep", clear_cache=False)["body"] == {"status": "paused"}
    assert state(http) == (True, True)  # vLLM's is_sleeping is true while paused
    time.sleep(0.3)
    held = [s.tokens for s in streams]
    late = Streaming(stack.http_url, prompt(3), NEW_TOKENS)  # arrives while paused: waits
    time.sleep(0.7)
    assert [s.tokens for s in streams] == held and late.tokens == 0 and max(held) < NEW_TOKENS
    assert stack.stats().running == 2  # frozen with their KV
    assert skyrl.resume()["body"] == {"status": "resumed"}
    for seed, stream in zip((1, 2, 3), [*streams, late]):
        assert stream.result()["output_ids"] == references["served", seed]
    assert state(http) == (False, False)


def test_pause_abort_ends_requests_and_wait_lets_them_finish(stack, http, references):
    """vLLM's default mode abort ends the running requests with what they have; wait holds the call until they
    have finished, admits nothing meanwhile, and answers paused."""
    running = Streaming(stack.http_url, prompt(1), 400)
    wait_until(lambda: running.tokens >= 2, what="the first tokens")
    assert http.post("/pause").json() == {"status": "paused"}
    meta = running.result()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 400
    assert http.post("/resume").json() == {"status": "resumed"}

    finishing = Streaming(stack.http_url, prompt(2), NEW_TOKENS)
    wait_until(lambda: finishing.tokens >= 2, what="the first tokens")
    answered: list[httpx.Response] = []
    pausing = threading.Thread(target=lambda: answered.append(http.post("/pause", params={"mode": "wait"})))
    pausing.start()
    time.sleep(0.2)
    late = Streaming(stack.http_url, prompt(3), NEW_TOKENS)  # not admitted while the running one finishes
    pausing.join(timeout=120)
    assert answered[0].json() == {"status": "paused"}, answered[0].text
    assert finishing.result()["output_ids"] == references["served", 2]  # whole: it finished before the answer
    assert late.tokens == 0 and http.get("/is_paused").json()["is_paused"]
    assert http.post("/resume").status_code == 200
    assert late.result()["output_ids"] == references["served", 3]


def test_skyrl_colocated_sleep_level_2_then_weights_then_kv_cache(stack, http, model_dir, references):
    """SkyRL's colocated weight sync (skyrl/backends/skyrl_train/workers/worker_dispatch.py): sleep() (level 2),
    wake_up(["weights"]), the trainer's weights, wake_up(["kv_cache"]). Level 2 keeps nothing: after the weights'
    wake_up they are zeros, and requests are refused, until an update brings them (flatwire's disk update stands in
    for the trainer's broadcast)."""
    skyrl = SkyRL(stack.http_url)
    assert skyrl.sleep()["status"] == 200
    assert state(http) == (True, True)
    assert http.get("/is_sleeping").json()["replicas"][stack.scheduler_address]["memory_released"] == [
        "kv_cache", "weights"]
    assert greedy(http, 1).status_code == 503
    skyrl.wake_up(tags=["weights"])
    refused = greedy(http, 1)
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.text  # the KV cache is still out
    assert http.get("/is_sleeping").json()["is_sleeping"]  # and generation stays paused until it is back
    update = http.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
    assert update.json()["success"], update.text
    skyrl.wake_up(tags=["kv_cache"])
    assert state(http) == (False, False)
    assert greedy(http, 1).json()["output_ids"] == references["served", 1]


def test_sleep_level_2_weights_are_zeros_until_an_update(stack, http, model_dir, references):
    skyrl = SkyRL(stack.http_url)
    skyrl.sleep(level=2)
    skyrl.wake_up()  # every tag: generation continues, but on no weights
    refused = greedy(http, 2)
    assert refused.status_code == 503 and "they were discarded" not in refused.text
    assert "update every tensor" in refused.text
    assert http.post("/update_weights_from_disk", json={"model_path": str(model_dir)}).json()["success"]
    assert greedy(http, 2).json()["output_ids"] == references["served", 2]


def test_sleep_level_1_brings_back_weights_that_no_checkpoint_holds(stack, http, model_dir, perturbed_dir,
                                                                    references):
    """Level 1 promises the weights back (vLLM offloads them to the CPU): pushed weights, which no checkpoint
    holds, come back as they were (a plain release of them resumes as zeros); the KV cache is given back."""
    with FlatwireClient(stack.grpc_address) as client:
        assert client.push_weights(load_file(perturbed_dir / "model.safetensors")).success
    assert greedy(http, 4).json()["output_ids"] == references["perturbed", 4]
    skyrl = SkyRL(stack.http_url)
    skyrl.sleep(level=1)
    assert http.get("/is_sleeping").json()["replicas"][stack.scheduler_address]["memory_released"] == [
        "kv_cache", "weights"]
    skyrl.wake_up()
    assert state(http) == (False, False)
    assert greedy(http, 4).json()["output_ids"] == references["perturbed", 4]
    assert http.post("/update_weights_from_disk", json={"model_path": str(model_dir)}).json()["success"]


def test_reset_prefix_cache_as_vllm_and_skyrl_send_it(stack, http, references):
    """vLLM's query form refuses (success false) while a request runs; SkyRL's body with reset_running_requests
    retracts it first (it is prefilled again, its output whole). Idle, the cache empties: the next request finds
    nothing of its prompt."""
    long_prompt = prompt(11, 200)
    ask = {"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 1}}
    http.post("/generate", json=ask)
    assert http.post("/generate", json=ask).json()["meta_info"]["cached_tokens"] > 100
    assert http.post("/reset_prefix_cache").json()["success"]
    assert http.post("/generate", json=ask).json()["meta_info"]["cached_tokens"] == 0

    stream = Streaming(stack.http_url, prompt(1), NEW_TOKENS)
    wait_until(lambda: stream.tokens >= 2, what="the first tokens")
    refused = http.post("/reset_prefix_cache", params={"reset_running_requests": "false"})
    assert refused.status_code == 200 and refused.json()["success"] is False, refused.text
    assert "requests are running" in refused.json()["message"]
    prefilled, made = stack.stats().prefill_tokens, stream.tokens
    SkyRL(stack.http_url).reset_prefix_cache(reset_running_requests=True)
    assert stream.result()["output_ids"] == references["served", 1]
    # Retracted: its prompt and the output it had were prefilled again (nothing of them left in the cache).
    assert stack.stats().prefill_tokens - prefilled >= len(prompt(1)) + made
    differ = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"},
                       json={"reset_running_requests": False})
    assert differ.status_code == 400 and differ.json()["error"]["param"] == "reset_running_requests"


def test_prime_rl_pauses_in_place_around_its_weight_update(stack, http, model_dir, references):
    prime = PrimeRL(stack.http_url + "/v1")
    prime.check_health()
    assert prime.has_model(http.get("/v1/models").json()["data"][0]["id"])
    stream = Streaming(stack.http_url, prompt(2), NEW_TOKENS)
    wait_until(lambda: stream.tokens >= 2, what="the first tokens")
    prime.pause_engines()
    assert http.get("/is_paused").json()["is_paused"] and stack.stats().running == 1
    assert http.post("/update_weights_from_disk", json={"model_path": str(model_dir)}).json()["success"]
    prime.resume_engines()
    assert stream.result()["output_ids"] == references["served", 2]


def test_prime_rl_filesystem_weight_update(stack, http, model_dir, perturbed_dir, references, tmp_path):
    """prime-rl's update_weights (filesystem broadcast): the checkpoint it names is served after resume, and
    /weight_info reports the version; vLLM's update_info is refused by name (its NCCL engine is not served)."""
    prime = PrimeRL(stack.http_url + "/v1")
    prime.update_weights(perturbed_dir)
    assert not http.get("/is_paused").json()["is_paused"]
    assert greedy(http, 3).json()["output_ids"] == references["perturbed", 3]
    assert set(http.get("/weight_info").json()) == {"weight_version"}
    missing = http.post("/update_weights", json={"weight_dir": str(tmp_path / "none")})
    assert missing.status_code == 400 and "none" in missing.text
    vllm_native = http.post("/update_weights", json={"update_info": {"names": ["lm_head.weight"],
                                                                     "dtype_names": ["float32"], "shapes": [[1]]}})
    assert vllm_native.status_code == 400 and vllm_native.json()["error"]["param"] == "update_info"
    assert http.post("/update_weights", json={}).json()["error"]["param"] == "weight_dir"
    served_again = tmp_path / "served"  # the served checkpoint's files, not its directory: the marker goes here
    served_again.mkdir()
    for file in model_dir.iterdir():
        (served_again / file.name).symlink_to(file)
    prime.update_weights(served_again)
    assert greedy(http, 3).json()["output_ids"] == references["served", 3]


def test_trl_async_grpo_client_pauses_and_resumes(stack, http):
    trl = TRL(stack.http_url)
    assert trl.health() == 200 and trl.get_max_model_len() == http.get("/server_info").json()["context_length"]
    trl.pause()
    assert http.get("/is_paused").json()["is_paused"]
    trl.resume()
    assert not http.get("/is_paused").json()["is_paused"]


@pytest.mark.parametrize(("method", "path", "fields", "param", "says"), [
    ("POST", "/sleep", {"params": {"level": "3"}}, "level", "level: Input should be less than or equal to 2"),
    ("POST", "/pause", {"params": {"mode": "retract"}}, "mode", "mode: Input should be 'abort', 'wait' or 'keep'"),
    ("POST", "/wake_up", {"params": {"tags": "gpu"}}, "tags[0]", "tags[0]: Input should be"),
    ("POST", "/sleep", {"params": {"tags": "weights"}}, "tags", "tags: unrecognized field"),  # vLLM's /sleep has none
    ("POST", "/pause", {"params": [("mode", "keep"), ("mode", "abort")]}, "mode", "mode: given 2 times"),
    ("POST", "/pause", {"json": {"mode": "keep"}}, "body", "/pause takes no body"),
    ("POST", "/reset_prefix_cache", {"json": {"reset_all": True}}, "reset_all", "reset_all: unrecognized field"),
    ("POST", "/resume", {"params": {"now": "1"}}, "now", "now: unrecognized field"),
])
def test_what_vllms_routes_do_not_take_is_refused_by_name(http, method, path, fields, param, says):
    reply = http.request(method, path, **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["message"].startswith(says), reply.text
    assert state(http) == (False, False)  # nothing was paused on the way
