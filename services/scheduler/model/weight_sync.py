"""Weights a trainer broadcasts over a torch.distributed group: SGLang's init_weights_update_group,
update_weights_from_distributed and destroy_weights_update_group, which every RL framework that syncs through
NCCL calls.

The group is made the way the trainers' helper makes theirs (slime, OpenRLHF and verl carry one): torch's TCP
rendezvous at master_address:master_port (the trainer, rank 0, hosts the store), the store's keys prefixed with
the group's name, one process group of world_size ranks. A trainer's code therefore connects unchanged. Every
call here blocks (a worker thread's), never the engine thread: the engine keeps stepping while tensors arrive,
and swaps them in between two steps like any other update (weights.py).

With --tp-size N the server's ranks are ranks rank_offset .. rank_offset + N - 1 of the trainer's group (SGLang's
layout, world_size = 1 + N for one engine): rank 0 has every other rank join, receive and leave with it
(parallel/group.py's weights channel), each receiving the full tensors and keeping its cut.
"""

import itertools
import logging
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from flatwire_wire.control import DEFAULT_GROUP, InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

from services.scheduler.model.weights import ServedWeights, StagedWeights, WeightsRefused
from services.scheduler.parallel.calls import JoinGroup, LeaveGroup, Receive, Received

if TYPE_CHECKING:
    from services.scheduler.parallel.group import RankGroup

log = logging.getLogger(__name__)
FLATTENED_BUCKET = "flattened_bucket"


@dataclass
class UpdateGroup:
    name: str
    group: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    busy: threading.Lock  # one update at a time: two would interleave their broadcasts


def _join(request: InitWeightsUpdateGroupRequest, name: str, backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """The process group the trainer's helper makes on its side, made on ours."""
    url = f"tcp://{request.master_address}:{request.master_port}"
    store, rank, world_size = next(rendezvous(url, request.rank_offset, request.world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(name, store),
                                         group_name=GroupName(name), backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # broadcast's src=0 is the group's rank 0
    return group


# What a checkpoint's tensors are stored in (torch's names; trainers send str(dtype), with or without "torch.").
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _dtype(name: str) -> torch.dtype:
    dtype = DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise WeightsRefused(f"dtypes: {name!r} is not one of {', '.join(DTYPES)}")
    return dtype


class WeightGroups:
    """The update groups this scheduler has joined, by name."""

    def __init__(self, device: torch.device, timeout_s: float, ranks: "RankGroup | None" = None):
        """`ranks`: on tensor-parallel rank 0, the other ranks, which join, receive and leave with it."""
        self.device = device
        self.ranks = ranks
        self._updates = itertools.count()  # ids of the updates the other ranks receive
        self.timeout = timedelta(seconds=timeout_s)
        self._groups: dict[str, UpdateGroup] = {}

    def init(self, request: InitWeightsUpdateGroupRequest) -> str:
        name = request.group_name or DEFAULT_GROUP
        backend = request.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if name in self._groups:
            raise WeightsRefused(f"group_name: {name!r} exists; destroy_weights_update_group it first")
        if backend not in ("nccl", "gloo"):
            raise WeightsRefused(f"backend: {backend!r}: expected nccl or gloo")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightsRefused(f"backend: nccl needs CUDA, and this scheduler runs on {self.device}: use gloo")
        if not request.master_address or not 0 < request.master_port < 65536:  # torch would assert, or wait it out
            raise WeightsRefused(f"master_address, master_port: {request.master_address!r}:{request.master_port} "
                                 "is not a host and port")
        try:  # a name that does not resolve is refused now, not after the rendezvous's retries
            socket.getaddrinfo(request.master_address, request.master_port)
        except (socket.gaierror, UnicodeError) as exc:
            raise WeightsRefused(f"master_address: {request.master_address!r} does not resolve: {exc}") from None
        tp_size = self.ranks.size if self.ranks is not None else 1
        if not 0 < request.rank_offset <= request.world_size - tp_size:
            raise WeightsRefused(f"rank_offset: {request.rank_offset} and this scheduler's {tp_size} tensor-parallel "
                                 f"rank(s) are not ranks of a world of {request.world_size} besides the trainer's 0")
        try:
            group = self._joined(request, name, backend)
        except (RuntimeError, ValueError, TimeoutError) as exc:  # c10d's errors are RuntimeErrors
            raise WeightsRefused(f"could not join group {name!r} at {request.master_address}:{request.master_port} "
                                 f"as rank {request.rank_offset} of {request.world_size}: {exc}") from None
        self._groups[name] = UpdateGroup(name, group, request.rank_offset, request.world_size, backend,
                                         threading.Lock())
        log.info("joined weight update group %r (%s) as rank %d of %d", name, backend, request.rank_offset,
                 request.world_size)
        return f"joined group {name!r} ({backend}) as rank {request.rank_offset} of {request.world_size}"

    def _joined(self, request: InitWeightsUpdateGroupRequest, name: str, backend: str) -> dist.ProcessGroup:
        if self.ranks is None:
            return _join(request, name, backend, self.timeout)
        joined: list[dist.ProcessGroup] = []

        def join() -> dist.ProcessGroup:
            joined.append(_join(request, name, backend, self.timeout))
            return joined[0]

        try:
            return self.ranks.ask(JoinGroup(request), join)
        except WeightsRefused:
            if joined:  # this rank joined, another did not: the group is no use
                dist.destroy_process_group(joined[0])
            raise

    def destroy(self, group_name: str) -> str:
        name = group_name or DEFAULT_GROUP
        group = self._groups.pop(name, None)
        if group is None:
            raise WeightsRefused(f"group_name: no group {name!r} (init_weights_update_group first)")
        if self.ranks is None:
            dist.destroy_process_group(group.group)
        else:
            self.ranks.ask(LeaveGroup(name), lambda: dist.destroy_process_group(group.group))
        return f"left group {name!r}"

    def receive(self, request: UpdateWeightsFromDistributedRequest, weights: ServedWeights) -> StagedWeights:
        """The tensors rank 0 broadcasts, checked against the served model and staged. What the request
        declares is received whatever it is, so that the trainer's collective completes; the checks follow."""
        name = request.group_name or DEFAULT_GROUP
        group = self._groups.get(name)
        if group is None:
            raise WeightsRefused(f"group_name: no group {name!r} (init_weights_update_group first)")
        specs = self._specs(request)
        declared = sum(shape.numel() * dtype.itemsize for _, dtype, shape in specs)
        if declared > weights.max_broadcast_bytes:
            raise WeightsRefused(f"the tensors declared take {declared} bytes, more than every tensor of the served "
                                 "model in float64: not a subset of its tensors")
        if not group.busy.acquire(blocking=False):
            raise WeightsRefused(f"group {name!r} is receiving another update")
        update, part = None, None
        try:
            if self.ranks is None:
                tensors = self._broadcast(group, request.load_format, specs, weights)
            else:
                update = next(self._updates)
                part = Received(update)
                tensors = self.ranks.ask(Receive(update, request),
                                         lambda: self._broadcast(group, request.load_format, specs, weights))
        finally:
            group.busy.release()
        return weights.stage_received(tensors, f"{len(tensors)} tensors broadcast over group {name!r}", part)

    def _specs(self, request: UpdateWeightsFromDistributedRequest) -> list[tuple[str, torch.dtype, torch.Size]]:
        if not (len(request.names) == len(request.dtypes) == len(request.shapes)):
            raise WeightsRefused(f"names, dtypes, shapes: {len(request.names)}, {len(request.dtypes)} and "
                                 f"{len(request.shapes)} entries; one of each per tensor")
        if not request.names:
            raise WeightsRefused("names: no tensor to receive")
        if request.load_format not in ("", FLATTENED_BUCKET):
            raise WeightsRefused(f"load_format: {request.load_format!r}: expected none or {FLATTENED_BUCKET}")
        specs = [(name, _dtype(dtype), torch.Size(shape.dims))
                 for name, dtype, shape in zip(request.names, request.dtypes, request.shapes)]
        if request.load_format == FLATTENED_BUCKET and len({dtype for _, dtype, _ in specs}) > 1:
            raise WeightsRefused("dtypes: a flattened bucket holds tensors of one dtype")
        return specs

    def _broadcast(self, group: UpdateGroup, load_format: str, specs: list[tuple[str, torch.dtype, torch.Size]],
                   weights: ServedWeights) -> dict[str, torch.Tensor]:
        buffers = {name: weights.receive_buffer(name, dtype, shape, self.device) for name, dtype, shape in specs}
        received = 0
        try:
            if load_format == FLATTENED_BUCKET:
                flat = torch.empty(sum(shape.numel() for _, _, shape in specs), dtype=specs[0][1], device=self.device)
                dist.broadcast(flat, src=0, group=group.group)
                offset = 0
                for name, _, shape in specs:
                    buffers[name].copy_(flat[offset:offset + shape.numel()].view(shape))
                    offset += shape.numel()
            else:
                for name, _, _ in specs:
                    dist.broadcast(buffers[name], src=0, group=group.group)
                    received += 1
        except (RuntimeError, ValueError) as exc:  # the trainer died or stopped: gloo's and NCCL's errors
            self._groups.pop(group.name, None)
            try:
                dist.destroy_process_group(group.group)
            except (RuntimeError, ValueError):
                pass  # a broken group may not tear down cleanly; it is forgotten either way
            raise WeightsRefused(f"the broadcast stopped after {received} of {len(specs)} tensors ({exc}); the "
                                 f"served weights are unchanged, and group {group.name!r} is destroyed: "
                                 "init_weights_update_group again") from None
        return buffers
