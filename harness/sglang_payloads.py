"""A colocated trainer's side of SGLang's update_weights_from_tensor, as the frameworks build it, without SGLang:
its MultiprocessingSerializer (torch's ForkingPickler, then base64), its FlattenedTensorBucket and its
LocalSerializedTensor, pickled under SGLang's own module names, so that the bytes are the ones a trainer sends.
It imports nothing of flatwire's.

On CPU torch shares a tensor's storage in shared memory: under the file_system strategy (`shared_memory`) a
/dev/shm file any process of the machine may map, which the scheduler opens. The trainer must keep the tensors
(`Payload.keep`) until the call returns.
"""

import base64
import io
import math
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing

BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"  # where SGLang's FlattenedTensorMetadata lives
RUNNER_MODULE = "sglang.srt.model_executor.model_runner"  # and its LocalSerializedTensor


@dataclass
class FlattenedTensorMetadata:  # SGLang's fields, pickled as its class
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:  # one pickled tensor per tensor-parallel rank
    values: list


FlattenedTensorMetadata.__module__ = BUCKET_MODULE
LocalSerializedTensor.__module__ = RUNNER_MODULE


@contextmanager
def _as_sglang() -> Iterator[None]:
    """SGLang's modules, holding these classes, while pickling: pickle names a class by its module, and checks that
    the module holds it."""
    added = []
    for name, classes in ((BUCKET_MODULE, [FlattenedTensorMetadata]), (RUNNER_MODULE, [LocalSerializedTensor])):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            module = ".".join(parts[:depth])
            if module not in sys.modules:
                sys.modules[module] = types.ModuleType(module)
                added.append(module)
        for cls in classes:
            setattr(sys.modules[name], cls.__name__, cls)
    try:
        yield
    finally:
        for module in added:
            del sys.modules[module]


@contextmanager
def shared_memory() -> Iterator[None]:
    """torch's file_system sharing strategy while serializing (file_descriptor, Linux's default, shares a descriptor
    that only a child of this process can fetch)."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def pickled(obj) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize(obj)."""
    buffer = io.BytesIO()
    with _as_sglang():
        ForkingPickler(buffer).dump(obj)
    return buffer.getvalue()


def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    return base64.b64encode(pickled(obj)).decode("utf-8")


def flattened_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """SGLang's current FlattenedTensorBucket (supports_multi_dtypes): every tensor's bytes in one uint8 tensor, as
    {"flattened_tensor", "metadata"} (slime's, miles' and NeMo-RL's payload)."""
    parts, metadata, start = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.flatten().view(torch.uint8)
        parts.append(flat)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, start + flat.numel(),
                                                flat.numel()))
        start += flat.numel()
    return {"flattened_tensor": torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8),
            "metadata": metadata}


def flattened_bucket_of_one_dtype(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """SGLang's earlier FlattenedTensorBucket: one dtype, offsets in elements."""
    parts, metadata, start = [], [], 0
    for name, tensor in named_tensors:
        parts.append(tensor.flatten())
        numel = math.prod(tensor.shape)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, start + numel, numel))
        start += numel
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


@dataclass
class Payload:
    """One update_weights_from_tensor call's JSON body, and the tensors whose shared memory it names."""

    body: dict
    keep: list = field(default_factory=list)
