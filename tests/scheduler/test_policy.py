"""SubmitLimits of continuous batching, on a small scheduler: 2 slots, a 16-token prefill
budget, a 64-token context, prompt logits 7 rows at a time; on the small vocabulary (tests/conftest.py
small_model_dir: these tests send token ids and read no text). The policy alone, in process."""

import time

import numpy as np
import pytest
import torch
from flatwire_wire.scheduler import AbortRequest, LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import FinishReason
from transformers import AutoModelForCausalLM

from harness.checkpoints import SMALL_VOCABULARY
from harness.scheduler_client import SchedulerClient
from services.scheduler.engine.policy import Scheduler, SlotPool
from services.scheduler.kv.manager import KVManager
from services.scheduler.output.step_output import Outgoing
from services.scheduler.request import RequestStatus
from services.scheduler.step import StepResult
from services.scheduler.submit import SubmitLimits, parse_request

SLOTS, BUDGET, CONTEXT, CHUNK = 2, 16, 64, 7


@pytest.fixture(scope="module")
def client(start_service, small_model_dir):
    _, address = start_service("scheduler", "--model", str(small_model_dir), "--max-running-requests", str(SLOTS),
                               "--chunked-prefill-size", "-1",
                               "--max-prefill-tokens", str(BUDGET), "--context-length", str(CONTEXT),
                               "--logits-chunk-rows", str(CHUNK))
    client = SchedulerClient(address)
    yield client
    client.close()


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, SMALL_VOCABULARY, length).tolist()


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


def _policy(budget: int, chunked: bool, slots: int = 3, pages: int = 65, prefix_cache: bool = False) -> Scheduler:
    return Scheduler(KVManager(pages, 4, prefix_cache=prefix_cache), SlotPool(slots), budget, chunked)


def _request(i: int, length: int, new_tokens: int = 50):
    limits = SubmitLimits(SMALL_VOCABULARY, 1 << 20, 8, (), output_interval=50)
    return parse_request(TokenizedRequest(rid=f"r{i}", input_ids=prompt(i, length), sampling=greedy(new_tokens)),
                         limits)


def _step(scheduler: Scheduler) -> list[tuple[int, int, int]]:
    """One step as the engine runs it (a sampled token is 1); (prompt length, start, end) of its prefill rows."""
    batch = scheduler.schedule()
    scheduler.update_from_output(batch, StepResult(next_ids=np.ones(len(batch.sampling), dtype=np.int64)), Outgoing())
    return [(row.request.prompt_len, row.start, row.end) for row in batch.rows if row.end - row.start > 1]


def test_admission_policy():
    """Deterministic admission on the policy itself: first come, first served within the prefill budget; with
    chunking off a prompt over the budget goes whole and alone; slots cap."""
    scheduler = _policy(BUDGET, chunked=False)
    requests = [_request(i, n) for i, n in enumerate([4, 10, 12, 30, 3])]
    for request in requests:
        scheduler.add(request)
    assert _step(scheduler) == [(4, 0, 4), (10, 0, 10)]  # 4 + 10 + 12 > 16
    assert _step(scheduler) == [(12, 0, 12)]  # 12 + 30 > 16
    assert _step(scheduler) == []  # the slots are full
    scheduler.finish(requests[0], FinishReason.ABORT)
    assert _step(scheduler) == [(30, 0, 30)]  # over the budget, admitted alone
    scheduler.finish(requests[1], FinishReason.ABORT)
    assert _step(scheduler) == [(3, 0, 3)]


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decoding():
    scheduler = _policy(BUDGET, chunked=True)
    short, long = _request(0, 5, new_tokens=20), _request(1, 40)
    scheduler.add(short)
    assert _step(scheduler) == [(5, 0, 5)]
    scheduler.add(long)
    # Each step: the short request decodes, and the long prompt takes what is left of the budget.
    assert _step(scheduler) == [(40, 0, 16)]
    assert _step(scheduler) == [(40, 16, 32)]
    assert _step(scheduler) == [(40, 32, 40)]
    assert len(short.output_ids) == 4 and long.output_ids == [1]


def test_requests_are_retracted_when_pages_run_short_and_resume():
    """A pool of 8 pages of 4 tokens: three requests of 4 + 20 tokens (6 pages), each fits alone, not together.
    The newest is retracted when decoding runs out of pages (it waits first in line), the others go on, and every
    request ends with all its tokens; no page is lost on the way."""
    scheduler = _policy(64, chunked=True, pages=9, prefix_cache=True)
    pool, cache = scheduler.kv.pages, scheduler.kv.prefix_cache
    requests = [_request(i, 4, new_tokens=20) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    for _ in range(200):
        _step(scheduler)
        held = {page for r in scheduler.running for page in r.kv.tables[0]}
        assert pool.free + len(held | {n.pages[0] for n in cache._nodes()}) == pool.usable
        if all(r.status is RequestStatus.FINISHED for r in requests):
            break
    assert all(len(r.output_ids) == 20 for r in requests)
    assert scheduler.retractions >= 1 and pool.free + pool.evictable == pool.usable


def test_context_limit_ends_with_length(client):
    result = client.wait(client.submit(input_ids=prompt(50, CONTEXT - 4), sampling=greedy(100)))
    assert len(result.token_ids) == 4 and result.finish.reason == FinishReason.LENGTH


def test_prompt_logprobs_across_logit_chunks(client, small_model_dir):
    ids = prompt(80, 30)
    result = client.wait(client.submit(
        input_ids=ids, sampling=greedy(1),
        logprob=LogprobParams(return_logprob=True, top_logprobs_num=4, logprob_start_len=0,
                                            token_ids_logprob=[5, 6])))
    model = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32).eval()
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
    assert (stats.running, stats.waiting, stats.kv_pages_used) == (0, 0, 0)
