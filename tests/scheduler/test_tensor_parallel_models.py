"""Tensor parallelism (--tp-size 2, gloo), each test on services of its own (so that the two test processes share
them out: tests/conftest.py's SPREAD): a MoE model with its routed experts, a hybrid linear-attention model and a
latent-attention one against transformers; penalties, grammars, seeded draws and retraction as on one rank; a
killed rank.

Only the CPU (gloo) path runs here: NCCL on several GPUs has not run in this project.
"""

import os
import signal
import time

import httpx
import numpy as np
import pytest
from flatwire_wire.scheduler import LogprobParams, SamplingParams
from flatwire_wire.steps import FinishReason

from harness.checkpoints import deepseek_v3_checkpoint, moe_checkpoint, qwen3_next_checkpoint
from harness.procs import start_service, tensor_parallel_ranks
from harness.scheduler_client import SchedulerClient
from harness.stack import running
from tests.scheduler.test_routed_experts import reference as router_choices
from tests.scheduler.test_routed_experts import routed
from tests.scheduler.test_tensor_parallel import ATOL, PROMPTS, K, check_generated, generate, reference

pytestmark = pytest.mark.slow


def test_penalties_grammars_seeds_and_retraction_behave_as_on_one_rank(small_model_dir, log_dir):
    """The same requests on one rank and on two, in KV memory that makes the scheduler retract and resume some:
    penalties, a regular expression, a seeded draw and greedy decoding, with their top-k rows (sampling is rank
    0's alone either way; the logits it samples from come from both ranks)."""
    options = ["--model", str(small_model_dir), "--max-total-tokens", "384", "--page-size", "16",
               "--max-running-requests", "8", "--stream-coalesce-tokens", "1"]
    logprob = LogprobParams(return_logprob=True, top_logprobs_num=K, logprob_start_len=-1)
    requests = {
        "penalties": SamplingParams(max_new_tokens=48, temperature=0, frequency_penalty=0.5, presence_penalty=0.3,
                                    ignore_eos=True),
        "regex": SamplingParams(max_new_tokens=24, temperature=0, regex="(ab|cd)+[0-9]{2}"),
        "seeded": SamplingParams(max_new_tokens=48, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        **{f"greedy{i}": SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True) for i in range(3)},
    }
    outputs = []
    for tp in ("1", "2"):
        proc, address = start_service("scheduler", [*options, "--tp-size", tp], log_dir)
        client = SchedulerClient(address)
        try:
            rids = {name: client.submit(input_ids=[(11 * n + 5 * i) % 4000 + 7 for i in range(40)],
                                        sampling=sampling, logprob=logprob)
                    for n, (name, sampling) in enumerate(requests.items())}
            outputs.append({name: client.wait(rid) for name, rid in rids.items()})
            assert client.stats().retractions > 0  # the memory was short: some were retracted and resumed
        finally:
            client.close()
            proc.stop()
    one, two = outputs
    for name in requests:
        assert one[name].token_ids == two[name].token_ids, name
        assert np.allclose(one[name].topk()[0], two[name].topk()[0], atol=ATOL), name


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


@pytest.mark.parametrize("make", [qwen3_next_checkpoint, deepseek_v3_checkpoint], ids=["qwen3_next", "deepseek_v3"])
def test_hybrid_and_latent_attention_models_on_two_ranks(make, small_model_dir, log_dir, tmp_path):
    """Qwen3-Next: its full-attention layer and experts cut, its Gated DeltaNet layers whole on each rank (as
    transformers' plan keeps them), their states too. DeepSeek V3: each rank's heads, the latent each token keeps
    whole on every rank (every head attends to it). Chunks of 5 tokens cross page boundaries (the states'
    checkpoints), and a prompt again resumes from the prefix cache."""
    model = make(small_model_dir, tmp_path / "model")
    with running(model, log_dir, scheduler_args=("--tp-size", "2", "--chunked-prefill-size", "5",
                                                 "--page-size", "4")) as model_stack:
        model_stack.wait_ready()
        with httpx.Client(base_url=model_stack.http_url, timeout=300) as model_http:
            for prompt in PROMPTS:
                check_generated(generate(model_http, prompt), prompt, reference(model, prompt))
            again = generate(model_http, PROMPTS[2], -1)
            assert again["meta_info"]["cached_tokens"] > 0
            check_generated(again, PROMPTS[2], reference(model, PROMPTS[2]), prompt_logprobs=False)


# The client's stream reader ends with the scheduler's socket: UNAVAILABLE, raised in its thread, is the point here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_rank_takes_the_scheduler_down(small_model_dir, log_dir):
    proc, address = start_service("scheduler", ["--model", str(small_model_dir), "--tp-size", "2"], log_dir)
    client = SchedulerClient(address)
    try:
        rid = client.submit(input_ids=PROMPTS[0], sampling=SamplingParams(max_new_tokens=4000, temperature=0,
                                                                          ignore_eos=True))
        client.wait_tokens(rid, 2)
        ranks = tensor_parallel_ranks(proc.proc.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        assert proc.proc.wait(timeout=30) == 1
        assert "tp-rank-1 exited" in proc.log()
        time.sleep(0.5)  # the stream's end reaches the client
        # Failed explicitly: the step that lost its rank ended the request with an error (when rank 0's all-reduce
        # failed before its watcher took the process down), or the stream ended without a finish; never complete.
        finish = client.requests[rid].finish
        assert finish is None or finish.reason is FinishReason.ERROR, finish
    finally:
        client.close()
        proc.stop()
