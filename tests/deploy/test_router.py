"""The routers RL frameworks launch in front of their SGLang engines, from the package index: smg 1.13 (slime's,
miles' and AReaL's router today) and sglang-router 0.3 (the `sglang_router` package slime and miles import), in
HTTP mode with two flatwire gateways as their workers: each takes them for SGLang workers (smg: not vLLM), reads their
load (smg: /v1/loads, sglang-router: /get_load), and passes /generate (with smg's own `model`, and flat top-k as
base64) and chat through unchanged; a routing key keeps its worker (X-SMG-Routing-Key, the manual policy).

The two gateways share one scheduler (and detokenizer): each is a whole worker to the router, and the gateway that
served a request is the one whose request counter moved. The routers run as `python -m` (both distributions install
an `smg` command). They run on the small vocabulary's model (tests/conftest.py small_model_dir): what is routed, not
the tokens, is the subject.
"""

import base64
import concurrent.futures
import re
import subprocess
import sys
import time
from functools import partial

import httpx
import numpy as np
import openai
import pytest

from harness.procs import free_port
from harness.stack import Stack

pytestmark = pytest.mark.slow  # runs services and the routers as processes of their own

ROUTERS = {"smg": ["-m", "smg", "launch", "--load-monitor-interval", "1"],
           "sglang-router": ["-m", "sglang_router.launch_router"]}
# smg re-encodes a body through its own request types and keeps the fields they do not declare; sglang-router 0.3.2
# drops them (the flat flags; chat's return_meta_info): through it, top-k come in SGLang's nested format only.
KEEPS_UNDECLARED_FIELDS = {"smg": True, "sglang-router": False}
FLAT = {"return_logprob": True, "top_logprobs_num": 5, "return_flat_raw_output_top_logprobs": True,
        "return_flat_raw_top_logprobs_b64": True}
GENERATE = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
REQUESTS = re.compile(r'^flatwire_requests_total\{endpoint="/generate"\} (\S+)$', re.MULTILINE)


class Routed:
    """A router and its two workers."""

    def __init__(self, name: str, url: str, workers: list[str]):
        self.http = httpx.Client(base_url=url, timeout=120)
        self.name, self.url, self.workers = name, url, workers

    def served_by(self, send) -> int:
        """Which worker's /generate counter `send()` moved (requests one at a time)."""
        before = self.counts()
        send()
        after = self.counts()
        moved = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
        assert len(moved) == 1, (before, after)
        return moved[0]

    def counts(self) -> list[float]:
        return [float(REQUESTS.search(httpx.get(f"{url}/metrics").text).group(1)) for url in self.workers]


@pytest.fixture(scope="module")
def workers(small_model_dir, log_dir):
    """Two gateways on one scheduler and detokenizer: their HTTP URLs."""
    with Stack(small_model_dir, log_dir, scheduler_args=("--max-running-requests", "16")) as stack:
        stack.add("gateway")
        stack.start()
        yield [stack.services["gateway"].http_url, stack.services["gateway-1"].http_url]


@pytest.fixture(scope="module", params=list(ROUTERS))
def routed(request, workers, log_dir):
    port = free_port()
    log = open(log_dir / f"{request.param}-{port}.log", "wb")
    router = subprocess.Popen(
        [sys.executable, *ROUTERS[request.param], "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
         *workers, "--policy", "manual", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_workers(url, router, len(workers))
        yield Routed(request.param, url, workers)
    finally:
        router.terminate()
        router.wait(timeout=30)
        log.close()


def _wait_for_workers(url: str, router: subprocess.Popen, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert router.poll() is None, f"the router exited with {router.returncode}"
        try:
            listed = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
            if sum(worker.get("status", "ready") == "ready" and worker.get("is_healthy", True)
                   for worker in listed) == count:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the router has not {count} ready workers after {timeout:g} s")


def flat_rows(meta: dict) -> tuple[np.ndarray, np.ndarray]:
    values = np.frombuffer(base64.b64decode(meta["output_top_logprobs_val_flat_b64"]), "<f4")
    ids = np.frombuffer(base64.b64decode(meta["output_top_logprobs_idx_flat_b64"]), "<i4")
    return values.reshape(meta["output_top_logprobs_shape"]), ids.reshape(meta["output_top_logprobs_shape"])


def test_the_router_takes_the_gateways_for_sglang_workers_and_reads_their_load(routed):
    workers = routed.http.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(routed.workers)
    if routed.name == "smg":
        assert {w["runtime_type"] for w in workers} == {"sglang"}, workers  # not vllm: it sends SGLang's requests
    assert {(w.get("labels") or w.get("metadata"))["dp_size"] for w in workers} == {"1"}  # read from /server_info

    def loads() -> list[dict]:
        """smg's load sweep reads /v1/loads: KV capacity and request slots are there only (its fallback, SGLang's
        Prometheus gauges, has neither); sglang-router's, /get_load: -1 where a worker has none."""
        if routed.name == "smg":
            listed = routed.http.get("/get_loads").json()["loads"]
            assert listed and {load["worker"] for load in listed} <= set(routed.workers), listed
            for load in listed:
                assert load["max_total_num_tokens"] > 0 and load["max_running_requests"] == 16, load
            return [load["num_running_reqs"] for load in listed]
        listed = routed.http.get("/get_loads").json()["workers"]
        assert sorted(load["worker"] for load in listed) == sorted(routed.workers), listed
        assert all(load["load"] >= 0 for load in listed), listed
        return [load["load"] for load in listed]  # tokens: held and waiting

    assert not any(loads())
    long = {"text": "Once", "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a request running on the (shared) scheduler shows
        running = pool.submit(httpx.post, f"{routed.workers[0]}/generate", json=long, timeout=120)
        deadline = time.monotonic() + 60
        while not any(loads()):
            assert time.monotonic() < deadline and not running.done(), "the running request never showed"
            time.sleep(0.2)
        assert running.result().status_code == 200


def test_generate_with_nested_topk_passes_the_router_unchanged(routed):
    """SGLang's own format, and AReaL's empty image_data, and the served model by name; a model nothing serves is
    refused (by the router or the worker), never answered."""
    nested = {**GENERATE, "return_logprob": True, "top_logprobs_num": 5}
    direct = httpx.post(f"{routed.workers[0]}/generate", json=nested, timeout=120).json()
    served = routed.http.get("/v1/models").json()["data"][0]["id"]
    for extra in ({}, {"image_data": []}, {"model": served}):
        response = routed.http.post("/generate", json={**nested, **extra})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["output_ids"] == direct["output_ids"]
        assert body["meta_info"]["output_top_logprobs"] == direct["meta_info"]["output_top_logprobs"]
    refused = routed.http.post("/generate", json={**GENERATE, "model": "no-such-model"})
    assert refused.status_code in (400, 404), refused.text


def test_generate_with_flat_topk_passes_the_router_unchanged(routed):
    """smg re-encodes the body and adds `model` ("unknown": the client named none); the base64 arrays come back
    bit for bit, and so does a stream's, joined."""
    if not KEEPS_UNDECLARED_FIELDS[routed.name]:
        pytest.skip(f"{routed.name} drops the flat flags")
    direct = httpx.post(f"{routed.workers[0]}/generate", json={**GENERATE, **FLAT}, timeout=120).json()
    through = routed.http.post("/generate", json={**GENERATE, **FLAT})
    assert through.status_code == 200, through.text
    body = through.json()
    assert body["output_ids"] == direct["output_ids"]
    for got, expected in zip(flat_rows(body["meta_info"]), flat_rows(direct["meta_info"])):
        assert got.tobytes() == expected.tobytes()

    rows = []
    with routed.http.stream("POST", "/generate", json={**GENERATE, **FLAT, "stream": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                meta = httpx.Response(200, content=line[6:]).json()["meta_info"]
                if "output_top_logprobs_val_flat_b64" in meta:
                    rows.append(flat_rows(meta))
    assert np.concatenate([v for v, _ in rows]).tobytes() == flat_rows(direct["meta_info"])[0].tobytes()
    assert np.concatenate([i for _, i in rows]).tobytes() == flat_rows(direct["meta_info"])[1].tobytes()



def test_chat_with_flat_topk_passes_the_router(routed):
    if not KEEPS_UNDECLARED_FIELDS[routed.name]:
        pytest.skip(f"{routed.name} drops return_meta_info")
    served = httpx.get(f"{routed.workers[0]}/v1/models").json()["data"][0]["id"]
    body = {"model": served, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 3,
            "extra_body": {"return_meta_info": True, "return_flat_raw_output_top_logprobs": True}}
    answers = []
    for url in (routed.workers[0], routed.url):
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            answers.append(client.chat.completions.create(**body).model_dump())
    direct, through = (answer["choices"][0] for answer in answers)
    assert through["message"]["content"] == direct["message"]["content"]
    for got, expected in zip(flat_rows(through["meta_info"]), flat_rows(direct["meta_info"])):
        assert got.tobytes() == expected.tobytes()


def test_a_routing_key_keeps_its_worker(routed):
    """The manual policy: the first request of a key goes to a worker, every later one of the key to the same
    (twelve keys: both workers take some)."""
    homes = {}
    for key in (f"session-{i}" for i in range(12)):
        served = {routed.served_by(partial(_generate, routed, {"X-SMG-Routing-Key": key})) for _ in range(3)}
        assert len(served) == 1, (key, served)
        homes[key] = served.pop()
    assert set(homes.values()) == {0, 1}, homes


def _generate(routed: Routed, headers: dict) -> None:
    response = routed.http.post("/generate", json=GENERATE, headers=headers)
    assert response.status_code == 200, response.text
