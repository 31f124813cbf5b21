"""SGLang's native endpoints besides /generate, and OpenAI's GET /v1/models/{model}, as SGLang's clients
call them (issue 11)."""

import asyncio
import concurrent.futures
import importlib.metadata
import time
from types import SimpleNamespace

import openai
import orjson
import pytest
from transformers import AutoTokenizer

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def served(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
def test_model_info(http, served, model_dir, path):
    response = http.get(path)
    assert response.status_code == 200
    assert response.json() == {"model_path": served, "tokenizer_path": served, "is_generation": True,
                               "preferred_sampling_params": None, "weight_version": "default"}
    assert str(model_dir) not in response.text  # the served name, never the checkpoint's location


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info(http, served, model_dir, path):
    response = http.get(path)
    assert response.status_code == 200
    info = response.json()
    assert info["version"] == importlib.metadata.version("flatwire")
    assert info["model_path"] == served
    assert info["max_total_num_tokens"] == info["max_running_requests"] * info["context_length"] > 0
    assert info["context_length"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert info["kv_layers"] == "4 layers: 4 full attention"  # the default model's
    assert info["state_bytes_per_request"] == info["state_checkpoints"] == 0  # no linear attention
    # What bench_serving reads after every run (any SGLang 0.4/0.5 version of it).
    server_info_json = info["decode"][0] if "decode" in info else info
    assert server_info_json["internal_states"][0].get("avg_spec_accept_length", None) is None
    assert str(model_dir) not in response.text


def test_server_info_says_which_sglang_server_arguments_hold(http):
    """SGLang's ServerArgs names that frameworks attaching to a running engine compare (slime and miles
    --rollout-external: tests/gateway/test_external_engines.py), with what is true of this stack: one scheduler
    replica on the CPU, releasing memory on request, no routing replay."""
    info = http.get("/get_server_info").json()
    assert {key: info[key] for key in ("nnodes", "node_rank", "tp_size", "pp_size", "ep_size", "dp_size",
                                       "base_gpu_id", "gpu_id_step", "enable_memory_saver",
                                       "enable_return_routed_experts", "enable_lora", "load_format",
                                       "disaggregation_mode", "device")} == {
        "nnodes": 1, "node_rank": 0, "tp_size": 1, "pp_size": 1, "ep_size": 1, "dp_size": 1, "base_gpu_id": 0,
        "gpu_id_step": 1, "enable_memory_saver": True, "enable_return_routed_experts": False,
        "enable_lora": False, "load_format": "auto", "disaggregation_mode": "null", "device": "cpu"}


def test_no_vllm_version_route(http):
    """GET /version is vLLM's (SGLang has none; its version is /server_info's): a router that finds it takes
    the worker for vLLM (smg's detect_backend.rs)."""
    assert http.get("/version").status_code == 404
    assert http.get("/server_info").json()["version"] == importlib.metadata.version("flatwire")
    assert http.get("/v1/models").json()["data"][0]["owned_by"] == "flatwire"


def test_loads_report_each_replica_as_sglang_does(http):
    """SGLang's /v1/loads, as smg polls it (?include=core,disagg,queues,memory), and /get_load: a running request
    shows within a health round (1 s here), and leaves."""
    path = "/v1/loads?include=core,disagg,queues,memory"

    def load() -> dict:
        body = http.get(path).json()
        assert set(body) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        assert body["num_accelerators"] == 0  # the CPU
        [one] = body["loads"]
        return one

    idle = load()
    assert idle["dp_rank"] == 0 and idle["max_total_num_tokens"] > 0 and idle["max_running_requests"] == 16
    assert 0 <= idle["token_usage"] <= 1 and 0 <= idle["cache_hit_rate"] <= 1
    long = {"text": PROMPT, "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(http.post, "/generate", json=long)
        deadline = time.monotonic() + 60
        while (busy := load())["num_running_reqs"] == 0:
            assert time.monotonic() < deadline and not running.done(), "the running request never showed"
            time.sleep(0.1)
        assert busy["num_used_tokens"] > 0 and busy["token_usage"] > 0
        assert busy["num_total_tokens"] >= busy["num_used_tokens"]
        [legacy] = http.get("/get_load").json()  # SGLang's older shape, which sglang-router 0.3 sums
        assert legacy["dp_rank"] == 0 and legacy["num_reqs"] >= 1 and legacy["num_tokens"] > 0
        assert legacy["num_tokens"] >= legacy["num_pending_tokens"] >= 0 and "ts_tic" in legacy
        assert running.result().status_code == 200
    deadline = time.monotonic() + 60  # other tests' requests may share the stack
    while load()["num_running_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert http.get("/v1/loads?dp_rank=0").json()["loads"][0]["dp_rank"] == 0
    for query, param in [("include=core,everything", "include"), ("dp_rank=3", "dp_rank"),
                         ("format=prometheus", "format")]:
        response = http.get(f"/v1/loads?{query}")
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_health_generate(http):
    response = http.get("/health_generate")
    assert response.status_code == 200


def test_tokenize_single_and_list(http, tokenizer):
    response = http.post("/tokenize", json={"prompt": PROMPT})
    assert response.status_code == 200
    body = response.json()
    expected = tokenizer(PROMPT)["input_ids"]
    assert body["tokens"] == expected
    assert body["count"] == len(expected)
    assert body["max_model_len"] == http.get("/get_server_info").json()["context_length"]

    prompts = [PROMPT, "Hello there, world"]
    body = http.post("/v1/tokenize", json={"prompt": prompts, "add_special_tokens": False}).json()
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    assert body["tokens"] == expected
    assert body["count"] == [len(ids) for ids in expected]


def test_detokenize_round_trip(http, tokenizer):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    response = http.post("/detokenize", json={"tokens": ids})
    assert response.status_code == 200
    assert response.json() == {"text": tokenizer.decode(ids, skip_special_tokens=True)}
    body = http.post("/v1/detokenize", json={"tokens": [ids, ids[:1]]}).json()
    assert body == {"text": [tokenizer.decode(ids), tokenizer.decode(ids[:1])]}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"text": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": PROMPT, "bogus": 1}, "bogus"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenizer_endpoints_refuse_bad_input(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_tokenizer_endpoints_check_the_model(http, served):
    assert http.post("/tokenize", json={"prompt": PROMPT, "model": served}).status_code == 200
    response = http.post("/tokenize", json={"prompt": PROMPT, "model": "another-model"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_models_retrieve_with_the_openai_client(stack, http, served):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.retrieve(served)
        assert model.id == served
        assert model.model_dump(exclude_none=True) == http.get("/v1/models").json()["data"][0]
        with pytest.raises(openai.NotFoundError) as raised:
            client.models.retrieve("no-such-model")
    assert raised.value.status_code == 404
    error = http.get("/v1/models/no-such-model").json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"


def _first_event(lines) -> dict:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            return orjson.loads(line[len("data: "):])
    raise AssertionError("the stream ended without an event")


def _last_event(lines) -> dict:
    last = None
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            last = orjson.loads(line[len("data: "):])
    return last


@pytest.mark.parametrize("abort", ["rid", "abort_all"])
def test_abort_request_stops_a_running_generation(http, abort):
    context = http.get("/get_server_info").json()["context_length"]
    max_new = context - 16
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        rid = _first_event(lines)["meta_info"]["id"]
        reply = http.post("/abort_request", json={"rid": rid} if abort == "rid" else {"abort_all": True})
        assert reply.status_code == 200
        last = _last_event(lines)
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < max_new


def test_abort_request_of_an_unknown_rid_is_fine(http):
    assert http.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    assert http.post("/abort_request", json={"rid": "x", "bogus": True}).status_code == 400


class _StalledEngine:
    """An pipeline whose generations never produce a token, or fail at once."""

    def __init__(self, fail: bool):
        self.fail = fail

    async def generate(self, inp):
        from services.gateway.engine_client import RequestError

        assert inp.input_ids == [0] and inp.sampling.max_new_tokens == 1
        if self.fail:
            raise RequestError("unavailable", None, "scheduler down")
        await asyncio.sleep(3600)
        yield None


@pytest.mark.parametrize("fail", [False, True])
def test_health_generate_is_503_when_no_token_comes(monkeypatch, fail):
    from services.gateway.http import native

    monkeypatch.setattr(native, "HEALTH_GENERATE_TIMEOUT_S", 0.2)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(
        gateway=SimpleNamespace(engine=_StalledEngine(fail)))))
    response = asyncio.run(native.health_generate(request))
    assert response.status_code == 503
    assert ("scheduler down" if fail else "no token") in orjson.loads(response.body)["error"]["message"]


def test_openapi_declares_the_bodies(http):
    document = http.get("/openapi.json").json()
    for path, model in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest"),
                        ("/abort_request", "AbortRequest")):
        assert path in document["paths"]
        assert model in document["components"]["schemas"]
