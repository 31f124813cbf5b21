"""Rollout control for RL trainers (issue 13): weight updates in place (from disk, pushed as safetensors over
gRPC), pause and continue, abort_all, weight_version per response, refusals, the admin key.

Greedy outputs are checked against transformers' generate on the old and the perturbed weights. One stack
for the module (its weights change under the tests): scheduler, detokenizer, gateway with an admin key and
no API key. The engine's own rules (what waits for what) are checked in-process first, on a synthetic runner.
"""

import json
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
from flatwire_client import FlatwireClient, HttpClient
from flatwire_wire.control import PauseMode
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness.checkpoints import perturbed_checkpoint
from harness.stack import running
from services.common.auth import AccessKeys
from services.scheduler.engine.control import Continue, FlushCache, Pause, SetWeightVersion, UpdateWeights
from services.scheduler.model.synthetic import SyntheticRunner
from services.scheduler.model.weights import StagedWeights
from tests.scheduler.engine_run import Run

ADMIN_KEY = f"admin-{secrets.token_hex(8)}"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PERTURB_SEED = 1313
PERTURBED_LAYERS = (".layers.0.", ".layers.1.")
NEW_TOKENS = 12
IN_FLIGHT = 16
slow = pytest.mark.slow  # the tests that run the stack (the engine's are in-process)


def prompt(seed: int, length: int = 9) -> list[int]:
    return np.random.default_rng(seed).integers(0, 240_000, length).tolist()


# -- the engine's rules, in-process (no threads, no processes) ---------------------------------------------


@pytest.fixture(scope="module")
def synthetic(model_dir):
    return SyntheticRunner(model_dir, 256, 8, step_ms=0)


def harness_of(runner: SyntheticRunner) -> Run:
    return Run(runner, slots=4, page_size=16, max_total_tokens=0)


def test_engine_holds_an_update_until_running_requests_finish(synthetic):
    harness = harness_of(synthetic)
    harness.send("old", prompt(1), max_new_tokens=3)
    harness.step()  # admitted: its first token
    served, new = torch.zeros(2), torch.ones(2)
    update = UpdateWeights(staged=StagedWeights([(served, new)], "test"), abort_all_requests=False,
                           weight_version="v1")
    harness.engine.control(update)
    harness.send("late", prompt(1), max_new_tokens=2)
    harness.step()
    assert not served.any() and not update.done.done()
    assert harness.running() == ["old"]  # "late" is not admitted while the update waits
    harness.step()  # "old" ends on the old weights
    assert not served.any() and harness.running() == []
    harness.step()  # nothing runs: the update applies, then "late" is admitted
    assert served.all() and update.done.result().success and update.done.result().weight_version == "v1"
    harness.run_out()
    assert harness.shipped("old") == [(0, 3, "default")]
    assert harness.shipped("late") == [(0, 2, "v1")]


def test_engine_control_futures_are_settled_by_the_engine_alone(synthetic):
    """A caller that goes away cannot cancel a command (the engine would then fail to answer it), and commands
    the engine will not apply are answered as refused, not left waiting."""
    harness = harness_of(synthetic)
    harness.send("running", prompt(1), max_new_tokens=10)
    harness.step()
    update = UpdateWeights(staged=StagedWeights([], "held"), abort_all_requests=False, weight_version="v1")
    future = harness.engine.control(update)
    assert not future.cancel()
    harness.step()  # held while "running" runs
    assert not future.done()
    harness.engine._stopping = True
    harness.engine._refuse_pending_controls()  # what the engine thread does as it ends
    assert future.result().success is False and "stopping" in future.result().message
    assert harness.engine.control(Continue()).result().success is False  # after the stop: refused at once


def test_engine_paused_in_place_steps_nothing_and_ships_pending_output_before_a_change(synthetic):
    harness = harness_of(synthetic)
    harness.send("kept", prompt(1), max_new_tokens=20)
    for _ in range(3):
        harness.step()
    assert harness.shipped("kept") == []  # 3 tokens pending: it ships its 20 at once, unless something changes
    harness.engine.control(Pause(mode=PauseMode.IN_PLACE))
    harness.step()
    steps = harness.engine.stats.steps
    harness.step()
    assert harness.engine.stats.steps == steps and harness.running() == ["kept"]  # no step, the request kept
    update = UpdateWeights(staged=StagedWeights([], "test"), abort_all_requests=False, weight_version="v2")
    harness.engine.control(update)
    harness.step()  # paused: applies at once, after shipping what "kept" made so far
    assert update.done.result().num_paused_requests == 1
    assert harness.shipped("kept") == [(0, 3, "default")]
    relabel = SetWeightVersion(version="v3", abort_all_requests=False)
    harness.engine.control(relabel)
    harness.engine.control(Continue())
    harness.step()
    assert relabel.done.result().weight_version == "v3"
    harness.run_out()
    assert harness.shipped("kept") == [(0, 3, "default"), (3, 17, "v3")]


def test_engine_pause_wait_admits_nothing_and_answers_once_the_running_requests_end(synthetic):
    """vLLM's pause mode wait: the running request finishes (every token of it), the waiting one is not admitted,
    and the pause answers only then; the stats say paused from the call on (vLLM's is_paused)."""
    harness = harness_of(synthetic)
    harness.send("running", prompt(1), max_new_tokens=4)
    harness.step()
    pause = harness.engine.control(Pause(mode=PauseMode.WAIT))
    harness.send("late", prompt(2), max_new_tokens=2)
    harness.step()
    assert not pause.done() and harness.running() == ["running"] and harness.engine.stats.paused
    harness.step(6)
    assert pause.result().success and harness.running() == []
    assert harness.finish("running").output_tokens == 4 and harness.finish("late") is None
    steps = harness.engine.stats.steps
    harness.step(3)
    assert harness.engine.stats.steps == steps and harness.engine.stats.paused  # paused: "late" waits
    harness.engine.control(Continue())
    harness.run()
    assert harness.finish("late").output_tokens == 2 and not harness.engine.stats.paused


def test_engine_continue_before_a_wait_pause_drains_refuses_that_pause(synthetic):
    harness = harness_of(synthetic)
    harness.send("running", prompt(1), max_new_tokens=6)
    harness.step()
    pause = harness.engine.control(Pause(mode=PauseMode.WAIT))
    harness.step()
    harness.engine.control(Continue())
    harness.step()
    assert pause.result().success is False and "continued before" in pause.result().message
    harness.send("after", prompt(2), max_new_tokens=2)
    harness.run()  # admitting again
    assert harness.finish("after").output_tokens == 2


def test_engine_reset_prefix_cache_is_refused_while_requests_run_unless_they_are_retracted(synthetic):
    """vLLM's reset_prefix_cache: refused while a request runs (its KV is in use), waiting ones do not count; with
    reset_running_requests the running ones are retracted (prefilled again, their output whole) and it succeeds."""
    harness = harness_of(synthetic)
    harness.send("a", prompt(1, 40), max_new_tokens=8)
    harness.step(2)
    refused = harness.engine.control(FlushCache(reset_running_requests=False))
    sglang = harness.engine.control(FlushCache())
    harness.step()
    assert refused.result().success is False and "1 requests are running" in refused.result().message
    assert sglang.result().success is False
    prefilled = harness.engine.stats.prefill_tokens
    reset = harness.engine.control(FlushCache(reset_running_requests=True))
    harness.step()
    assert reset.result().success and "1 running requests retracted" in reset.result().message
    # Prefilled again whole, prompt and output so far: the pages it had put in the cache were flushed.
    assert harness.engine.stats.prefill_tokens - prefilled >= 40
    harness.run()
    assert harness.finish("a").output_tokens == 8 and len(harness.output("a")) == 8
    harness.engine.control(Pause(mode=PauseMode.IN_PLACE))
    harness.send("waiting", prompt(2), max_new_tokens=2)
    waiting_only = harness.engine.control(FlushCache(reset_running_requests=False))
    harness.step()
    assert waiting_only.result().success  # a waiting request holds no KV (SGLang's flush_cache would refuse)


def test_access_keys_follow_sglang():
    open_, api, admin, both = AccessKeys(), AccessKeys("k"), AccessKeys(None, "a"), AccessKeys("k", "a")
    assert open_.allows(None, admin=False) and open_.allows(None, admin=True)
    assert api.allows("k", admin=True) and not api.allows(None, admin=True) and not api.allows("x", admin=False)
    assert admin.allows(None, admin=False) and admin.allows("a", admin=True) and not admin.allows("k", admin=True)
    assert both.allows("k", admin=False) and not both.allows("a", admin=False)  # the admin key is not an API key
    assert both.allows("a", admin=True) and not both.allows("k", admin=True)


# -- the stack ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    with running(model_dir, log_dir,
                 scheduler_args=("--max-running-requests", str(IN_FLIGHT), "--context-length", "1024"),
                 gateway_env={"FLATWIRE_ADMIN_API_KEY": ADMIN_KEY}) as stack:
        stack.wait_ready()  # the gateway admits once the whole path works
        yield stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def admin_client(stack):
    with FlatwireClient(stack.grpc_address, admin_api_key=ADMIN_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def perturbed_dir(model_dir, tmp_path_factory) -> Path:
    """The default model with noise on two layers (fixed seed), saved as a checkpoint beside its tokenizer."""
    return perturbed_checkpoint(model_dir, tmp_path_factory.mktemp("perturbed"), PERTURB_SEED, PERTURBED_LAYERS)


@pytest.fixture(scope="module")
def references(model_dir, perturbed_dir) -> dict:
    return {"old": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
            "new": AutoModelForCausalLM.from_pretrained(perturbed_dir, dtype=torch.float32).eval()}


def transformers_greedy(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()


def greedy(http, ids: list[int], new_tokens: int = NEW_TOKENS) -> dict:
    """/generate, greedy, stopping at eos as transformers' generate does."""
    reply = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens,
                                                                               "temperature": 0}})
    assert reply.status_code == 200, reply.text
    return reply.json()


def update_from_disk(http, path: Path, **fields) -> httpx.Response:
    return http.post("/update_weights_from_disk", json={"model_path": str(path), **fields}, headers=ADMIN)


class Streaming:
    """A streaming /generate in a thread: how many tokens so far, and its last event."""

    def __init__(self, url: str, ids: list[int], new_tokens: int, ignore_eos: bool = True, **fields):
        self.tokens = 0
        self.last: dict | None = None
        body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                                      "ignore_eos": ignore_eos}, **fields}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.last = json.loads(line[len("data: "):])
                    self.tokens = self.last["meta_info"]["completion_tokens"]

    def result(self, timeout: float = 120) -> dict:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        assert self.last is not None
        return self.last


def wait_until(condition, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def start_streams(stack, count: int, new_tokens: int, **fields) -> list[Streaming]:
    streams = [Streaming(stack.http_url, prompt(100 + i), new_tokens, **fields) for i in range(count)]
    wait_until(lambda: all(s.tokens >= 2 for s in streams), what="every stream's first tokens")
    return streams


HELD = "weight update held until"  # the scheduler's log line


def served_version(http) -> str:
    return http.get("/model_info").json()["weight_version"]


@slow
def test_weight_version_starts_as_default(http):
    assert served_version(http) == "default"
    assert http.get("/get_weight_version").json() == {"weight_version": "default"}  # SGLang's route
    meta = greedy(http, prompt(1))["meta_info"]
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": meta["completion_tokens"]}]


@slow
def test_sglangs_other_update_fields_are_taken_at_what_flatwire_does(http, model_dir):
    """A client that sends every field of SGLang's UpdateWeightFromDiskReqInput sends them at their defaults;
    a value flatwire would not honour is refused by name."""
    neutral = {"is_async": False, "torch_empty_cache": False, "keep_pause": False, "recapture_cuda_graph": False,
               "token_step": 0, "flush_cache": True, "manifest": None}
    reply = update_from_disk(http, model_dir, **neutral)
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert http.get("/get_weight_version").json() == {"weight_version": served_version(http)}
    for field, value in (("keep_pause", True), ("token_step", 3), ("is_async", True)):
        refused = update_from_disk(http, model_dir, **{**neutral, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    unnamed = update_from_disk(http, model_dir, weight_version="")  # as /update_weight_version refuses it
    assert not unnamed.json()["success"] and unnamed.json()["message"] == "weight_version: must not be empty"


@slow
def test_update_from_disk_while_serving(stack, http, model_dir, perturbed_dir, references):
    ids = prompt(7)
    old, new = transformers_greedy(references["old"], ids), transformers_greedy(references["new"], ids)
    assert old != new  # the perturbation changes what greedy decoding picks
    assert update_from_disk(http, model_dir, weight_version="v0").json()["success"]
    assert greedy(http, ids)["output_ids"] == old

    running = start_streams(stack, 4, 300)
    held = stack.procs["scheduler"].log().count(HELD)
    with ThreadPoolExecutor(1) as pool:
        update = pool.submit(update_from_disk, http, perturbed_dir, weight_version="v1")
        # Read, checked and held (reading the checkpoint can take seconds on a busy host): from then on the
        # scheduler admits nothing until the running ones end.
        wait_until(lambda: stack.procs["scheduler"].log().count(HELD) > held, what="the update held")
        assert not update.done() and all(s.tokens < 300 for s in running)
        late = Streaming(stack.http_url, ids, NEW_TOKENS, ignore_eos=False)  # arrives while they run
        reply = update.result(timeout=120)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["success"] and body["weight_version"] == "v1" and body["num_paused_requests"] == 0
    assert [replica["success"] for replica in body["replicas"].values()] == [True]
    for stream in running:  # they finished, whole, on the old weights
        meta = stream.result()["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["weight_versions"] == [{"version": "v0", "start": 0, "end": 300}]
    late_event = late.result()  # it waited, then ran on the new weights only
    assert late_event["output_ids"] == new
    assert late_event["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": len(new)}]

    after = greedy(http, ids)
    assert after["output_ids"] == new and after["meta_info"]["weight_version"] == "v1"
    assert served_version(http) == "v1"
    with FlatwireClient(stack.grpc_address) as client:
        assert client.model_info().weight_version == "v1"


@slow
def test_update_with_abort_all_requests_returns_partial_outputs(stack, http, model_dir, references):
    version = served_version(http)
    streams = start_streams(stack, 4, 600, return_logprob=True, top_logprobs_num=3)
    reply = update_from_disk(http, model_dir, abort_all_requests=True, weight_version="old")
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert sum(replica["aborted_requests"] for replica in reply.json()["replicas"].values()) >= 4
    for stream in streams:
        meta = stream.result()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 600
        assert len(meta["output_top_logprobs"]) == meta["completion_tokens"]  # their top-k come with them
        assert meta["weight_versions"] == [{"version": version, "start": 0, "end": meta["completion_tokens"]}]
    ids = prompt(7)
    assert greedy(http, ids)["output_ids"] == transformers_greedy(references["old"], ids)


@slow
def test_pushed_safetensors_equal_the_disk_update(stack, http, model_dir, perturbed_dir, references, admin_client):
    ids = prompt(7)
    assert update_from_disk(http, model_dir, weight_version="old").json()["success"]
    perturbed = {name: tensor for name, tensor in load_file(perturbed_dir / "model.safetensors").items()
                 if any(layer in name for layer in PERTURBED_LAYERS)}  # a subset: the layers that changed
    response = admin_client.push_weights(perturbed, weight_version="pushed")
    assert response.success, response.message
    assert response.replicas[stack.scheduler_address].weight_version == "pushed"
    body = greedy(http, ids)
    assert body["output_ids"] == transformers_greedy(references["new"], ids)
    assert body["meta_info"]["weight_version"] == "pushed"
    result = admin_client.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, temperature=0)
    assert result.weight_version == "pushed"
    assert [(s.version, s.start, s.end) for s in result.weight_versions] == [("pushed", 0, len(result.token_ids))]


@slow
def test_a_request_that_spans_an_update_says_which_weights_made_which_tokens(stack, model_dir, admin_client):
    assert admin_client.update_weight_version("before", abort_all_requests=False).success
    [stream] = start_streams(stack, 1, 200)
    assert admin_client.pause_generation("in_place").success
    time.sleep(0.3)  # what was produced before the pause arrives
    made = stream.tokens
    response = admin_client.update_weights_from_disk(str(model_dir), weight_version="after")
    assert response.success and response.replicas[stack.scheduler_address].num_paused_requests == 1
    assert admin_client.continue_generation().success
    meta = stream.result()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "after"
    assert meta["weight_versions"] == [{"version": "before", "start": 0, "end": made},
                                       {"version": "after", "start": made, "end": 200}]


@slow
def test_pause_retract_prefills_kept_requests_again_under_the_new_weights(stack, http, model_dir, perturbed_dir,
                                                                          references, admin_client):
    """retract (SGLang's): running requests drop their KV and are prefilled again on continue, prompt and output so
    far, so the rest of the output is what the new weights generate from there (in_place would keep old K/V)."""
    assert update_from_disk(http, model_dir, weight_version="old").json()["success"]
    ids, new_tokens = prompt(8), 40
    stream = Streaming(stack.http_url, ids, new_tokens, ignore_eos=False)
    wait_until(lambda: stream.tokens >= 3, what="the stream's first tokens")
    assert admin_client.pause_generation("retract").success
    time.sleep(0.3)  # what was produced before the pause arrives
    response = admin_client.update_weights_from_disk(str(perturbed_dir), weight_version="new")
    # none kept in place
    assert response.success and response.replicas[stack.scheduler_address].num_paused_requests == 0
    assert admin_client.continue_generation().success
    last = stream.result()
    output, spans = last["output_ids"], last["meta_info"]["weight_versions"]
    assert [span["version"] for span in spans] == ["old", "new"]
    made = spans[0]["end"]
    assert output[:made] == transformers_greedy(references["old"], ids, made)
    assert output[made:] == transformers_greedy(references["new"], ids + output[:made], new_tokens - made)
    assert update_from_disk(http, model_dir).json()["success"]  # the weights the other tests expect


@slow
def test_pause_in_place_and_continue_under_16_requests(stack, http, admin_client):
    streams = start_streams(stack, IN_FLIGHT, 100)
    assert admin_client.pause_generation("in_place").success
    time.sleep(0.3)
    held = [s.tokens for s in streams]
    waiting = Streaming(stack.http_url, prompt(9), 5)  # arrives while paused: waits
    time.sleep(0.7)
    assert [s.tokens for s in streams] == held and waiting.tokens == 0 and max(held) < 100
    reply = http.post("/continue_generation", headers=ADMIN)
    assert reply.status_code == 200 and reply.json()["status"] == "ok", reply.text
    for stream in [*streams, waiting]:
        assert stream.result()["meta_info"]["finish_reason"]["type"] == "length"
    assert [s.tokens for s in streams] == [100] * IN_FLIGHT and waiting.tokens == 5


@slow
def test_pause_abort_mode_ends_16_requests_with_their_partial_outputs(stack, http):
    streams = start_streams(stack, IN_FLIGHT, 600, return_logprob=True, top_logprobs_num=4)
    reply = http.post("/pause_generation", json={"mode": "abort"}, headers=ADMIN)
    assert reply.status_code == 200 and reply.json()["message"] == "Generation paused successfully.", reply.text
    for stream in streams:
        meta = stream.result()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 600
        assert len(meta["output_top_logprobs"]) == meta["completion_tokens"]
        assert all(len(row) == 4 for row in meta["output_top_logprobs"])
    assert http.post("/continue_generation", headers=ADMIN).status_code == 200
    assert greedy(http, prompt(3))["meta_info"]["finish_reason"]["type"] in ("length", "stop")


@slow
def test_abort_all_ends_16_requests_with_their_partial_outputs(stack, http):
    streams = start_streams(stack, IN_FLIGHT, 600, return_logprob=True, top_logprobs_num=4)
    reply = http.post("/abort_request", json={"abort_all": True}, headers=ADMIN)
    assert reply.status_code == 200, reply.text
    for stream in streams:
        event = stream.result()
        meta = event["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 600
        assert len(event["output_ids"]) == len(meta["output_top_logprobs"]) == meta["completion_tokens"]


@slow
def test_a_mismatched_checkpoint_is_refused_and_serving_goes_on(stack, http, model_dir, tmp_path, admin_client):
    ids = prompt(7)
    before = greedy(http, ids)
    version = before["meta_info"]["weight_version"]
    smaller = tmp_path / "smaller"
    shutil.copytree(model_dir, smaller)
    config = json.loads((smaller / "config.json").read_text())
    config.update(num_hidden_layers=2, layer_types=config["layer_types"][:2])
    (smaller / "config.json").write_text(json.dumps(config))
    with HttpClient(stack.http_url, admin_api_key=ADMIN_KEY) as client:
        body = client.update_weights_from_disk(str(smaller), weight_version="never")
        assert not body["success"] and "num_hidden_layers 4 served, 2 in the checkpoint" in body["message"]
        assert not client.update_weights_from_disk(str(model_dir), load_format="pt")["success"]  # pickle: never
    pushed = admin_client.push_weights({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    assert not pushed.success and "model.layers.0.mlp.up_proj.weight [384, 128] served, [3, 3] given" in pushed.message
    after = greedy(http, ids)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == version
    assert served_version(http) == version


@slow
@pytest.mark.parametrize("path, body", [
    ("/update_weights_from_disk", {"model_path": "/nowhere"}), ("/pause_generation", {}),
    ("/continue_generation", {}), ("/update_weight_version", {"new_version": "x"}),
    ("/update_weights_from_tensor", {}), ("/abort_request", {"abort_all": True})])
def test_admin_routes_need_the_admin_key(http, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
        reply = http.post(path, json=body, headers=headers)
        assert reply.status_code == 401, (path, headers, reply.text)
        assert reply.json()["error"]["code"] == "invalid_api_key"


@slow
def test_ordinary_routes_stay_open_and_grpc_admin_methods_need_the_key(stack, http):
    assert http.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    assert http.get("/model_info").status_code == 200
    with FlatwireClient(stack.grpc_address) as client:
        assert client.generate(input_ids=prompt(2), max_new_tokens=2, ignore_eos=True).completion_tokens == 2
        missed = client.abort("no-such-request")  # Abort by rid is an ordinary method
        assert not missed.success and missed.message == "no running request 'no-such-request' on this gateway"
        for call in (client.continue_generation, client.abort_all, lambda: client.push_weights({})):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with FlatwireClient(stack.grpc_address, admin_api_key="wrong") as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.update_weight_version("x", abort_all_requests=False)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = http.post("/update_weight_version", json={"new_version": "relabelled", "abort_all_requests": False},
                      headers=ADMIN)
    assert reply.status_code == 200, reply.text
    assert reply.json() | {"replicas": None} == {"success": True, "message": "Weight version updated to relabelled.",
                                                 "new_version": "relabelled", "replicas": None}
    assert greedy(http, prompt(2))["meta_info"]["weight_version"] == "relabelled"
