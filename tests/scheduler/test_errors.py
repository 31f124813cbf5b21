"""Bad requests and aborts: the right gRPC error naming the field, and running requests undisturbed; on the lone
scheduler (the small vocabulary: tests/conftest.py small_model_dir)."""

import time

import grpc
import numpy as np
import pytest
from flatwire_wire.control import EMPTY
from flatwire_wire.rpc import FIELD_METADATA
from flatwire_wire.scheduler import AbortRequest, LogprobParams, SamplingParams, SchedulerStats, TokenizedRequest
from flatwire_wire.steps import FinishReason

from harness.checkpoints import SMALL_VOCABULARY

GOOD_PROMPT = np.random.default_rng(30).integers(0, SMALL_VOCABULARY, 19).tolist()


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def good_request(scheduler_client, max_new_tokens: int) -> str:
    return scheduler_client.submit(input_ids=GOOD_PROMPT, sampling=greedy(max_new_tokens),
                         logprob=LogprobParams(return_logprob=True, top_logprobs_num=4,
                                                             logprob_start_len=-1))


def bad_requests(vocab: int, max_context: int, max_k: int) -> list[tuple[str, dict]]:
    """(field named in the error, TokenizedRequest fields) for each kind of bad request."""
    ok = dict(input_ids=[1, 2, 3], sampling=greedy(4))
    return [
        ("input_ids", dict(ok, input_ids=[])),
        ("input_ids", dict(ok, input_ids=[1, vocab])),
        ("input_ids", dict(ok, input_ids=[-1, 2])),
        ("input_ids", dict(ok, input_ids=[5] * max_context)),
        ("sampling.min_new_tokens", dict(ok, sampling=SamplingParams(max_new_tokens=4,
                                                                                  min_new_tokens=5))),
        ("sampling.repetition_penalty", dict(ok, sampling=SamplingParams(max_new_tokens=4,
                                                                                      repetition_penalty=0.0))),
        ("sampling.logit_bias", dict(ok, sampling=SamplingParams(max_new_tokens=4,
                                                                              logit_bias={vocab: 1.0}))),
        ("sampling.temperature", dict(ok, sampling=SamplingParams(max_new_tokens=4, temperature=-0.5))),
        ("sampling.top_p", dict(ok, sampling=SamplingParams(max_new_tokens=4, top_p=0.0))),
        ("sampling.top_p", dict(ok, sampling=SamplingParams(max_new_tokens=4, top_p=1.5))),
        ("sampling.stop_token_ids", dict(ok, sampling=SamplingParams(max_new_tokens=4,
                                                                                  stop_token_ids=[vocab + 3]))),
        ("logprob.top_logprobs_num", dict(ok, logprob=LogprobParams(
            return_logprob=True, top_logprobs_num=max_k + 1, logprob_start_len=-1))),
        ("logprob.token_ids_logprob", dict(ok, logprob=LogprobParams(
            return_logprob=True, logprob_start_len=-1, token_ids_logprob=[3, vocab]))),
        ("logprob.logprob_start_len", dict(ok, logprob=LogprobParams(
            return_logprob=True, logprob_start_len=3))),
        ("rid", dict(ok, rid="")),
    ]


def test_bad_requests_rejected_while_a_good_one_runs(scheduler_client):
    solo = scheduler_client.wait(good_request(scheduler_client, 40))
    info = scheduler_client.calls["GetModelInfo"](EMPTY)
    assert info.max_top_logprobs >= 256

    # Long enough to be certainly running through all the bad requests; compared on its first 40 tokens.
    running = good_request(scheduler_client, 2000)
    scheduler_client.wait_tokens(running, 1)
    with pytest.raises(grpc.RpcError) as error:
        scheduler_client.submit(rid=running, input_ids=[1, 2], sampling=greedy(2))
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS and "rid" in error.value.details()

    for field, fields in bad_requests(info.vocab_size, info.max_context, info.max_top_logprobs):
        with pytest.raises(grpc.RpcError) as error:
            scheduler_client.calls["Submit"](TokenizedRequest(
                **{"rid": "bad", "owner": scheduler_client.owner, **fields}))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert error.value.details().startswith(field + ":"), error.value.details()
        assert dict(error.value.trailing_metadata())[FIELD_METADATA] == field  # what the gateway renames

    with pytest.raises(grpc.RpcError) as error:
        scheduler_client.calls["Abort"](AbortRequest(rid="no-such-request"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "rid" in error.value.details()

    scheduler_client.wait_tokens(running, 40)
    scheduler_client.calls["Abort"](AbortRequest(rid=running))
    result = scheduler_client.wait(running)
    assert result.token_ids[:40] == solo.token_ids
    # Not bit-equal: the second run finds its prompt in the prefix cache, and attention over cached pages
    # sums in another order than the first run's prefill did.
    np.testing.assert_allclose(np.concatenate([o.topk_values for o in result.output[:40]]),
                               np.concatenate([o.topk_values for o in solo.output]), rtol=1e-5)
    assert not any(start.rid == "bad" for m in scheduler_client.messages for start in m.started)


def wait_for_idle_scheduler(scheduler_client, timeout: float = 30) -> SchedulerStats:
    deadline = time.monotonic() + timeout
    while (stats := scheduler_client.stats()).running or stats.kv_pages_used:
        assert time.monotonic() < deadline, f"scheduler still busy: {stats}"
        time.sleep(0.05)
    return stats


def test_abort_stops_request_and_frees_its_slot(scheduler_client):
    before = wait_for_idle_scheduler(scheduler_client)
    rid = scheduler_client.submit(input_ids=GOOD_PROMPT, sampling=greedy(2000))
    scheduler_client.wait_tokens(rid, 3)
    busy = scheduler_client.stats()
    assert busy.running == 1 and busy.kv_pages_used >= 1 and busy.kv_tokens_used >= len(GOOD_PROMPT) + 2

    scheduler_client.calls["Abort"](AbortRequest(rid=rid))
    aborted = scheduler_client.wait(rid)
    assert aborted.finish.reason == FinishReason.ABORT
    # Steps go on for another request; the aborted one never appears again.
    other = scheduler_client.wait(scheduler_client.submit(input_ids=GOOD_PROMPT, sampling=greedy(5)))
    assert other.steps[0] > aborted.finish_step
    later = [m for m in scheduler_client.messages if m.step > aborted.finish_step]
    assert later and not any(rid in m.rids or rid in m.prompt_rids for m in later)
    assert len(aborted.token_ids) < 2000

    after = wait_for_idle_scheduler(scheduler_client)
    assert after.aborted == before.aborted + 1
    assert after.kv_pages_used == 0 and after.kv_tokens_used == 0
    with pytest.raises(grpc.RpcError) as error:
        scheduler_client.calls["Abort"](AbortRequest(rid=rid))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_abort_for_stop_string_echoes_reason(scheduler_client):
    rid = scheduler_client.submit(input_ids=GOOD_PROMPT, sampling=greedy(2000))
    scheduler_client.wait_tokens(rid, 1)
    scheduler_client.calls["Abort"](AbortRequest(rid=rid, reason=FinishReason.STOP_STRING,
                                                 matched_stop="</end>"))
    finish = scheduler_client.wait(rid).finish
    assert finish.reason == FinishReason.STOP_STRING and finish.matched_stop == "</end>"
    assert wait_for_idle_scheduler(scheduler_client).kv_pages_used == 0
