"""A trainer colocated with the engine (issue 49): SGLang's /update_weights_from_tensor as slime, miles, NeMo-RL, verl
and SGLang's own engine send it (tests/scheduler/framework_calls.py, copied from their sources), tensors in
shared memory; miles' weight-update session, its flush while paused; slime's memory tags, weights_checker and
post_process_weights. Greedy outputs after an update equal transformers' generate on the weights sent; hostile
pickles are refused with 400 naming what they asked for, and nothing changes.

One stack for the module (its weights change under the tests): a scheduler, a detokenizer, a gateway with an admin
key; the test process is the trainer (its tensors' shared memory lives as long as each call).
"""

import base64
import os
import pickle
import threading
import time
from collections import OrderedDict
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness.checkpoints import perturbed_checkpoint
from harness.sglang_payloads import pickled, serialize, shared_memory
from harness.stack import running
from services.scheduler.model.tensor_payload import MAX_ENTRY_BYTES
from tests.scheduler import framework_calls as frameworks
from tests.scheduler.framework_calls import Call

pytestmark = pytest.mark.slow
ADMIN_KEY = "admin-colocated"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = [9707, 11, 1879, 374, 264, 1273, 13]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    with running(model_dir, log_dir, scheduler_args=("--max-total-tokens", "32768"),
                 gateway_env={"FLATWIRE_ADMIN_API_KEY": ADMIN_KEY}) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=300, headers=ADMIN) as client:
        yield client


@pytest.fixture(scope="module")
def perturbed_dir(model_dir, tmp_path_factory) -> Path:
    return perturbed_checkpoint(model_dir, tmp_path_factory.mktemp("trained"), 4949, (".layers.0.", ".layers.2."))


def checkpoint_tensors(path: Path, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor if dtype is None else tensor.to(dtype))
            for name, tensor in load_file(path / "model.safetensors").items()]


def transformers_greedy(path: Path, round_to: torch.dtype | None = None) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        if round_to is not None:  # what a server holds of weights sent in `round_to`
            for parameter in model.parameters():
                parameter.copy_(parameter.to(round_to).float())
        return model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[
            0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def references(model_dir, perturbed_dir) -> dict[str, list[int]]:
    return {"old": transformers_greedy(model_dir), "new": transformers_greedy(perturbed_dir)}


def served_greedy(http) -> list[int]:
    reply = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                                                   "temperature": 0}})
    assert reply.status_code == 200, reply.text
    return reply.json()["output_ids"]


def served_version(http) -> str:
    return http.get("/model_info").json()["weight_version"]


def send(http, call: Call) -> httpx.Response:
    if call.method == "GET":
        return http.get(call.path)
    return http.post(call.path, json=call.body) if call.body is not None else http.post(call.path)


def send_all(http, calls: list[Call]) -> None:
    """Each call answered 200 (with SGLang's success where its answer is JSON: /flush_cache's is text)."""
    for call in calls:
        reply = send(http, call)
        assert reply.status_code == 200, (call.path, reply.text)
        if reply.headers["content-type"] == "application/json":
            assert reply.json().get("success", True), (call.path, reply.text)


def serve(http, path: Path, version: str = "disk") -> None:
    reply = http.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": version})
    assert reply.status_code == 200 and reply.json()["success"], reply.text


def halves(named: list) -> list[list]:
    return [named[:len(named) // 2], named[len(named) // 2:]]


FRAMEWORKS = {
    "slime": lambda named: frameworks.slime_update_cycle(named, 1),
    "miles": lambda named: frameworks.miles_update_cycle(halves(named), 1),
    "nemo-rl": lambda named: frameworks.nemo_rl_update(named, 1),
    "verl": frameworks.verl_update,
    "sglang engine": lambda named: [frameworks.sglang_engine_update(named)],
    "sglang engine, direct": lambda named: [frameworks.sglang_engine_update(named, "direct")],
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_frameworks_tensor_update_serves_transformers_greedy_of_the_new_weights(http, model_dir, perturbed_dir,
                                                                                     references, framework):
    serve(http, model_dir)
    assert served_greedy(http) == references["old"] != references["new"]
    send_all(http, FRAMEWORKS[framework](checkpoint_tensors(perturbed_dir)))
    assert served_greedy(http) == references["new"]
    assert served_version(http) == ("1" if framework in ("slime", "miles", "nemo-rl") else "disk")


def test_bfloat16_tensors_are_cast_into_the_served_dtype(http, model_dir, perturbed_dir):
    serve(http, model_dir)
    send_all(http, frameworks.slime_update_cycle(checkpoint_tensors(perturbed_dir, torch.bfloat16), 2))
    assert served_greedy(http) == transformers_greedy(perturbed_dir, round_to=torch.bfloat16)


class Runs:
    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def refused_body(http, entry: str, load_format: str | None = None) -> str:
    """An update of one entry: 400, what the message says; the weights, their version and the service unchanged."""
    before, version = served_greedy(http), served_version(http)
    reply = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry],
                                                           "load_format": load_format, "weight_version": "hostile"})
    assert reply.status_code == 400 and not reply.json()["success"], reply.text
    assert served_greedy(http) == before and served_version(http) == version
    assert http.get("/health_generate").status_code == 200
    return reply.json()["message"]


def test_hostile_pickles_are_refused_by_name_and_change_nothing(http, stack, model_dir, perturbed_dir, tmp_path):
    """A payload whose first tensors are genuine and whose last asks to run a command applies none of them."""
    serve(http, model_dir)
    marker = tmp_path / "ran"
    named = checkpoint_tensors(perturbed_dir)
    system = f"{os.system.__module__}.system"
    with shared_memory():
        genuine_then_hostile = serialize([*named[:10], ("x", Runs(os.system, f"touch {marker}"))])
        state_dict = serialize(OrderedDict(named[:2]))
    cases = {
        base64.b64encode(pickle.dumps(Runs(os.system, f"touch {marker}"))).decode(): system,
        genuine_then_hostile: system,
        base64.b64encode(f"(S'touch {marker}'\nios\nsystem\n.".encode()).decode(): "os.system",
        # protocol 0 names Python 2's module (pickle's fix_imports): refused as named, never mapped
        base64.b64encode(pickle.dumps([("a", [Runs(eval, "1")])], protocol=0)).decode(): "__builtin__.eval",
        state_dict: "collections.OrderedDict",
    }
    for entry, name in cases.items():
        assert f"{name} is not read here" in refused_body(http, entry)
    assert not marker.exists()
    oversized = base64.b64encode(b"\x80" * (MAX_ENTRY_BYTES + 1)).decode()
    assert f"more than {MAX_ENTRY_BYTES}" in refused_body(http, oversized)
    descriptor = base64.b64encode(pickled(named[:1])).decode()  # torch's default strategy: file_descriptor
    assert "set_sharing_strategy('file_system')" in refused_body(http, descriptor)
    assert stack.procs["scheduler"].proc.poll() is None


def test_bad_requests_are_refused_by_field(http, perturbed_dir):
    with shared_memory():
        entry = serialize(checkpoint_tensors(perturbed_dir)[:1])
        wrong_shape = serialize([("model.layers.0.mlp.up_proj.weight", torch.zeros(2, 2))])
    for body, param in (({"serialized_named_tensors": ["not base64!"]}, "serialized_named_tensors[0]"),
                        ({"serialized_named_tensors": [entry], "load_format": "auto"}, "load_format"),
                        ({"serialized_named_tensors": [entry], "selector": "draft"}, "selector"),
                        ({"serialized_named_tensors": [entry], "torch_empty_cache": True}, "torch_empty_cache")):
        reply = http.post("/update_weights_from_tensor", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    two_ranks = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry, entry]})
    assert two_ranks.status_code == 400 and "one entry per rank" in two_ranks.json()["message"]
    wrong = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [wrong_shape]})
    assert wrong.status_code == 400 and "[2, 2] given" in wrong.json()["message"]
    for path, body in (("/begin_weight_update", {"selector": "draft"}),
                       ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                             "selector": "draft"}),
                       ("/weights_checker", {"action": "compare", "selector": "draft"})):
        reply = http.post(path, json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "selector", reply.text
        assert "no draft model" in reply.json()["error"]["message"]


def test_a_session_swaps_its_updates_in_together_at_its_end(http, model_dir, perturbed_dir, references):
    """Unpaused, so that requests run between the calls: none sees half of the new weights."""
    serve(http, model_dir)
    buckets = halves(checkpoint_tensors(perturbed_dir))
    assert http.post("/begin_weight_update", json={"selector": "all"}).json()["success"]
    again = http.post("/begin_weight_update", json={})
    assert again.status_code == 400 and "session is open" in again.json()["message"]
    for bucket in buckets:
        reply = send(http, frameworks.slime_update(bucket, 7))
        assert reply.json()["success"] and "apply at end_weight_update" in reply.json()["message"], reply.text
        assert served_greedy(http) == references["old"] and served_version(http) == "disk"
    ended = http.post("/end_weight_update", json={})
    assert ended.json()["success"] and ended.json()["weight_version"] == "7", ended.text
    assert served_greedy(http) == references["new"]
    closed = http.post("/end_weight_update", json={})
    assert closed.status_code == 400 and "no weight-update session" in closed.json()["message"]


def long_request(stack) -> tuple[threading.Thread, list]:
    results: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: results.append(httpx.post(f"{stack.http_url}/generate", timeout=300, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})))
    thread.start()
    deadline = time.monotonic() + 60
    while not stack.stats("scheduler").running:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)
    return thread, results


def test_flush_cache_while_paused_counts_no_retracted_request(http, stack):
    """miles pauses in retract mode, then flushes (SGLang refuses while requests wait; miles' SGLang, paused,
    does not count the retracted ones): the retracted request finishes after the continue, whole. A request
    paused in place holds its KV: refused, as SGLang."""
    thread, results = long_request(stack)
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    held = http.get("/flush_cache")
    assert held.status_code == 400 and "1 requests are running or waiting" in held.text
    assert http.post("/continue_generation", json={}).status_code == 200
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    flushed = http.get("/flush_cache")
    assert flushed.status_code == 200, flushed.text
    assert http.post("/continue_generation", json={}).status_code == 200
    thread.join(300)
    meta = results[0].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 300


def test_slimes_release_update_resume_cycle_serves_the_new_weights(http, model_dir, perturbed_dir, references):
    """Every tag released (SGLang's all: cuda_graph and weights_drafter name no memory held here), weights resumed,
    updated from tensors, then kv_cache and cuda_graph resumed."""
    serve(http, model_dir)
    flush, release, resume_weights, resume_kv = frameworks.slime_memory_cycle()
    send_all(http, [flush])
    released = send(http, release).json()
    assert released["success"] and "cuda_graph, weights_drafter: none held here" in released["message"], released
    assert send(http, resume_weights).json()["success"]
    send_all(http, [frameworks.slime_update(checkpoint_tensors(perturbed_dir), 3)])
    assert send(http, resume_kv).json()["success"]
    assert served_greedy(http) == references["new"]
    for cycle in (frameworks.nemo_rl_memory_cycle(), frameworks.miles_memory_cycle()):
        serve(http, model_dir)  # from disk: resumed from it
        send_all(http, cycle)
        assert served_greedy(http) == references["old"]


def test_weights_checker_proves_an_update_brought_every_tensor(http, model_dir):
    """slime's --check-weight-update-equal: snapshot, reset_tensors, the update, compare; miles' skip list."""
    serve(http, model_dir)
    named = checkpoint_tensors(model_dir)
    assert send(http, frameworks.slime_check_weights("snapshot")).json()["success"]
    assert send(http, frameworks.slime_check_weights("reset_tensors")).json()["success"]
    differ = send(http, frameworks.slime_check_weights("compare"))
    assert differ.status_code == 400 and f"{len(named)} of {len(named)} tensors differ" in differ.json()["message"]
    send_all(http, [frameworks.slime_update(named[1:], 4)])
    one = send(http, frameworks.miles_check_weights("compare"))
    assert one.status_code == 400 and f"1 of {len(named)} tensors differ" in one.json()["message"]
    assert named[0][0] in one.json()["message"]
    assert send(http, frameworks.miles_check_weights("compare", skip=[named[0][0]])).json()["success"]
    send_all(http, [frameworks.slime_update(named[:1], 4)])
    assert send(http, frameworks.slime_check_weights("compare")).json()["success"]
    checksum = send(http, frameworks.miles_check_weights("checksum"))
    assert checksum.status_code == 400 and checksum.json()["error"]["param"] == "action"
    for before_load in (True, False):
        reply = send(http, frameworks.slime_post_process_weights(before_load))
        assert reply.status_code == 200 and reply.json()["success"] and "Nothing to post-process" in reply.text


@pytest.mark.parametrize("path", ["/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
                                  "/weights_checker", "/post_process_weights"])
def test_the_new_weight_routes_need_the_admin_key(stack, path):
    reply = httpx.post(f"{stack.http_url}{path}", json={}, timeout=30)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
