"""What RL trainers call besides disk updates (issue 21): weights broadcast over a torch.distributed group (gloo
here) by a trainer process (harness/trainer.py, written as the frameworks write theirs), each of two scheduler
replicas its own rank; releasing and resuming the model's memory.

Greedy outputs are checked against transformers' generate on the weights the trainer sent. One stack for the
module (its weights change under the tests): two schedulers, a detokenizer, a gateway with an admin key.
"""

import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from flatwire_client import FlatwireClient
from transformers import AutoModelForCausalLM

from harness.checkpoints import perturbed_checkpoint
from harness.procs import free_port
from harness.stack import running
from harness.trainer_process import Trainer

pytestmark = pytest.mark.slow
ADMIN_KEY = "admin-rl-sync"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
REPLICAS = 2
PROMPT = [9707, 11, 1879, 374, 264, 1273, 13]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    with running(model_dir, log_dir, schedulers=REPLICAS, scheduler_args=("--max-total-tokens", "32768"),
                 scheduler_env={"FLATWIRE_WEIGHTS_SYNC_TIMEOUT_S": "60"},
                 gateway_env={"FLATWIRE_ADMIN_API_KEY": ADMIN_KEY}) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=300, headers=ADMIN) as client:
        yield client


@pytest.fixture(scope="module")
def perturbed_dir(model_dir, tmp_path_factory) -> Path:
    return perturbed_checkpoint(model_dir, tmp_path_factory.mktemp("trained"), 2121, (".layers.0.", ".layers.2."))


def transformers_greedy(path: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def served_greedy(http) -> list[list[int]]:
    """Each replica's greedy output (the session key pins a request to a replica; two keys reach both)."""
    outputs = {}
    for key in range(16):
        reply = http.post("/generate", headers={"X-Session-ID": f"s{key}"}, json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
        assert reply.status_code == 200, reply.text
        outputs.setdefault(tuple(reply.json()["output_ids"]), key)
    return [list(output) for output in outputs]


def test_a_trainer_broadcasts_weights_to_every_replica(stack, http, model_dir, perturbed_dir):
    assert served_greedy(http) == [transformers_greedy(model_dir)]
    trainer = Trainer(perturbed_dir, 1 + REPLICAS)
    joined = trainer.join(http)
    assert joined["success"] and sorted(r["message"].split(" as rank ")[1] for r in joined["replicas"].values()) == [
        "1 of 3", "2 of 3"]
    reply = http.post("/update_weights_from_distributed", json={**trainer.tensors, "weight_version": "step-1"})
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert reply.json()["weight_version"] == "step-1" and trainer.wait() == 0
    assert served_greedy(http) == [transformers_greedy(perturbed_dir)]
    assert http.post("/destroy_weights_update_group", json={}).json()["success"]


def test_a_trainer_that_dies_mid_broadcast_leaves_the_old_weights(stack, http, model_dir, perturbed_dir):
    before = served_greedy(http)
    trainer = Trainer(model_dir, 1 + REPLICAS, "--die-after", "3", group="dying")
    trainer.join(http)
    started = time.monotonic()
    reply = http.post("/update_weights_from_distributed", json={**trainer.tensors, "group_name": "dying"})
    assert reply.status_code == 400 and not reply.json()["success"]
    assert "stopped after 3 of" in reply.json()["message"] and "unchanged" in reply.json()["message"]
    assert time.monotonic() - started < 60  # bounded: the group's timeout at most
    assert served_greedy(http) == before
    gone = http.post("/update_weights_from_distributed", json={**trainer.tensors, "group_name": "dying"})
    assert not gone.json()["success"] and "no group 'dying'" in gone.json()["message"]  # destroyed with the failure


def test_a_flattened_bucket_in_another_dtype_is_cast_and_swapped_in(stack, model_dir, perturbed_dir):
    with FlatwireClient(stack.grpc_address, admin_api_key=ADMIN_KEY) as client:
        trainer = Trainer(model_dir, 1 + REPLICAS, "--bucket", "--dtype", "bfloat16", group="bucket")
        joined = client.init_weights_update_group("127.0.0.1", trainer.port, 1, 1 + REPLICAS, "bucket", "gloo")
        assert joined.success, joined.message
        updated = client.update_weights_from_distributed(**trainer.tensors, group_name="bucket",
                                                         load_format="flattened_bucket")
        assert updated.success, updated.message
        assert trainer.wait() == 0
        assert client.destroy_weights_update_group("bucket").success
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # what the servers hold now: the model rounded through bfloat16
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT):]
    with httpx.Client(base_url=stack.http_url, timeout=300, headers=ADMIN) as http:
        assert served_greedy(http) == [want.tolist()]


def test_a_float64_state_dict_is_received_whole(stack, http, model_dir):
    """Twice the served model's float32 bytes: received and cast (it was refused before the broadcast, so that
    the trainer's collective hung until it timed out)."""
    trainer = Trainer(model_dir, 1 + REPLICAS, "--dtype", "float64", group="wide")
    assert trainer.join(http)["success"]
    reply = http.post("/update_weights_from_distributed", json={**trainer.tensors, "group_name": "wide"})
    assert reply.json()["success"], reply.text
    assert trainer.wait() == 0
    assert served_greedy(http) == [transformers_greedy(model_dir)]
    assert http.post("/destroy_weights_update_group", json={"group_name": "wide"}).json()["success"]


def test_refused_updates_change_nothing(stack, http, model_dir):
    before = served_greedy(http)
    trainer = Trainer(model_dir, 1 + REPLICAS, group="checked")
    trainer.join(http)
    wrong = {**trainer.tensors, "group_name": "checked"}
    wrong["names"] = ["model.no_such.weight", *wrong["names"][1:]]
    reply = http.post("/update_weights_from_distributed", json=wrong)
    assert not reply.json()["success"] and "model.no_such.weight" in reply.json()["message"]
    assert trainer.wait() == 0  # received whole, so the trainer's collective completed, then refused
    assert served_greedy(http) == before
    for body, field in (({**wrong, "dtypes": ["float7"] * len(wrong["names"])}, "dtypes"),
                        ({**wrong, "shapes": wrong["shapes"][1:]}, "names, dtypes, shapes")):
        refused = http.post("/update_weights_from_distributed", json=body)
        assert not refused.json()["success"] and f"{field}:" in refused.json()["message"], refused.text
    small = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                          "rank_offset": 1, "world_size": REPLICAS})
    assert small.status_code == 400 and "world_size" in small.json()["message"]
    nccl = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                         "rank_offset": 1, "world_size": 3, "backend": "nccl"})
    assert not nccl.json()["success"] and "nccl needs CUDA" in nccl.json()["message"]
    assert http.post("/destroy_weights_update_group", json={"group_name": "checked"}).json()["success"]


def test_a_join_without_a_host_and_port_is_refused_by_name(stack, http):
    """Refused before any replica tries the rendezvous (which would wait out --weights-sync-timeout-s, or fail
    inside torch): a 400 over HTTP, INVALID_ARGUMENT over gRPC (whose unset values are "" and 0), by name."""
    good = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 1 + REPLICAS}
    with FlatwireClient(stack.grpc_address, admin_api_key=ADMIN_KEY) as client:
        for field, value in (("master_address", ""), ("master_port", 0), ("master_port", 70000)):
            reply = http.post("/init_weights_update_group", json={**good, field: value})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
            with pytest.raises(grpc.RpcError) as refused:
                client.init_weights_update_group(**{**good, field: value}, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(f"{field}: "), refused.value.details()


def test_retracted_requests_wait_out_a_memory_release(stack, http, model_dir):
    """SGLang's partial rollout: pause (retract), release, resume, update, continue. The retracted requests hold
    no KV, so the release goes ahead (it was refused while any request waited), and they finish after it,
    prefilled again on the new weights (weights that came from a broadcast resume as zeros until the next
    update: the update is part of the cycle)."""
    results: list[httpx.Response] = []
    busy = threading.Thread(target=lambda: results.append(httpx.post(f"{stack.http_url}/generate", timeout=300, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})))
    busy.start()
    deadline = time.monotonic() + 60
    while not any(stack.stats(name).running for name in ("scheduler", "scheduler-1")):
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    released = http.post("/release_memory_occupation", json={})
    assert released.json()["success"], released.text
    assert http.post("/resume_memory_occupation", json={}).json()["success"]
    assert http.post("/update_weights_from_disk", json={"model_path": str(model_dir)}).json()["success"]
    assert http.post("/continue_generation").status_code == 200
    busy.join()
    meta = results[0].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 300


def test_joins_that_wait_for_a_trainer_hold_up_no_other_control(stack, http, model_dir):
    """Joins to a port no trainer listens on wait out the rendezvous (60 s here); their callers leave. An update
    meanwhile is not held up (the joins had filled the thread pool the updates read weights on, for minutes),
    and a master_address that does not resolve is refused at once."""
    nowhere = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
               "world_size": 1 + REPLICAS, "group_name": "nowhere"}
    for _ in range(8):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{stack.http_url}/init_weights_update_group", json=nowhere, headers=ADMIN, timeout=0.3)
    update = http.post("/update_weights_from_disk", json={"model_path": str(model_dir)}, timeout=30)
    assert update.json()["success"], update.text
    unresolved = http.post("/init_weights_update_group", timeout=30, json={**nowhere, "master_address": "no host!"})
    assert "master_address: 'no host!' does not resolve" in unresolved.json()["message"], unresolved.text


def rss_mb(stack, name: str) -> float:
    status = Path(f"/proc/{stack.procs[name].proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def test_released_memory_is_given_back_and_resumed(stack, http, model_dir):
    assert http.post("/update_weights_from_disk", json={"model_path": str(model_dir)}).json()["success"]
    want = served_greedy(http)
    before = {name: rss_mb(stack, name) for name in ("scheduler", "scheduler-1")}
    busy = threading.Thread(target=lambda: httpx.post(f"{stack.http_url}/generate", timeout=300, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
    busy.start()
    time.sleep(1.0)
    refused = http.post("/release_memory_occupation", json={})  # the idle replica releases, the busy one refuses
    assert not refused.json()["success"] and "running or waiting" in refused.json()["message"]
    for key in range(4):  # a request routed to the released replica goes to the other one
        routed = http.post("/generate", headers={"X-Session-ID": f"r{key}"},
                           json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert routed.status_code == 200, routed.text
    busy.join()

    released = http.get("/release_memory_occupation")  # GET, as SGLang's; each replica's call is idempotent
    assert released.json()["success"], released.text
    after = {name: rss_mb(stack, name) for name in before}
    for name in before:  # the default model's weights and 32768 tokens of KV memory
        assert before[name] - after[name] > 100, (before, after)
    blocked = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert blocked.status_code == 503 and "resume_memory_occupation" in blocked.text
    stale = http.post("/update_weights_from_disk", json={"model_path": str(model_dir)})  # was: "shapes differ"
    assert stale.json()["message"].endswith("they are released; resume_memory_occupation first."), stale.text

    resumed = http.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert resumed.json()["success"] and "read again from" in resumed.json()["message"], resumed.text
    assert http.post("/generate", json={"input_ids": PROMPT}).status_code == 503  # the KV memory is still out
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
    assert served_greedy(http) == want
    unknown = http.post("/release_memory_occupation", json={"tags": ["gpu"]})
    assert unknown.status_code == 400 and "tags" in unknown.text


def test_weights_from_a_broadcast_resume_as_zeros_until_the_next_update(stack, http, model_dir, perturbed_dir):
    trainer = Trainer(perturbed_dir, 1 + REPLICAS, group="cycle")
    trainer.join(http)
    assert http.post("/update_weights_from_distributed", json={**trainer.tensors, "group_name": "cycle"}).json()[
        "success"]
    trainer.wait()
    assert http.post("/release_memory_occupation", json={"tags": ["weights"]}).json()["success"]
    resumed = http.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert resumed.json()["success"] and "zeros until the next update" in resumed.json()["message"]
    waiting = http.post("/generate", json={"input_ids": PROMPT})
    assert waiting.status_code == 503 and "update every tensor" in waiting.text
    trainer = Trainer(perturbed_dir, 1 + REPLICAS, group="cycle")  # the RL cycle: resume, then new weights
    http.post("/destroy_weights_update_group", json={"group_name": "cycle"})
    trainer.join(http)
    assert http.post("/update_weights_from_distributed", json={**trainer.tensors, "group_name": "cycle"}).json()[
        "success"]
    assert served_greedy(http) == [transformers_greedy(perturbed_dir)]
