"""SGLang's update_weights_from_tensor payload, read without running what it names.

A colocated trainer sends each tensor-parallel rank an entry of `serialized_named_tensors`: torch's
ForkingPickler bytes (SGLang's MultiprocessingSerializer, base64 on the HTTP wire) of

- load_format None or "direct": a list of (name, tensor) pairs; a tensor may be a LocalSerializedTensor, one
  pickled tensor per rank (verl, through sglang/srt/weight_sync/utils.py), of which rank i reads the i-th;
- "flattened_bucket": {"flattened_tensor": a flat tensor, "metadata": [FlattenedTensorMetadata, ...]}
  (slime, miles, NeMo-RL): each tensor is a slice, in elements of one dtype, or (SGLang's current bucket) in
  bytes of a uint8 tensor, viewed as its own dtype.

A pickled tensor is a handle, not the data: on CUDA an IPC handle (`rebuild_cuda_tensor`, or SGLang's patched
`_rebuild_cuda_tensor_modified`, which names the device by UUID), on CPU a shared-memory file under torch's
file_system sharing strategy (`rebuild_storage_filename`: the sender's torch_shm_manager socket and a
/dev/shm name). Under torch's default file_descriptor strategy the pickle holds a descriptor that only a
process sharing the sender's multiprocessing authkey can fetch (its resource_sharer authenticates the
receiver): refused, naming the setting that makes it work.

Unpickling a request body runs whatever callable it names (SGLang's own allowlist admits whole modules:
builtins, torch, ...). Here a (module, name) is admitted only if the format uses it, and it resolves to this
module's own function or marker, never to an import: torch's rebuilds are reimplemented with every argument
checked (a shared-memory file must exist and hold the size asked for, a view must lie within its storage),
the classes a payload names as arguments (torch.Tensor, ...) are inert markers that cannot be called, and the
two metadata classes are plain mirrors of SGLang's whose state is checked field by field. BUILD applies to
those mirrors alone. Anything else is refused with the name it asked for, before a weight changes.

CUDA IPC (the GPU path) has not run here: no GPU.
"""

import base64
import binascii
import io
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing import reductions

from services.scheduler.model.weight_sync import DTYPES
from services.scheduler.model.weights import WeightsRefused

FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = ("", "direct", FLATTENED_BUCKET)  # "direct": names are the checkpoint's here, as without it
MAX_ENTRY_BYTES = 16 << 20  # one rank's pickle: handles and names (a bucket of 10^5 tensors is a few MB)
SHARED_MEMORY = Path("/dev/shm")
SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")  # what torch's file_system strategy names its files
REDUCTIONS = "torch.multiprocessing.reductions"
# Modules that hold the classes and the patched CUDA rebuild SGLang's payloads name: SGLang's (current and
# earlier homes) and NeMo-RL's vendored copy of them.
BUCKET_MODULES = ("sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner",
                  "nemo_rl.models.generation.sglang.utils.train_utils")
LOCAL_TENSOR_MODULES = ("sglang.srt.model_executor.model_runner",
                        "sglang.srt.model_executor.model_runner_components.weight_updater")
PATCHED_CUDA_MODULES = ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch",
                        "nemo_rl.models.generation.sglang.utils.train_utils")
FILE_DESCRIPTOR = ("a tensor shared under torch's file_descriptor strategy (the default on Linux): its descriptor "
                   "can only be fetched by a process that shares the sender's multiprocessing authkey; call "
                   "torch.multiprocessing.set_sharing_strategy('file_system') in the trainer before serializing")


class Refused(pickle.UnpicklingError):
    """The payload names something that is not read here, or gives a rebuild what it cannot take."""


@dataclass(frozen=True)
class _Marker:
    """A class the payload names as an argument (torch.Tensor, ...): inert, so that it cannot be called."""

    name: str


TENSOR, PARAMETER, UNTYPED_STORAGE = _Marker("torch.Tensor"), _Marker("torch.nn.Parameter"), _Marker(
    "torch.UntypedStorage")


@dataclass(frozen=True)
class _Storage:
    untyped: torch.UntypedStorage
    dtype: torch.dtype | None = None  # set by rebuild_typed_storage


class _Mirror:
    """A class of SGLang's payloads, rebuilt here as plain checked data: NEWOBJ makes one, BUILD its state."""

    FIELDS: dict[str, type | tuple[type, ...]] = {}

    def __init__(self, *args, **kwargs):
        raise Refused(f"{type(self).__name__} is only read from its pickled state")

    def __setstate__(self, state) -> None:
        if not isinstance(state, dict) or set(state) != set(self.FIELDS):
            given = str(sorted(map(str, state)))[:200] if isinstance(state, dict) else type(state).__name__
            raise Refused(f"{type(self).__name__}: its state is {given}, not the fields {sorted(self.FIELDS)}")
        for name, kind in self.FIELDS.items():
            if not isinstance(state[name], kind) or isinstance(state[name], bool) and kind is int:
                raise Refused(f"{type(self).__name__}.{name}: {type(state[name]).__name__}, not {kind}")
        self.__dict__.update(state)


class FlattenedTensorMetadata(_Mirror):
    """SGLang's sglang/srt/weight_sync/tensor_bucket.py FlattenedTensorMetadata: one tensor of a bucket."""

    FIELDS = {"name": str, "shape": (torch.Size, tuple), "dtype": torch.dtype, "start_idx": int, "end_idx": int,
              "numel": int}
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class LocalSerializedTensor(_Mirror):
    """SGLang's LocalSerializedTensor: one pickled tensor per tensor-parallel rank."""

    FIELDS = {"values": (list, tuple)}
    values: list


def _ints(values, what: str) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list, torch.Size)) or not all(
            type(v) is int and v >= 0 for v in values):
        raise Refused(f"{what}: {str(values)[:80]} is not a tuple of non-negative ints")
    return tuple(values)


def _size(dims) -> torch.Size:
    return torch.Size(_ints(dims, "torch.Size"))


def _within(storage_bytes: int, dtype: torch.dtype, offset: int, size: tuple[int, ...], stride: tuple[int, ...]
            ) -> None:
    """A view of `size` and `stride` from element `offset` lies within `storage_bytes`."""
    if len(size) != len(stride):
        raise Refused(f"a tensor of size {list(size)} with strides {list(stride)}")
    if 0 in size:
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if (last + 1) * dtype.itemsize > storage_bytes:
        raise Refused(f"a tensor of size {list(size)}, strides {list(stride)} from element {offset} passes the end "
                      f"of its {storage_bytes}-byte storage")


def _dtype(value) -> torch.dtype:
    if not isinstance(value, torch.dtype) or value not in DTYPES.values():
        raise Refused(f"dtype {value!r} is not one of {', '.join(DTYPES)}")
    return value


def _rebuild_storage_filename(cls, manager, handle, size, dtype=None) -> _Storage:
    """torch's file_system strategy: map the sender's /dev/shm file (it keeps it alive until we are done)."""
    if cls is not UNTYPED_STORAGE or not isinstance(manager, bytes) or not isinstance(handle, bytes) \
            or type(size) is not int or size < 0:
        raise Refused("rebuild_storage_filename: arguments are not a storage class, two byte strings and a size")
    if not SHM_NAME.fullmatch(handle):
        raise Refused(f"rebuild_storage_filename: {handle!r} is not a name torch gives a shared-memory file")
    byte_size = size if dtype is None else size * _dtype(dtype).itemsize
    try:
        file = os.stat(SHARED_MEMORY / handle[1:].decode())
        socket = os.stat(manager)
    except OSError as exc:
        raise Refused(f"shared memory {handle.decode()} (or its manager {manager!r}) is not on this machine: "
                      f"{exc.strerror} (the trainer must run here and keep its tensors until the call returns)"
                      ) from None
    if not manager.endswith(b"/manager.sock") or not stat.S_ISSOCK(socket.st_mode):
        raise Refused(f"rebuild_storage_filename: {manager!r} is not a torch_shm_manager socket")
    if file.st_size < byte_size:  # mapping past its end would fault (SIGBUS) on the first read
        raise Refused(f"shared memory {handle.decode()} holds {file.st_size} bytes, not the {byte_size} asked for")
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, byte_size)
    storage._shared_decref()  # the sender counted one reference for this pickle (torch's reduce_storage)
    return _Storage(storage, dtype)


def _rebuild_storage_empty(cls) -> _Storage:
    if cls is not UNTYPED_STORAGE:
        raise Refused("rebuild_storage_empty: not a storage class")
    return _Storage(torch.UntypedStorage(0))


def _rebuild_typed_storage(storage, dtype) -> _Storage:
    if not isinstance(storage, _Storage) or storage.dtype is not None:
        raise Refused("rebuild_typed_storage: not an untyped storage")
    return _Storage(storage.untyped, _dtype(dtype))


def _rebuild_tensor(cls, storage, metadata) -> torch.Tensor:
    """A CPU tensor over a shared storage (torch's rebuild_tensor, its bounds checked first)."""
    if cls not in (TENSOR, PARAMETER) or not isinstance(storage, _Storage) or storage.dtype is None \
            or not isinstance(metadata, tuple) or len(metadata) != 4:
        raise Refused("rebuild_tensor: arguments are not a tensor class, a typed storage and its view")
    offset, size, stride, _requires_grad = metadata
    if type(offset) is not int or offset < 0:
        raise Refused(f"rebuild_tensor: storage offset {offset!r}")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    _within(storage.untyped.nbytes(), storage.dtype, offset, size, stride)
    return torch.empty(0, dtype=storage.dtype).set_(storage.untyped, offset, size, stride)


def _cuda_device(device) -> int:
    """An index, or SGLang's patched reductions' device UUID mapped to this process's index of it."""
    if type(device) is int:
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
    raise Refused(f"CUDA device {device!r} is not a device of this scheduler")


def _rebuild_cuda_tensor(*args) -> torch.Tensor:
    """A CUDA IPC handle opened in this process (torch's rebuild_cuda_tensor; SGLang's patched one names the
    device by UUID). Not run here: no GPU."""
    if len(args) != 15:
        raise Refused(f"rebuild_cuda_tensor: {len(args)} arguments, not 15")
    (cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes, offset_bytes, _requires_grad,
     counter_handle, counter_offset, event_handle, event_sync) = args
    if not torch.cuda.is_available():
        raise Refused("a CUDA tensor (an IPC handle), and this scheduler has no CUDA device")
    if cls not in (TENSOR, PARAMETER) or storage_cls is not UNTYPED_STORAGE or type(offset) is not int \
            or type(size_bytes) is not int or type(offset_bytes) is not int or not isinstance(event_sync, bool) \
            or offset < 0 or size_bytes < 0 or offset_bytes < 0:
        raise Refused("rebuild_cuda_tensor: arguments are not a CUDA tensor's")
    size, stride, dtype, index = _ints(size, "size"), _ints(stride, "stride"), _dtype(dtype), _cuda_device(device)
    _within(size_bytes, dtype, offset, size, stride)
    if handle is None or size_bytes == 0:
        return torch.empty(size, dtype=dtype, device=torch.device("cuda", index))
    return reductions.rebuild_cuda_tensor(torch.Tensor, size, stride, offset, torch.UntypedStorage, dtype, index,
                                          handle, size_bytes, offset_bytes, False, counter_handle, counter_offset,
                                          event_handle, event_sync)


def _file_descriptor(*args):
    raise Refused(FILE_DESCRIPTOR)


ALLOWED: dict[tuple[str, str], object] = {
    (REDUCTIONS, "rebuild_tensor"): _rebuild_tensor,
    (REDUCTIONS, "rebuild_typed_storage"): _rebuild_typed_storage,
    (REDUCTIONS, "rebuild_storage_filename"): _rebuild_storage_filename,
    (REDUCTIONS, "rebuild_storage_empty"): _rebuild_storage_empty,
    (REDUCTIONS, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    **{(module, "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor for module in PATCHED_CUDA_MODULES},
    ("torch", "Tensor"): TENSOR,
    ("torch.nn.parameter", "Parameter"): PARAMETER,
    ("torch.storage", "UntypedStorage"): UNTYPED_STORAGE,
    ("torch", "Size"): _size,
    **{("torch", name): dtype for name, dtype in DTYPES.items()},
    **{(module, "FlattenedTensorMetadata"): FlattenedTensorMetadata for module in BUCKET_MODULES},
    **{(module, "LocalSerializedTensor"): LocalSerializedTensor for module in LOCAL_TENSOR_MODULES},
}
ADMITTED = ("torch's tensor and storage rebuilds, dtypes and torch.Size, plain containers, and SGLang's "
            "FlattenedTensorMetadata and LocalSerializedTensor as data")


class _Unpickler(pickle._Unpickler):  # the Python one: its opcodes can be restricted (BUILD below)
    def find_class(self, module: str, name: str):
        if (module, name) == (REDUCTIONS, "rebuild_storage_fd"):
            raise Refused(f"{REDUCTIONS}.rebuild_storage_fd: {FILE_DESCRIPTOR}")
        found = ALLOWED.get((module, name))
        if found is None:
            raise Refused(f"{module}.{name} is not read here (admitted: {ADMITTED})")
        return found

    def persistent_load(self, pid):
        raise Refused("a persistent id: not read here")

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: lambda unpickler: _load_build(unpickler)}


def _load_build(unpickler: Any) -> None:  # typeshed does not know the Python unpickler's stack
    """BUILD (an object's state set from the pickle) on SGLang's metadata mirrors alone, never on a tensor (whose
    __setstate__ would take any state) or anything else."""
    stack = unpickler.stack
    state = stack.pop()
    target = stack[-1]
    if not isinstance(target, _Mirror):
        raise Refused(f"BUILD of a {type(target).__name__}: state is set on SGLang's metadata classes alone")
    target.__setstate__(state)


def unpickle(data: bytes):
    """The payload's object: its tensors mapped from their handles, its metadata as mirrors; Refused says why not."""
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except Refused:
        raise
    except Exception as exc:  # a malformed pickle, or a rebuild torch refused: never past this function
        raise Refused(f"not a payload this server reads ({type(exc).__name__}: {exc})") from None


def _tensor_of(value, rank: int) -> torch.Tensor:
    if isinstance(value, LocalSerializedTensor):
        own = value.values[rank] if 0 <= rank < len(value.values) else None
        if isinstance(own, str):  # SGLang's deserializer takes its base64 text too
            try:
                own = base64.b64decode(own, validate=True)
            except binascii.Error:
                own = None
        if not isinstance(own, bytes):
            raise Refused(f"a LocalSerializedTensor of {len(value.values)} values has no pickled tensor for rank "
                          f"{rank}")
        value = unpickle(own)
    if not isinstance(value, torch.Tensor):
        raise Refused(f"a {type(value).__name__} where a tensor was expected")
    return value


def _pairs(payload, rank: int) -> dict[str, torch.Tensor]:
    if isinstance(payload, dict):
        raise Refused("a dict: a flattened bucket needs load_format 'flattened_bucket'; the other formats are a "
                      "list of (name, tensor) pairs")
    if not isinstance(payload, (list, tuple)):
        raise Refused(f"a {type(payload).__name__}, not a list of (name, tensor) pairs")
    tensors = {}
    for pair in payload:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], str):
            raise Refused(f"{str(pair)[:80]} is not a (name, tensor) pair")
        tensors[pair[0]] = _tensor_of(pair[1], rank)
    return tensors


def _bucket(payload) -> dict[str, torch.Tensor]:
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise Refused("load_format 'flattened_bucket': not a dict of flattened_tensor and metadata")
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, (list, tuple)):
        raise Refused("flattened_tensor is not a 1-D tensor, or metadata not a list")
    tensors = {}
    for meta in metadata:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise Refused(f"metadata holds a {type(meta).__name__}, not FlattenedTensorMetadata")
        shape, dtype = _size(meta.shape), _dtype(meta.dtype)
        as_bytes = flat.dtype == torch.uint8 and dtype != torch.uint8  # SGLang's bucket of several dtypes
        length = shape.numel() * (dtype.itemsize if as_bytes else 1)
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel() or meta.end_idx - meta.start_idx != length:
            raise Refused(f"metadata of {meta.name!r}: [{meta.start_idx}, {meta.end_idx}) is not {length} "
                          f"{'bytes' if as_bytes else 'elements'} of the {flat.numel()} flattened")
        part = flat[meta.start_idx:meta.end_idx]
        if as_bytes:
            aligned = (part.storage_offset() % dtype.itemsize) == 0
            part = (part if aligned else part.clone()).view(dtype)
        if part.dtype != dtype:  # an older bucket of mixed dtypes, concatenated in the widest: SGLang casts back
            part = part.to(dtype)
        tensors[meta.name] = part.reshape(shape)
    return tensors


def named_tensors(entry: bytes, load_format: str, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of one entry, by name, still in the sender's memory (the caller copies them before it
    answers); WeightsRefused names what was refused."""
    if load_format not in LOAD_FORMATS:
        raise WeightsRefused(f"load_format: {load_format!r} is not one of None, 'direct', 'flattened_bucket'")
    if len(entry) > MAX_ENTRY_BYTES:
        raise WeightsRefused(f"serialized_named_tensors[{rank}]: {len(entry)} bytes, more than {MAX_ENTRY_BYTES}: "
                             "a pickle of tensor handles, not of their data")
    try:
        payload = unpickle(entry)
        return _bucket(payload) if load_format == FLATTENED_BUCKET else _pairs(payload, rank)
    except Refused as exc:
        raise WeightsRefused(f"serialized_named_tensors[{rank}]: refused, nothing changed: {exc}") from None
