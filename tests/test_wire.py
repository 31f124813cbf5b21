"""The typed/bytes twin (docs/architecture.md, wire rule 3): typed views and bytes views of the
same messages parse as each other, bit for bit, -inf included."""

import numpy as np
import pytest

from services.common.arrays import F32, I32, LogprobArrays, decode_block, encode_block
from services.common.pb import arrays_pb2, generate_pb2, scheduler_pb2
from tests.scheduler_client import SchedulerClient

FLOAT_FIELDS = ["token_logprobs", "topk_values", "ids_logprobs"]
COUNT_FIELDS = ["rows", "null_prefix", "topk", "id_counts"]


def assert_bytes_equal_typed(block: arrays_pb2.LogprobBlock, view: arrays_pb2.LogprobBlockView) -> None:
    """Every array of the bytes view equals the typed view's, compared as bit patterns."""
    for name in FLOAT_FIELDS:
        typed = np.array(getattr(view, name), dtype=F32).view("<u4")
        np.testing.assert_array_equal(np.frombuffer(getattr(block, name), dtype="<u4"), typed, err_msg=name)
    np.testing.assert_array_equal(np.frombuffer(block.topk_ids, dtype=I32), np.array(view.topk_ids, dtype=I32))
    for name in COUNT_FIELDS:
        assert list(getattr(block, name)) == list(getattr(view, name)), name


def test_real_step_message_parses_as_typed_view(scheduler_address):
    client = SchedulerClient(scheduler_address)
    try:
        rid = client.submit(
            input_ids=[11, 2024, 7, 99_000, 5],
            sampling=scheduler_pb2.SamplingParams(max_new_tokens=3, temperature=0.0),
            logprob=scheduler_pb2.LogprobParams(return_logprob=True, top_logprobs_num=8, logprob_start_len=0,
                                                token_ids_logprob=[1, 2]))
        client.wait(rid)
        messages = [m for m in client.messages if rid in m.rids]
    finally:
        client.close()
    assert len(messages) == 3 and messages[0].prompt_rids == [rid]
    blocks = [m.output for m in messages] + [messages[0].prompt]
    for block in blocks:
        wire = block.SerializeToString()
        view = arrays_pb2.LogprobBlockView.FromString(wire)
        assert_bytes_equal_typed(block, view)
        assert view.SerializeToString() == wire
        assert len(view.topk_values) == sum(r * k for r, k in zip(view.rows, view.topk)) > 0


SPECIAL_FLOATS = np.array([-np.inf, -0.0, 0.0, -1e-45, np.finfo(np.float32).min, -3.5, -1e-38, -12.25], dtype=F32)


def constructed_arrays() -> LogprobArrays:
    """Two requests (2 rows, k=3, 1 id; 1 row, k=2, no ids) full of awkward values."""
    values = np.resize(SPECIAL_FLOATS, 8)
    return LogprobArrays(
        rows=np.array([2, 1]), null_prefix=np.array([1, 0]),
        token_logprobs=np.array([-np.inf, -0.0, -1e-45], dtype=F32),
        topk=np.array([3, 2]), topk_values=values,
        topk_ids=np.array([0, 248_076, -1, 2**31 - 1, -(2**31), 7, 8, 9], dtype=I32),
        id_counts=np.array([1, 0]), ids_logprobs=np.array([-np.inf, np.finfo(np.float32).min], dtype=F32),
    )


def typed_view(arrays: LogprobArrays) -> arrays_pb2.LogprobBlockView:
    """The typed message built from plain lists, as a client in another language would."""
    return arrays_pb2.LogprobBlockView(**{name: getattr(arrays, name).tolist() for name in
                                          [*COUNT_FIELDS, *FLOAT_FIELDS, "topk_ids"]})


def test_constructed_block_round_trips_both_ways():
    arrays = constructed_arrays()
    block = encode_block(arrays)
    wire = block.SerializeToString()

    view = arrays_pb2.LogprobBlockView.FromString(wire)  # bytes -> typed
    assert_bytes_equal_typed(block, view)
    assert np.isneginf(view.token_logprobs[0]) and np.signbit(view.token_logprobs[1])

    typed = typed_view(arrays)  # typed -> bytes
    assert typed.SerializeToString() == wire
    back = decode_block(arrays_pb2.LogprobBlock.FromString(typed.SerializeToString()))
    for name in FLOAT_FIELDS:
        np.testing.assert_array_equal(getattr(back, name).view("<u4"), getattr(arrays, name).view("<u4"), name)
    np.testing.assert_array_equal(back.topk_ids, arrays.topk_ids)


@pytest.mark.parametrize("direction", ["packed-to-typed", "typed-to-packed"])
def test_generate_response_twins(direction):
    arrays = constructed_arrays()
    token_ids = np.array([5, 248_000, 0], dtype=I32)
    common = dict(rid="r1", text="héllo", finish_reason=arrays_pb2.FINISH_REASON_STOP_TOKEN, matched_token=248_046,
                  prompt_tokens=3, completion_tokens=3)
    if direction == "packed-to-typed":
        packed = generate_pb2.GenerateResponsePacked(
            token_ids=token_ids.tobytes(), output=encode_block(arrays), prompt=encode_block(arrays), **common)
        typed = generate_pb2.GenerateResponse.FromString(packed.SerializeToString())
    else:
        typed = generate_pb2.GenerateResponse(
            token_ids=token_ids.tolist(), output=typed_view(arrays), prompt=typed_view(arrays), **common)
        packed = generate_pb2.GenerateResponsePacked.FromString(typed.SerializeToString())
    assert typed.SerializeToString() == packed.SerializeToString()
    np.testing.assert_array_equal(np.frombuffer(packed.token_ids, dtype=I32), np.array(typed.token_ids, dtype=I32))
    assert_bytes_equal_typed(packed.output, typed.output)
    assert_bytes_equal_typed(packed.prompt, typed.prompt)
    assert (typed.rid, typed.text, typed.finish_reason, typed.matched_token) == (
        "r1", "héllo", arrays_pb2.FINISH_REASON_STOP_TOKEN, 248_046)
