"""The wire layer (services/wire): the typed/bytes twins of the logprob arrays (docs/architecture.md, wire rule 3)
parse as each other bit for bit, -inf included; every twin carries every field of its protobuf messages; the
logprob block slices per request and per owner without touching an element."""

import dataclasses
import enum
import typing

import numpy as np
import pytest
from flatwire_wire import codec, control, detokenizer, public, scheduler, steps
from flatwire_wire.codec import from_proto, to_proto
from flatwire_wire.logprobs import F32, I32, LogprobBlock, LogprobRows, RequestLogprobs, encode_block
from flatwire_wire.nucleus import NucleusBlock
from flatwire_wire.pb import arrays_pb2, generate_pb2
from flatwire_wire.scheduler import LogprobParams, SamplingParams
from flatwire_wire.steps import EntryOrder, FinishReason, entry_order
from google.protobuf.descriptor import FieldDescriptor

from harness.scheduler_client import SchedulerClient

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


def test_real_step_message_parses_as_typed_view(lone_scheduler_address):
    client = SchedulerClient(lone_scheduler_address)
    try:
        rid = client.submit(
            input_ids=[11, 2024, 7, 3_999, 5],  # the lone scheduler's small vocabulary
            sampling=SamplingParams(max_new_tokens=3, temperature=0.0),
            logprob=LogprobParams(return_logprob=True, top_logprobs_num=8, logprob_start_len=0,
                                  token_ids_logprob=[1, 2]))
        client.wait(rid)
        messages = [m for m in client.messages if rid in m.rids]
    finally:
        client.close()
    assert len(messages) == 3 and messages[0].prompt_rids == [rid]
    blocks = [m.output for m in messages] + [messages[0].prompt]
    for block in blocks:
        wire = codec_block(block).SerializeToString()
        view = arrays_pb2.LogprobBlockView.FromString(wire)
        assert_bytes_equal_typed(codec_block(block), view)
        assert view.SerializeToString() == wire
        assert len(view.topk_values) == sum(r * k for r, k in zip(view.rows, view.topk)) > 0


def codec_block(block: LogprobBlock) -> arrays_pb2.LogprobBlock:
    """The protobuf message of a block, as the wire layer writes it into every message that carries one."""
    return encode_block(block)


SPECIAL_FLOATS = np.array([-np.inf, -0.0, 0.0, -1e-45, np.finfo(np.float32).min, -3.5, -1e-38, -12.25], dtype=F32)


def constructed_block() -> LogprobBlock:
    """Two requests (2 rows, k=3, 1 id; 1 row, k=2, no ids) full of awkward values."""
    values = np.resize(SPECIAL_FLOATS, 8)
    first = LogprobRows(np.array([-np.inf, -0.0], F32), values[:6].reshape(2, 3),
                        np.array([[0, 248_076, -1], [2**31 - 1, -(2**31), 7]], I32), np.array([[-np.inf], [0.5]], F32))
    second = LogprobRows(np.array([-1e-45], F32), values[6:].reshape(1, 2), np.array([[8, 9]], I32),
                         np.zeros((1, 0), F32))
    return LogprobBlock.of_rows([first, second], [1, 0])


def test_constructed_block_round_trips_both_ways():
    block = constructed_block()
    wire = codec_block(block).SerializeToString()

    view = arrays_pb2.LogprobBlockView.FromString(wire)  # bytes -> typed
    assert_bytes_equal_typed(codec_block(block), view)
    assert np.isneginf(view.token_logprobs[0]) and np.signbit(view.token_logprobs[1])

    typed = arrays_pb2.LogprobBlockView(**{name: list(getattr(view, name)) for name in
                                           [*COUNT_FIELDS, *FLOAT_FIELDS, "topk_ids"]})  # as another language would
    assert typed.SerializeToString() == wire
    decoded = steps.decode_step(typed_message(typed)).output
    assert decoded is not None
    for i in range(2):
        for name in FLOAT_FIELDS:
            np.testing.assert_array_equal(getattr(decoded.request(i), name).view("<u4"),
                                          getattr(block.request(i), name).view("<u4"), name)
        np.testing.assert_array_equal(decoded.request(i).topk_ids, block.request(i).topk_ids)


def typed_message(view: arrays_pb2.LogprobBlockView) -> bytes:
    """A StepOutput whose output block was written as the typed view."""
    return steps.StepMessage(step=1).encoded + b"\x2a" + _varint(view.ByteSize()) + view.SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def test_block_slices_per_request_and_per_owner():
    block = constructed_block()
    assert block.request(0).topk_values.shape == (2, 3) and block.request(1).ids_logprobs.shape == (1, 0)
    assert block.select([0, 1]) is block  # every request, in order: no copy
    second = block.select([1])
    assert (second.rows, second.topk, second.id_counts, second.null_prefix) == ([1], [2], [0], [0])
    np.testing.assert_array_equal(second.request(0).topk_ids, block.request(1).topk_ids)
    swapped = block.select([1, 0])
    np.testing.assert_array_equal(swapped.request(1).topk_values.view("<u4"), block.request(0).topk_values.view("<u4"))
    logprobs = block.request_logprobs(0, np.array([4, 5], I32))
    assert logprobs.null_prefix == 1 and logprobs.token_ids.tolist() == [4, 5]


def test_a_request_s_rows_copy_into_its_buffer_as_its_views_do():
    """copy_request (the gateway's per-message copy, flat slices) puts the bits request(i)'s views hold."""
    block = constructed_block()
    for i in range(len(block)):
        rows = block.request(i)
        into = RequestLogprobs.allocate(5, rows.k, rows.m)
        for array in into.arrays:
            array.view("<u4")[...] = 0xDEADBEEF
        block.copy_request(i, into, 2)
        for held, sent in zip(into.arrays, rows.arrays):
            np.testing.assert_array_equal(held[2:2 + rows.n].view("<u4"), sent.view("<u4"))
            assert (held[:2].view("<u4") == 0xDEADBEEF).all() and (held[2 + rows.n:].view("<u4") == 0xDEADBEEF).all()


@pytest.mark.parametrize("direction", ["packed-to-typed", "typed-to-packed"])
def test_generate_response_twins(direction):
    block = constructed_block().select([0])
    token_ids = np.array([5, 248_000], dtype=I32)
    response = public.GenerateResponse(rid="r1", text="héllo", finish_reason=FinishReason.STOP_TOKEN,
                                       matched_token=248_046, prompt_tokens=3, completion_tokens=2,
                                       token_ids=token_ids.tobytes(), output=block, prompt=block)
    packed_bytes = response.to_bytes()
    if direction == "packed-to-typed":
        typed = generate_pb2.GenerateResponse.FromString(packed_bytes)
        packed = generate_pb2.GenerateResponsePacked.FromString(packed_bytes)
    else:
        packed = generate_pb2.GenerateResponsePacked.FromString(packed_bytes)
        typed = generate_pb2.GenerateResponse(
            token_ids=token_ids.tolist(), **{side: arrays_pb2.LogprobBlockView.FromString(
                getattr(packed, side).SerializeToString()) for side in ("output", "prompt")},
            rid="r1", text="héllo", finish_reason=FinishReason.STOP_TOKEN, matched_token=248_046, prompt_tokens=3,
            completion_tokens=2)
    assert typed.SerializeToString() == packed.SerializeToString()
    np.testing.assert_array_equal(np.frombuffer(packed.token_ids, dtype=I32), np.array(typed.token_ids, dtype=I32))
    assert_bytes_equal_typed(packed.output, typed.output)
    back = public.GenerateResponse.from_bytes(typed.SerializeToString())
    output = back.output_logprobs()
    assert isinstance(output, RequestLogprobs) and output.token_ids.tolist() == [5, 248_000]
    np.testing.assert_array_equal(output.topk_ids, block.request(0).topk_ids)
    assert (back.rid, back.text, back.finish_reason, back.matched_token) == (
        "r1", "héllo", FinishReason.STOP_TOKEN, 248_046)


# -- every twin holds every field -----------------------------------------------------------------------


def _twins() -> list[type]:
    modules = (control, detokenizer, public, scheduler, steps)
    found = {cls for module in modules for cls in vars(module).values()
             if isinstance(cls, type) and hasattr(cls, "_wire_fields")}
    return sorted(found, key=lambda cls: cls.__name__)


def _sample(field: FieldDescriptor, annotation, depth: int):
    """A value unlike the field's default, for the twin of kind `annotation`."""
    inner = codec._optional_of(annotation) or annotation
    origin = typing.get_origin(inner)
    if origin is list:
        return [_sample(field, typing.get_args(inner)[0], depth)] * 2
    if origin is dict:
        key, value = typing.get_args(inner)
        return {(7 if key is int else "k"): _sample(field, value, depth)}
    if isinstance(inner, type) and issubclass(inner, enum.IntEnum):
        return list(inner)[-1]
    if inner is LogprobBlock:
        return constructed_block()
    if dataclasses.is_dataclass(inner):
        return _filled(inner, depth + 1)
    return {int: 3, float: 0.5, str: "x", bool: True, bytes: b"\x01\x02"}[inner]


def _filled(cls: type, depth: int = 0):
    """A twin with every field set away from its default (one member of a oneof)."""
    hints = typing.get_type_hints(cls)
    values = {}
    descriptor = cls._wire_proto.DESCRIPTOR
    for f in dataclasses.fields(cls):
        proto_field = descriptor.fields_by_name[f.name]
        oneof = proto_field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_") and proto_field is not oneof.fields[0]:
            continue  # a real oneof: only its first member
        values[f.name] = _sample(proto_field, hints[f.name], depth)
    return cls(**values)


@pytest.mark.parametrize("cls", _twins(), ids=lambda cls: cls.__name__)
def test_every_field_of_a_twin_crosses_the_wire(cls):
    """A twin with every field set comes back equal from each of its protobuf messages: no field is dropped."""
    value = _filled(cls)
    for proto in {type(to_proto(value))} | {cls._wire_proto}:
        message = to_proto(value, proto)
        for f in dataclasses.fields(cls):
            if getattr(value, f.name) is not None and not isinstance(getattr(value, f.name), LogprobBlock):
                assert message.HasField(f.name) if message.DESCRIPTOR.fields_by_name[f.name].has_presence else True
        back = from_proto(cls, proto.FromString(message.SerializeToString()))
        assert _comparable(back) == _comparable(value)


def _comparable(value):
    """A twin as plain data (blocks by their bytes)."""
    if isinstance(value, LogprobBlock):
        return dataclasses.astuple(value)
    if dataclasses.is_dataclass(value):
        return {f.name: _comparable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    return value


def test_the_step_message_view_holds_every_field():
    """StepMessage (a view of the parsed StepOutput, not a codec twin) names every field, and a message with each
    one set reads back the same from its bytes."""
    assert set(steps.STEP_FIELDS) == set(scheduler.scheduler_pb2.StepOutput.DESCRIPTOR.fields_by_name)
    start = _filled(steps.RequestStart)
    message = steps.StepMessage(step=9, started=[start], rids=["a", "b"], token_ids=[1, 2, 3],
                                output=constructed_block(), prompt_rids=["a"], prompt=constructed_block().select([1]),
                                finished=[_filled(steps.Finish)], texts=["x", "y"], positions=[0, 4], counts=[1, 2],
                                resumed=[_filled(steps.RequestResume)], weight_version="v",
                                made_at_unix_us=1_700_000_000_000_000,
                                top_p=NucleusBlock([1, 2], np.array([2, 1, 1], I32).tobytes(),
                                                   np.array([4, 9, 2, 3], I32).tobytes()))
    back = steps.decode_step(message.encoded)
    for name in steps.STEP_FIELDS:
        assert _comparable(_listed(getattr(back, name))) == _comparable(_listed(getattr(message, name))), name
    assert back.entry_tokens(1) == [2, 3] and back.touched_rids() == {"a", "b", start.rid,
                                                                       message.finished[0].rid,
                                                                       message.resumed[0].start.rid}


def _listed(value):
    return list(value) if not isinstance(value, (str, bytes, int, LogprobBlock, NucleusBlock, type(None))) else value


def test_a_twin_that_misses_a_field_fails_at_import():
    with pytest.raises(TypeError, match="missing"):
        @codec.twin(scheduler.scheduler_pb2.AbortRequest)
        @dataclasses.dataclass
        class Partial:
            rid: str


def test_enums_match_their_protos():
    assert {m.name: m.value for m in control.PauseMode} == {
        name.removeprefix("PAUSE_MODE_"): value for name, value in generate_pb2.PauseMode.items()}
    assert {m.name: m.value for m in control.WeightsRelease} == {
        name.removeprefix("WEIGHTS_RELEASE_"): value for name, value in generate_pb2.WeightsRelease.items()}
    assert {m.name: m.value for m in FinishReason} == {
        name.removeprefix("FINISH_REASON_"): value for name, value in arrays_pb2.FinishReason.items()}


def test_an_unknown_enum_number_is_refused_naming_the_field():
    data = generate_pb2.PauseGenerationRequest(mode=7).SerializeToString()
    with pytest.raises(codec.WireValueError, match="PauseGenerationRequest.mode: unknown PauseMode 7"):
        codec.decoder(control.PauseGenerationRequest, generate_pb2.PauseGenerationRequest)(data)


@pytest.mark.parametrize("position, count, expected, order", [
    (4, 2, 4, EntryOrder.NEXT), (0, 4, 4, EntryOrder.HELD), (2, 2, 4, EntryOrder.HELD),
    (5, 1, 4, EntryOrder.GAP), (3, 2, 4, EntryOrder.OVERLAP)])
def test_entry_order(position, count, expected, order):
    assert entry_order(position, count, expected) is order
