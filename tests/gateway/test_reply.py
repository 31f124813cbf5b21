"""One Reply per event of a request (reply.py), in-process: `new` is what arrived since the previous reply, `whole`
the request so far, both views of the request's buffers (accumulator.py)."""

import numpy as np
from flatwire_wire.logprobs import F32, I32, LogprobBlock, RequestLogprobs
from flatwire_wire.scheduler import LogprobParams
from flatwire_wire.steps import Finish, FinishReason

from services.gateway.accumulator import Accumulator
from services.gateway.reply import Ending, Output, Reply

K = 2


def _rows(token_ids: list[int], first: float) -> LogprobBlock:
    """A one-request block: one row per token, its values counting from `first`."""
    n = len(token_ids)
    values = (first + np.arange(n * K, dtype=F32)).reshape(n, K)
    return LogprobBlock.of_request(RequestLogprobs(token_logprobs=values[:, 0].copy(), topk_values=values,
                                                   topk_ids=np.ones((n, K), I32), ids_logprobs=np.zeros((n, 1), F32),
                                                   token_ids=np.asarray(token_ids, I32)))


def _accumulator() -> Accumulator:
    return Accumulator(LogprobParams(return_logprob=True, top_logprobs_num=K, token_ids_logprob=[5]), 8)


def _reply(outputs: Accumulator) -> Reply:
    new, so_far = outputs.take()
    return Reply(rid="r", prompt_tokens=3, new=new, completion_tokens=len(outputs.token_ids),
                 weight_versions=outputs.versions(), e2e_latency=0.0, so_far=so_far)


def test_a_streams_replies_carry_what_arrived_and_the_whole_so_far():
    outputs = _accumulator()
    outputs.add(0, [1, 2], "ab", _rows([1, 2], 0), 0, "v1")
    first = _reply(outputs)
    assert first.new.token_ids == [1, 2] and first.new.text == "ab" and first.whole is first.new
    assert first.new.token_ids_logprob == [5]
    outputs.prompt = RequestLogprobs.empty(K, 1)
    outputs.add(2, [3], "c", _rows([3], 10), 0, "v2")
    second = _reply(outputs)
    assert second.new.token_ids == [3] and second.new.text == "c" and second.new.prompt is outputs.prompt
    assert second.new.output.topk_values.tolist() == [[10, 11]]
    outputs.add(3, [4], "d", _rows([4], 20), 0, "v2")  # after the reply: not in its whole
    whole = second.whole
    assert whole.token_ids == [1, 2, 3] and whole.text == "abc" and whole.prompt is outputs.prompt
    assert whole.output.topk_values.tolist() == [[0, 1], [2, 3], [10, 11]]
    assert second.completion_tokens == 3 and second.weight_version == "v2"
    assert [(s.version, s.start, s.end) for s in second.weight_versions] == [("v1", 0, 2), ("v2", 2, 3)]
    third = _reply(outputs)
    assert third.new.token_ids == [4] and third.new.prompt is None and third.whole.text == "abcd"
    outputs.end("v2")
    last = _reply(outputs)  # an ending that brought no token: nothing new to render, the whole as it was
    assert last.new.token_ids == [] and last.new.output is None and len(last.whole.output.token_ids) == 4


def test_a_whole_output_of_no_token_has_its_empty_rows():
    outputs = _accumulator()
    outputs.end("v1")
    reply = _reply(outputs)
    assert reply.whole is reply.new and reply.new.output is not None and len(reply.new.output.token_ids) == 0


def test_a_prompt_that_came_first_stays_in_the_whole():
    outputs = _accumulator()
    outputs.prompt = RequestLogprobs.empty(K, 1)
    only_prompt = _reply(outputs)
    assert only_prompt.new.token_ids == [] and only_prompt.new.prompt is outputs.prompt
    outputs.add(0, [1], "a", _rows([1], 0), 0, "v1")
    tokens = _reply(outputs)
    assert tokens.new.prompt is None and tokens.whole.prompt is outputs.prompt and tokens.whole.token_ids == [1]


def test_a_request_that_ended_without_a_token_has_the_version_then_in_force():
    outputs = _accumulator()
    outputs.end("v3")
    reply = _reply(outputs)
    assert reply.whole.token_ids == [] and reply.weight_version == "v3"


def test_how_a_request_ended_stays_typed():
    assert Ending.of(Finish(rid="r", reason=FinishReason.STOP_TOKEN, matched_token=7)).matched_stop == 7
    assert Ending.of(Finish(rid="r", reason=FinishReason.STOP_STRING, matched_stop="\n")).matched_stop == "\n"
    aborted = Ending.of(Finish(rid="r", reason=FinishReason.ABORT, cached_tokens=4))
    assert (aborted.error, aborted.matched_stop, aborted.cached_tokens) == ("aborted", None, 4)
    length = Ending.of(Finish(rid="r", reason=FinishReason.LENGTH))
    assert length.error is None and length.routed_experts is None
    reply = Reply(rid="r", prompt_tokens=1, new=Output([1], "a"), completion_tokens=1, weight_versions=[],
                  e2e_latency=0.5)
    assert not reply.finished and reply.finish_reason is None and reply.finish_name is None
    assert reply.cached_tokens == 0 and reply.weight_version is None
    ended = Reply(rid="r", prompt_tokens=1, new=Output([1], "a"), completion_tokens=1, weight_versions=[],
                  e2e_latency=0.5, ending=aborted)
    assert ended.finished and ended.finish_reason is FinishReason.ABORT and ended.finish_name == "abort"
    assert ended.cached_tokens == 4 and ended.whole is ended.new
