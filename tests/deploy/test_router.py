"""The router RL frameworks launch in front of their SGLang engines (slime, miles, AReaL: smg, sglang-router's
successor, from the package index), in HTTP mode with two flatwire gateways as its workers: it takes them for SGLang
workers (not vLLM), reads their load from /v1/loads, and passes /generate (with smg's own `model`, and flat top-k
as base64) and chat through unchanged; a routing key keeps its worker (smg's X-SMG-Routing-Key, manual policy).

The two gateways share one scheduler (and detokenizer): each is a whole worker to the router, and the gateway that
served a request is the one whose request counter moved.
"""

import base64
import concurrent.futures
import re
import shutil
import subprocess
import time
from functools import partial

import httpx
import numpy as np
import openai
import pytest

from harness.procs import free_port
from harness.stack import Stack

pytestmark = pytest.mark.slow  # runs services and the router as processes of their own

SMG = shutil.which("smg")
FLAT = {"return_logprob": True, "top_logprobs_num": 5, "return_flat_raw_output_top_logprobs": True,
        "return_flat_raw_top_logprobs_b64": True}
GENERATE = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
REQUESTS = re.compile(r'^flatwire_requests_total\{endpoint="/generate"\} (\S+)$', re.MULTILINE)


class Routed:
    """The router and its two workers."""

    def __init__(self, url: str, workers: list[str]):
        self.http = httpx.Client(base_url=url, timeout=120)
        self.url, self.workers = url, workers

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
def routed(model_dir, log_dir):
    if SMG is None:
        pytest.fail("smg is not installed: pip install -e '.[test]'")
    with Stack(model_dir, log_dir, scheduler_args=("--max-running-requests", "16")) as stack:
        stack.add("gateway")
        stack.start()
        workers = [stack.services["gateway"].http_url, stack.services["gateway-1"].http_url]
        port = free_port()
        log = open(log_dir / f"smg-{port}.log", "wb")
        router = subprocess.Popen(
            [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
             "--policy", "manual", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--load-monitor-interval", "1", "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_for_workers(url, router, 2)
            yield Routed(url, workers)
        finally:
            router.terminate()
            router.wait(timeout=30)
            log.close()


def _wait_for_workers(url: str, router: subprocess.Popen, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert router.poll() is None, f"smg exited with {router.returncode}"
        try:
            ready = [w for w in httpx.get(f"{url}/workers", timeout=5).json()["workers"] if w["status"] == "ready"]
            if len(ready) == count:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"smg has not {count} ready workers after {timeout:g} s")


def flat_rows(meta: dict) -> tuple[np.ndarray, np.ndarray]:
    values = np.frombuffer(base64.b64decode(meta["output_top_logprobs_val_flat_b64"]), "<f4")
    ids = np.frombuffer(base64.b64decode(meta["output_top_logprobs_idx_flat_b64"]), "<i4")
    return values.reshape(meta["output_top_logprobs_shape"]), ids.reshape(meta["output_top_logprobs_shape"])


def test_smg_takes_the_gateways_for_sglang_workers_and_reads_their_load(routed):
    workers = routed.http.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(routed.workers)
    assert {w["runtime_type"] for w in workers} == {"sglang"}, workers  # not vllm: it sends SGLang's requests
    assert {w["labels"]["dp_size"] for w in workers} == {"1"}  # read from /server_info
    # Its load sweep (/get_loads) reads the workers' /v1/loads: KV capacity and request slots are there only (its
    # fallback, SGLang's Prometheus gauges, has neither), and a request running on the (shared) scheduler shows.
    def loads() -> list[dict]:
        listed = routed.http.get("/get_loads").json()["loads"]
        assert listed and {load["worker"] for load in listed} <= set(routed.workers), listed
        for load in listed:
            assert load["max_total_num_tokens"] > 0 and load["max_running_requests"] == 16, load
        return listed

    assert all(load["num_running_reqs"] == 0 for load in loads())
    long = {"text": "Once", "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, f"{routed.workers[0]}/generate", json=long, timeout=120)
        deadline = time.monotonic() + 60
        while not any(load["num_running_reqs"] for load in loads()):
            assert time.monotonic() < deadline and not running.done(), "the running request never showed"
            time.sleep(0.2)
        assert running.result().status_code == 200


def test_generate_with_flat_topk_passes_the_router_unchanged(routed):
    """smg re-encodes the body and adds `model` ("unknown": the client named none); the base64 arrays come back
    bit for bit, and so does a stream's, joined; AReaL's empty image_data and a named model pass too."""
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

    served = routed.http.get("/v1/models").json()["data"][0]["id"]
    for extra in ({"image_data": []}, {"model": served}):
        response = routed.http.post("/generate", json={**GENERATE, **extra})
        assert response.status_code == 200 and response.json()["output_ids"] == direct["output_ids"], response.text
    refused = routed.http.post("/generate", json={**GENERATE, "model": "no-such-model"})
    assert refused.status_code in (400, 404), refused.text  # the router's or the worker's refusal, never a 200


def test_chat_with_flat_topk_passes_the_router(routed):
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
    """smg's manual policy: the first request of a key goes to a worker, every later one of the key to the same
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
