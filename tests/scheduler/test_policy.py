"""SubmitLimits of continuous batching, on a small scheduler: 2 slots, a 16-token prefill
budget, a 64-token context, prompt logits 7 rows at a time."""

import time

import numpy as np
import pytest
import torch
from flatwire_wire.scheduler import AbortRequest, LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import FinishReason
from transformers import AutoModelForCausalLM

from harness.scheduler_client import SchedulerClient
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.model.runner import ModelRunner
from services.scheduler.submit import SubmitLimits, parse_request

SLOTS, BUDGET, CONTEXT, CHUNK = 2, 16, 64, 7


@pytest.fixture(scope="module")
def client(start_service):
    _, address = start_service("scheduler", "--max-running-requests", str(SLOTS),
                               "--max-tokens-per-step", str(BUDGET), "--max-context", str(CONTEXT),
                               "--logits-chunk-rows", str(CHUNK))
    client = SchedulerClient(address)
    yield client
    client.close()


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 240_000, length).tolist()


def test_queued_requests_match_solo_and_respect_slots(client):
    prompts = [prompt(40 + i, n) for i, n in enumerate([10, 12, 30, 5, 9])]
    solo = [client.wait(client.submit(input_ids=p, sampling=greedy(5))).token_ids for p in prompts]
    first_step = len(client.messages)
    rids = [client.submit(input_ids=p, sampling=greedy(5)) for p in prompts]
    results = [client.wait(rid) for rid in rids]

    assert [r.token_ids for r in results] == solo  # queueing changes nothing
    steps = client.messages[first_step:]
    assert max(len(m.rids) for m in steps) == SLOTS  # batched, never beyond the slots
    length = {rid: len(p) for rid, p in zip(rids, prompts)}
    for message in steps:
        prefills = [rid for rid in message.rids if client.requests[rid].steps[0] == message.step]
        assert len(prefills) <= 1 or sum(length[rid] for rid in prefills) <= BUDGET
    assert any(r.steps[0] > r.start_step for r in results)  # some waited for a slot


def test_admission_policy(model_dir):
    """Deterministic admission on the engine itself (its thread not started): first come,
    first served within the prefill budget; a prompt over the budget goes alone; slots cap."""
    runner = ModelRunner(model_dir, "cpu", "auto", CONTEXT, 3)
    engine = Engine(runner, SchedulerConfig(max_running_requests=3, max_tokens_per_step=BUDGET), publish=print)
    limits = SubmitLimits(runner.vocab_size, runner.max_context, 256, tuple(runner.eos_token_ids), output_interval=50)
    for i, n in enumerate([4, 10, 12, 30, 3]):
        engine.submit(parse_request(TokenizedRequest(
            rid=f"r{i}", input_ids=prompt(i, n), sampling=greedy(3)), limits))
    engine._drain_inbox(block=False)

    def admitted():
        return [r.prompt_len for r in engine.scheduler.admit()]

    assert admitted() == [4, 10]  # 4 + 10 + 12 > 16
    assert admitted() == [12]  # 12 + 30 > 16
    assert admitted() == []  # the slots are full
    runner.cache.release(0)
    assert admitted() == [30]  # over the budget, admitted alone
    runner.cache.release(1)
    assert admitted() == [3]


def test_context_limit_ends_with_length(client):
    result = client.wait(client.submit(input_ids=prompt(50, CONTEXT - 4), sampling=greedy(100)))
    assert len(result.token_ids) == 4 and result.finish.reason == FinishReason.LENGTH


def test_prompt_logprobs_across_logit_chunks(client, model_dir):
    ids = prompt(80, 30)
    result = client.wait(client.submit(
        input_ids=ids, sampling=greedy(1),
        logprob=LogprobParams(return_logprob=True, top_logprobs_num=4, logprob_start_len=0,
                                            token_ids_logprob=[5, 6])))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    got = result.prompt
    assert got.n == len(ids) - 1 and result.prompt_null_prefix == 1
    np.testing.assert_allclose(got.token_logprobs, reference.gather(1, torch.tensor(ids[1:])[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    np.testing.assert_allclose(got.topk_values.reshape(-1, 4), reference.topk(4).values, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got.ids_logprobs.reshape(-1, 2), reference[:, [5, 6]], atol=1e-4, rtol=0)


def test_abort_of_a_waiting_request(client):
    running = [client.submit(input_ids=prompt(60 + i, 8), sampling=greedy(CONTEXT - 8)) for i in range(SLOTS)]
    client.wait_tokens(running[-1], 1)
    waiting = client.submit(input_ids=prompt(70, 8), sampling=greedy(5))
    deadline = time.monotonic() + 30
    while client.stats().waiting != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.calls["Abort"](AbortRequest(rid=waiting))
    aborted = client.wait(waiting)
    assert aborted.finish.reason == FinishReason.ABORT and aborted.token_ids == []
    assert aborted.start is not None and aborted.start_step <= aborted.finish_step
    for rid in running:
        client.calls["Abort"](AbortRequest(rid=rid))
        client.wait(rid)
    stats = client.stats()
    assert (stats.running, stats.waiting, stats.kv_slots_used, stats.kv_slots_total) == (0, 0, 0, SLOTS)
