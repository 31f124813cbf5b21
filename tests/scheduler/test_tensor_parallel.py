"""Tensor parallelism (--tp-size 2, gloo on these CPUs): a scheduler whose model is cut over two ranks gives
transformers' own forward (greedy tokens, logprobs within 1e-4, as one rank does) on a dense model, a MoE model
and a hybrid linear-attention one (Qwen3-Next), through chunked prefill, a prefix-cache hit and a mixed batch; a
trainer's weight sync reaches both ranks (world_size 3: the trainer and two ranks), as do pushed and colocated
updates, memory release, resume and a disk update; a rank killed takes the scheduler down as one unit.

Only the CPU (gloo) path runs here: NCCL on several GPUs has not run in this project.
"""

import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from flatwire_client import FlatwireClient
from flatwire_wire.scheduler import SamplingParams
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness.checkpoints import moe_checkpoint, perturbed_checkpoint, qwen3_next_checkpoint
from harness.procs import start_service
from harness.scheduler_client import SchedulerClient
from harness.stack import running
from harness.trainer_process import Trainer
from tests.scheduler import framework_calls as frameworks
from tests.scheduler.test_routed_experts import reference as router_choices
from tests.scheduler.test_routed_experts import routed

pytestmark = pytest.mark.slow
ADMIN_KEY = "admin-tp"
ATOL = 1e-4
K = 5
PROMPTS = [[(7 * i + 3 * n) % 4000 + 11 for i in range(length)] for n, length in enumerate((7, 45, 80, 3))]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def stack(small_model_dir, log_dir):
    """Chunks of 32 tokens: the longer prompts prefill over several steps, beside the others' decodes."""
    with running(small_model_dir, log_dir, scheduler_args=("--tp-size", "2", "--chunked-prefill-size", "32"),
                 scheduler_env={"FLATWIRE_WEIGHTS_SYNC_TIMEOUT_S": "60"},
                 gateway_env={"FLATWIRE_ADMIN_API_KEY": ADMIN_KEY}) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=300, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
        yield client


def reference(path: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the log-softmax at every position of prompt + them, float32."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0]
        logprobs = torch.log_softmax(model(tokens[None]).logits[0].float(), -1)
    return tokens[len(prompt):].tolist(), logprobs.numpy()


def check_generated(body: dict, prompt: list[int], expected: tuple[list[int], np.ndarray],
                    prompt_logprobs: bool = True) -> None:
    tokens, logprobs = expected
    meta = body["meta_info"]
    assert body["output_ids"] == tokens
    sequence = prompt + tokens
    for position, (value, token, _) in enumerate(meta["output_token_logprobs"], start=len(prompt)):
        assert token == sequence[position] and abs(value - logprobs[position - 1, token]) < ATOL
    for position, candidates in enumerate(meta["output_top_logprobs"], start=len(prompt)):
        row = logprobs[position - 1]  # the top K by value, each candidate's its own (a near tie may swap two)
        assert np.allclose([value for value, _, _ in candidates], np.sort(row)[::-1][:K], atol=ATOL)
        assert np.allclose([value for value, _, _ in candidates], [row[token] for _, token, _ in candidates], atol=ATOL)
    if not prompt_logprobs:
        return
    assert len(meta["input_token_logprobs"]) == len(prompt)
    prompt_rows = meta["input_token_logprobs"][1:]  # the first prompt token has none
    assert np.allclose([value for value, _, _ in prompt_rows],
                       [logprobs[position - 1, prompt[position]] for position in range(1, len(prompt))], atol=ATOL)


def generate(http, prompt: list[int], logprob_start_len: int = 0, **fields) -> dict:
    reply = http.post("/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": K, "logprob_start_len": logprob_start_len, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_two_ranks_give_transformers_forward(http, small_model_dir):
    assert http.get("/get_server_info").json()["tp_size"] == 2
    expected = [reference(small_model_dir, prompt) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one mixed batch: prefill chunks beside decodes
        bodies = list(pool.map(lambda prompt: generate(http, prompt), PROMPTS))
    for body, prompt, reference_output in zip(bodies, PROMPTS, expected):
        check_generated(body, prompt, reference_output)
    again = generate(http, PROMPTS[2], -1)  # its prompt's pages are in the prefix cache now (no prompt logprobs)
    assert again["meta_info"]["cached_tokens"] > 0
    check_generated(again, PROMPTS[2], expected[2], prompt_logprobs=False)


def test_a_trainer_syncs_weights_into_both_ranks(http, small_model_dir, tmp_path):
    """world_size 3: the trainer is rank 0, the scheduler's two ranks 1 and 2, each receiving every full tensor
    and keeping its cut."""
    perturbed = perturbed_checkpoint(small_model_dir, tmp_path / "trained", 31, (".layers.0.", ".layers.3."))
    trainer = Trainer(perturbed, 3)
    joined = trainer.join(http)
    assert joined["success"], joined
    reply = http.post("/update_weights_from_distributed", json={**trainer.tensors, "weight_version": "step-1"})
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert trainer.wait() == 0
    check_generated(generate(http, PROMPTS[1]), PROMPTS[1], reference(perturbed, PROMPTS[1]))
    assert http.post("/destroy_weights_update_group", json={}).json()["success"]

    # Released and resumed on both ranks: broadcast weights are on no disk, so zeros until an update brings
    # them, here from disk (each rank reads its cut).
    assert http.post("/release_memory_occupation", json={}).json()["success"]
    assert http.post("/resume_memory_occupation", json={}).json()["success"]
    assert http.post("/generate", json={"input_ids": PROMPTS[0]}).status_code == 503
    reply = http.post("/update_weights_from_disk", json={"model_path": str(small_model_dir)})
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    check_generated(generate(http, PROMPTS[1]), PROMPTS[1], reference(small_model_dir, PROMPTS[1]))
    # Now from disk: release and resume read it again, on both ranks.
    assert http.post("/release_memory_occupation", json={"tags": ["weights"]}).json()["success"]
    assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["success"]
    check_generated(generate(http, PROMPTS[3]), PROMPTS[3], reference(small_model_dir, PROMPTS[3]))


def send(http, calls: list[frameworks.Call]) -> None:
    """Each call answered 200, and success where its answer is JSON (/flush_cache's is text)."""
    for call in calls:
        reply = http.get(call.path) if call.method == "GET" else http.post(call.path, json=call.body)
        assert reply.status_code == 200, (call.path, reply.text)
        if reply.headers["content-type"] == "application/json":
            assert reply.json().get("success", True), (call.path, reply.text)


def test_pushed_and_colocated_weights_reach_both_ranks(stack, http, small_model_dir, tmp_path):
    """A safetensors push (the public gRPC API) and verl's colocated update with one entry per rank, then a
    weight-update session of two such updates swapped in at its end, as one (each rank stages every part in
    order)."""
    first = perturbed_checkpoint(small_model_dir, tmp_path / "first", 41, (".layers.1.",))
    second = perturbed_checkpoint(small_model_dir, tmp_path / "second", 43, (".layers.2.", ".layers.3."))
    with FlatwireClient(stack.grpc_address, admin_api_key=ADMIN_KEY) as client:
        assert client.push_weights(load_file(first / "model.safetensors")).success
    check_generated(generate(http, PROMPTS[1]), PROMPTS[1], reference(first, PROMPTS[1]))

    send(http, frameworks.verl_update(list(load_file(second / "model.safetensors").items()), tp_size=2))
    check_generated(generate(http, PROMPTS[2]), PROMPTS[2], reference(second, PROMPTS[2]))

    named = list(load_file(small_model_dir / "model.safetensors").items())
    send(http, [frameworks.Call("POST", "/begin_weight_update", {}),
                *frameworks.verl_update(named[:len(named) // 2], tp_size=2),
                *frameworks.verl_update(named[len(named) // 2:], tp_size=2),
                frameworks.Call("POST", "/end_weight_update", {})])
    check_generated(generate(http, PROMPTS[0]), PROMPTS[0], reference(small_model_dir, PROMPTS[0]))


def test_a_moe_model_on_two_ranks(small_model_dir, log_dir, tmp_path):
    """Every expert's intermediate features cut over the ranks, the router whole on each: rank 0 records the
    routed experts, as transformers' routers choose them."""
    moe = moe_checkpoint(small_model_dir, tmp_path / "moe")
    with running(moe, log_dir, scheduler_args=("--tp-size", "2", "--enable-return-routed-experts")) as moe_stack:
        moe_stack.wait_ready()
        with httpx.Client(base_url=moe_stack.http_url, timeout=300) as moe_http:
            for prompt in PROMPTS:
                body = generate(moe_http, prompt, return_routed_experts=True)
                check_generated(body, prompt, reference(moe, prompt))
                sequence = prompt + body["output_ids"][:-1]  # the last sampled token never went through the model
                np.testing.assert_array_equal(np.sort(routed(body["meta_info"]), axis=-1),
                                              np.sort(router_choices(moe, sequence), axis=-1))


def test_a_hybrid_linear_attention_model_on_two_ranks(small_model_dir, log_dir, tmp_path):
    """Qwen3-Next: its full-attention layer and experts cut, its Gated DeltaNet layers whole on each rank (as
    transformers' plan keeps them), their states too; chunks of 5 tokens cross the state's page boundaries, and a
    prompt again resumes from the prefix cache's state checkpoint."""
    hybrid = qwen3_next_checkpoint(small_model_dir, tmp_path / "qwen3-next")
    with running(hybrid, log_dir, scheduler_args=("--tp-size", "2", "--chunked-prefill-size", "5",
                                                  "--page-size", "4")) as hybrid_stack:
        hybrid_stack.wait_ready()
        with httpx.Client(base_url=hybrid_stack.http_url, timeout=300) as hybrid_http:
            for prompt in PROMPTS:
                check_generated(generate(hybrid_http, prompt), prompt, reference(hybrid, prompt))
            again = generate(hybrid_http, PROMPTS[2], -1)
            assert again["meta_info"]["cached_tokens"] > 0
            check_generated(again, PROMPTS[2], reference(hybrid, PROMPTS[2]), prompt_logprobs=False)


# The client's stream reader ends with the scheduler's socket: UNAVAILABLE, raised in its thread, is the point here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_rank_takes_the_scheduler_down(small_model_dir, log_dir):
    proc, address = start_service("scheduler", ["--model", str(small_model_dir), "--tp-size", "2"], log_dir)
    client = SchedulerClient(address)
    try:
        rid = client.submit(input_ids=PROMPTS[0], sampling=SamplingParams(max_new_tokens=4000, temperature=0,
                                                                          ignore_eos=True))
        client.wait_tokens(rid, 2)
        children = subprocess.run(["pgrep", "-P", str(proc.proc.pid), "-f", "multiprocessing.spawn"],
                                  capture_output=True, text=True).stdout.split()
        ranks = [int(pid) for pid in children if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(ranks) == 1, children
        subprocess.run(["kill", f"-{signal.SIGKILL}", str(ranks[0])], check=True)
        assert proc.proc.wait(timeout=30) == 1
        assert "tp-rank-1 exited" in proc.log()
        time.sleep(0.5)  # the stream's end reaches the client
        assert client.requests[rid].finish is None  # never finished as if complete
    finally:
        client.close()
        proc.stop()
