"""The reader of /update_weights_from_tensor's payloads (services/scheduler/model/tensor_payload.py), in process:
each format SGLang's trainers send (harness/sglang_payloads.py builds them as SGLang does, tensors in shared memory
under torch's file_system strategy) read back bit for bit, and hostile pickles refused naming what they asked for,
with nothing run. tests/scheduler/test_colocated_updates.py sends the same through the gateway to a scheduler.
"""

import io
import os
import pickle
import re
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.multiprocessing import reductions

from harness.sglang_payloads import (
    LocalSerializedTensor,
    flattened_bucket,
    flattened_bucket_of_one_dtype,
    pickled,
    serialize,
    shared_memory,
)
from services.scheduler.model.tensor_payload import MAX_ENTRY_BYTES, named_tensors
from services.scheduler.model.weights import WeightsRefused


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    """Four dtypes; the int64 one starts 60 bytes into a bucket, unaligned for its dtype."""
    generator = torch.Generator().manual_seed(5)
    return {"a": torch.randn(3, 5, generator=generator), "b": torch.arange(7, dtype=torch.int64) - 3,
            "c": torch.randn(4, generator=generator).to(torch.bfloat16), "d": torch.tensor([True, False, True])}


def same(read: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> bool:
    return read.keys() == sent.keys() and all(
        read[name].dtype == tensor.dtype and torch.equal(read[name], tensor) for name, tensor in sent.items())


def test_a_list_of_pairs_is_read_as_sent_without_and_with_direct(tensors):
    with shared_memory():
        entry = pickled(list(tensors.items()))
        as_tuples = pickled(tuple((name, tensor) for name, tensor in tensors.items()))
    for load_format in ("", "direct"):
        assert same(named_tensors(entry, load_format, 0), tensors)
    assert same(named_tensors(as_tuples, "", 0), tensors)


def test_buckets_of_bytes_and_of_one_dtype_are_read_as_sent(tensors):
    floats = {name: torch.randn(2, 3) for name in ("x", "y")}
    with shared_memory():
        mixed = pickled(flattened_bucket(list(tensors.items())))
        single = pickled(flattened_bucket_of_one_dtype(list(floats.items())))
        empty = pickled({"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []})  # slime's filler
    assert same(named_tensors(mixed, "flattened_bucket", 0), tensors)
    assert same(named_tensors(single, "flattened_bucket", 0), floats)
    assert named_tensors(empty, "flattened_bucket", 0) == {}


def test_a_local_serialized_tensor_gives_each_rank_its_own(tensors):
    """verl's payload (sglang/srt/weight_sync/utils.py): per name, one pickled tensor per rank."""
    with shared_memory():
        entry = pickled([("a", LocalSerializedTensor(values=[pickled(tensors["a"]), pickled(tensors["a"] * 2)]))])
    assert torch.equal(named_tensors(entry, "", 0)["a"], tensors["a"])
    assert torch.equal(named_tensors(entry, "", 1)["a"], tensors["a"] * 2)
    with pytest.raises(WeightsRefused, match="of 2 values has no pickled tensor for rank 2"):
        named_tensors(entry, "", 2)
    with shared_memory():  # a value as SGLang's serializer's base64 text, which its deserializer takes too
        as_text = pickled([("a", LocalSerializedTensor(values=[serialize(tensors["a"])]))])
    assert torch.equal(named_tensors(as_text, "", 0)["a"], tensors["a"])


def test_a_format_that_is_not_what_load_format_says_is_refused(tensors):
    with shared_memory():
        bucket = pickled(flattened_bucket(list(tensors.items())))
        pairs = pickled(list(tensors.items()))
    with pytest.raises(WeightsRefused, match="needs load_format 'flattened_bucket'"):
        named_tensors(bucket, "", 0)
    with pytest.raises(WeightsRefused, match="not a dict of flattened_tensor and metadata"):
        named_tensors(pairs, "flattened_bucket", 0)
    with pytest.raises(WeightsRefused, match="load_format: 'safetensors'"):
        named_tensors(pairs, "safetensors", 0)


# -- hostile pickles -----------------------------------------------------------------------------------------------

@dataclass
class TrainerState:
    step: int = 3


class Runs:
    """An object whose pickle calls `call(*args)` when loaded."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def dumped(obj, protocol: int = 4) -> bytes:
    return pickle.dumps(obj, protocol=protocol)


def forked(obj) -> bytes:
    """torch's reductions, under file_system sharing."""
    buffer = io.BytesIO()
    with shared_memory():
        ForkingPickler(buffer).dump(obj)
    return buffer.getvalue()


def refusal(entry: bytes, load_format: str = "") -> str:
    with pytest.raises(WeightsRefused) as refused:
        named_tensors(entry, load_format, 0)
    message = str(refused.value)
    assert message.startswith("serialized_named_tensors[0]: "), message
    return message


def test_code_execution_is_refused_by_the_name_it_asks_for_in_every_opcode(tmp_path):
    marker = tmp_path / "ran"
    command = f"touch {marker}"
    system = f"{os.system.__module__}.system"  # posix.system
    cases = {
        "STACK_GLOBAL (protocol 4)": (dumped(Runs(os.system, command)), system),
        "GLOBAL (protocol 0)": (dumped(Runs(os.system, command), protocol=0), system),
        "GLOBAL (protocol 2)": (dumped(Runs(os.system, command), protocol=2), system),
        "INST": (b"(S'" + command.encode() + b"'\nios\nsystem\n.", "os.system"),
        "nested in a list of pairs": (dumped([("a", [[{"x": Runs(os.system, command)}]])]), system),
        "a global of torch's besides the rebuilds": (dumped(Runs(torch.load, "/etc/passwd")),
                                                     "torch.serialization.load"),
        "eval": (dumped(Runs(eval, "__import__('os').system('x')")), "builtins.eval"),
        "getattr inside a bucket's metadata": (dumped({"flattened_tensor": [], "metadata": [
            Runs(getattr, Runs(__import__, "os"), "system")]}), "builtins.getattr"),
    }
    for what, (entry, name) in cases.items():
        message = refusal(entry, "flattened_bucket" if "bucket" in what else "")
        assert f"{name} is not read here" in message, (what, message)
    assert not marker.exists()


def test_a_class_outside_the_list_is_refused_by_name(tensors):
    """A state_dict as it comes (an OrderedDict), a dataclass of the trainer's own."""
    from collections import OrderedDict
    with shared_memory():
        entry = pickled(OrderedDict(tensors))
    assert "collections.OrderedDict is not read here" in refusal(entry)
    own = refusal(dumped([("a", TrainerState())]))
    assert "tests.scheduler.test_tensor_payload.TrainerState is not read here" in own


def test_the_admitted_names_cannot_be_called_or_built_otherwise():
    """torch.Tensor is an inert marker (torch.Tensor(10**9) would allocate 4 GB); SGLang's metadata classes are
    built from their pickled state alone, and BUILD sets no state on anything else (a tensor's __setstate__)."""
    tensor_call = b"\x80\x04\x8c\x05torch\x8c\x06Tensor\x93J\x00\xca\x9a;\x85R."  # torch.Tensor(10**9)
    assert "is not callable" in refusal(tensor_call)
    metadata_call = (b"\x80\x04\x8c$sglang.srt.weight_sync.tensor_bucket\x8c\x17FlattenedTensorMetadata\x93"
                     b"\x8c\x01a\x85R.")
    assert "FlattenedTensorMetadata is only read from its pickled state" in refusal(metadata_call)
    extra_field = (b"\x80\x04\x8c$sglang.srt.weight_sync.tensor_bucket\x8c\x17FlattenedTensorMetadata\x93)\x81"
                   b"}\x8c\x08callback\x8c\x01xsb.")  # NEWOBJ, then BUILD with a {callback: x} state
    assert "its state is" in refusal(extra_field)
    built_tensor = forked(torch.zeros(2))[:-1] + b"}\x8c\x01x\x8c\x01y\x73b."  # a tensor, then BUILD {"x": "y"}
    assert "BUILD of a Tensor" in refusal(built_tensor)
    assert "a persistent id" in refusal(b"\x80\x04\x8c\x01x\x94Q.")


def test_shared_memory_is_checked_before_it_is_mapped():
    """A size past the end of the file would fault (SIGBUS) when read; a name outside torch's is never opened; a
    view past the end of its storage is never made."""
    with shared_memory():
        tensor = torch.arange(4, dtype=torch.float32).share_memory_()
        manager, handle, _ = tensor.untyped_storage()._share_filename_cpu_()
    storage = torch.storage.UntypedStorage
    too_big = Runs(reductions.rebuild_storage_filename, storage, manager, handle, 10**9)
    assert re.search(r"holds \d+ bytes, not the 1000000000 asked for", refusal(forked(too_big)))
    outside = Runs(reductions.rebuild_storage_filename, storage, manager, b"/../../etc/passwd", 8)
    assert "is not a name torch gives a shared-memory file" in refusal(forked(outside))
    gone = Runs(reductions.rebuild_storage_filename, storage, manager, b"/torch_1_2_3", 8)
    assert "is not on this machine" in refusal(forked(gone))
    view = Runs(reductions.rebuild_tensor, torch.Tensor, tensor._typed_storage(), (0, torch.Size([10**6]), (1,), False))
    assert "passes the end of its 16-byte storage" in refusal(forked(view))


def test_a_descriptor_shared_under_the_default_strategy_is_refused_with_the_remedy():
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("a", torch.zeros(3))])  # file_descriptor: Linux's default
    message = refusal(buffer.getvalue())
    assert "rebuild_storage_fd" in message and "set_sharing_strategy('file_system')" in message


def test_oversized_and_malformed_payloads_are_refused():
    assert f"more than {MAX_ENTRY_BYTES}" in refusal(b"\x80" * (MAX_ENTRY_BYTES + 1))
    assert "not a payload this server reads" in refusal(b"not a pickle")
    assert "not a payload this server reads" in refusal(dumped([("a", 1)])[:-3])  # truncated
    assert "a int where a tensor was expected" in refusal(dumped([("a", 1)]))
