"""The Scheduler service's rollout-control calls (RL trainers): weight updates from disk, pushed, broadcast over
the trainer's torch.distributed group or shared by a colocated trainer (model/tensor_payload.py), the group itself,
miles' weight-update session, memory release and resume, pause, continue, abort_all, flush_cache, weight_version
and weights_checker (engine/rollout.py has what each does).

A weight update is read and checked in a worker thread (model/weights.py), one at a time, then handed to the engine
thread, which swaps it in between two steps; the other commands go to the engine thread directly. Each call returns
once the engine applied it. A refusal is `success: false` with the reason, as SGLang answers.

miles opens a session around every update (begin_weight_update, its buckets, end_weight_update; its SGLang restores
quantized weights to a loadable layout at the beginning and post-processes them at the end). No weight here has
another layout than the checkpoint's, so the session means what it can: the updates made in it are checked and
staged as they come (a later one's copy of a tensor replacing an earlier one's) and swapped in together at its end,
as one update, so that no step ever runs on a mix of old and new tensors, paused or not.
"""

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from flatwire_wire.control import (
    AbortAllRequest,
    ContinueGenerationRequest,
    ControlReply,
    DestroyWeightsUpdateGroupRequest,
    FlushCacheRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    ReleaseMemoryOccupationRequest,
    ResumeMemoryOccupationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
)
from flatwire_wire.scheduler import (
    CHECK_WEIGHTS_ACTIONS,
    BeginWeightUpdateRequest,
    CheckWeightsRequest,
    EndWeightUpdateRequest,
    UpdateWeightsFromTensorRequest,
)

from services.scheduler.engine.control import (
    WEIGHTS_RELEASED,
    AbortAll,
    CheckWeights,
    Continue,
    Control,
    FlushCache,
    Pause,
    ReleaseMemory,
    ResumeMemory,
    SetWeightVersion,
    UpdateWeights,
)
from services.scheduler.engine.engine import Engine
from services.scheduler.model.occupation import MemoryOccupation
from services.scheduler.model.tensor_payload import named_tensors
from services.scheduler.model.weight_sync import WeightGroups
from services.scheduler.model.weights import ServedWeights, StagedWeights, WeightsRefused

SYNTHETIC_HAS_NO_WEIGHTS = "this scheduler runs --engine synthetic: it has no weights to update"
log = logging.getLogger("flatwire.scheduler")


@dataclass
class WeightSession:
    """An open weight-update session: what its updates staged so far, as one update."""

    staged: StagedWeights | None = None
    updates: int = 0
    abort_all_requests: bool = False  # any of its updates asked
    weight_version: str | None = None  # the last one named


class RolloutCalls:
    """The rollout-control half of the Scheduler service (server.py's SchedulerService)."""

    engine: Engine

    def __init__(self, weights: ServedWeights | None, weight_groups: WeightGroups | None):
        """`weights`: the model's, for updates in place (None: --engine synthetic has none)."""
        self.weights = weights
        self.weight_groups = weight_groups
        # Their own threads: a join waits up to --weights-sync-timeout-s for a trainer that may never come, and a
        # few of them must not take the default pool's threads, which the other controls read weights on.
        self._group_calls = ThreadPoolExecutor(max_workers=16, thread_name_prefix="weight-group")
        self._updating = asyncio.Lock()  # one staged update at a time: memory for one more copy, applied in order
        self._session: WeightSession | None = None  # miles' begin_weight_update .. end_weight_update
        # This process is tensor-parallel rank 0 (--tp-size): a colocated trainer's entry i is rank i's; rank 0's
        # is staged here and sent to the others (each keeps its cut of the full tensors).
        self.tp_rank = 0
        self.tp_size = weights.ranks.size if weights is not None and weights.ranks is not None else 1

    async def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest, context) -> ControlReply:
        if self._weights_released():  # said before the checkpoint is read against weights that are not there
            return self._refused(WEIGHTS_RELEASED)

        def read(weights: ServedWeights) -> StagedWeights:
            return weights.read_checkpoint(request.model_path, request.load_format)

        return await self._update_weights(read, request.abort_all_requests, request.weight_version)

    async def push_weights(self, chunks, context) -> ControlReply:
        if self.weights is None:  # refused before a byte is buffered
            return self._refused(SYNTHETIC_HAS_NO_WEIGHTS)
        if self._weights_released():
            return self._refused(WEIGHTS_RELEASED)
        first, parts, size = None, [], 0
        limit = self.weights.max_push_bytes
        async for chunk in chunks:
            if first is None:
                first = chunk
            size += len(chunk.safetensors)
            if size > limit:
                return self._refused(f"the pushed file passes {limit} bytes, the served model's size in float32 "
                                     "plus a header: not a subset of its tensors")
            parts.append(chunk.safetensors)
        if first is None:
            return self._refused("PushWeights got no chunk")
        data = b"".join(parts)
        parts.clear()
        return await self._update_weights(lambda weights: weights.read_safetensors(data), first.abort_all_requests,
                                          first.weight_version)

    async def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest, context) -> ControlReply:
        entries, rank = request.serialized_named_tensors, self.tp_rank
        if len(entries) != self.tp_size:
            return self._refused(f"serialized_named_tensors: {len(entries)} entries, and this scheduler runs "
                                 f"{self.tp_size} tensor-parallel rank(s): one entry per rank")
        if self._weights_released():
            return self._refused(WEIGHTS_RELEASED)

        def read(weights: ServedWeights) -> StagedWeights:
            tensors = named_tensors(entries[rank], request.load_format, rank)
            return weights.stage_copies(tensors, f"{len(tensors)} tensors a colocated trainer shared")

        return await self._update_weights(read, request.abort_all_requests, request.weight_version)

    async def begin_weight_update(self, request: BeginWeightUpdateRequest, context) -> ControlReply:
        if self.weights is None:
            return self._refused(SYNTHETIC_HAS_NO_WEIGHTS)
        async with self._updating:
            if self._session is not None:
                return self._refused(f"a weight-update session is open ({self._session.updates} updates staged): "
                                     "end_weight_update first")
            self._session = WeightSession()
        return self._reply("Weight-update session open: updates are staged until end_weight_update.")

    async def end_weight_update(self, request: EndWeightUpdateRequest, context) -> ControlReply:
        async with self._updating:
            session, self._session = self._session, None
            if session is None:
                return self._refused("no weight-update session is open: begin_weight_update first")
            if session.staged is None:
                return self._reply("Weight-update session closed: nothing was staged.")
            return await self._control(UpdateWeights(staged=session.staged,
                                                     abort_all_requests=session.abort_all_requests,
                                                     weight_version=session.weight_version))

    async def check_weights(self, request: CheckWeightsRequest, context) -> ControlReply:
        if request.action not in CHECK_WEIGHTS_ACTIONS:
            return self._refused(f"action: {request.action!r} is not one of {', '.join(CHECK_WEIGHTS_ACTIONS)}")
        return await self._control(CheckWeights(action=request.action, skip=set(request.skip_tensor_list)))

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest, context) -> ControlReply:
        return await self._in_group(lambda groups: groups.init(request))

    async def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest, context
                                              ) -> ControlReply:
        if self.weight_groups is None:
            return self._refused(SYNTHETIC_HAS_NO_WEIGHTS)
        groups = self.weight_groups
        return await self._update_weights(lambda weights: groups.receive(request, weights),
                                          request.abort_all_requests, request.weight_version)

    async def destroy_weights_update_group(self, request: DestroyWeightsUpdateGroupRequest, context) -> ControlReply:
        return await self._in_group(lambda groups: groups.destroy(request.group_name))

    async def _in_group(self, call: Callable[[WeightGroups], str]) -> ControlReply:
        """A group call (blocking: a worker thread) answered with its message, or refused with why."""
        if self.weight_groups is None:
            return self._refused(SYNTHETIC_HAS_NO_WEIGHTS)
        try:
            message = await asyncio.get_running_loop().run_in_executor(self._group_calls, call, self.weight_groups)
        except WeightsRefused as exc:
            log.warning("weight update group call refused: %s", exc)
            return self._refused(str(exc))
        return ControlReply(success=True, message=message, weight_version=self.engine.weight_version)

    async def release_memory_occupation(self, request: ReleaseMemoryOccupationRequest, context) -> ControlReply:
        return await self._memory(lambda tags: ReleaseMemory(tags=tags, weights=request.weights), request.tags)

    async def resume_memory_occupation(self, request: ResumeMemoryOccupationRequest, context) -> ControlReply:
        return await self._memory(lambda tags: ResumeMemory(tags=tags), request.tags)

    async def _memory(self, command: Callable[[list[str]], Control], tags: list[str]) -> ControlReply:
        try:
            checked = MemoryOccupation.tags_of(tags)
        except WeightsRefused as exc:
            return self._refused(str(exc))
        return await self._control(command(checked))

    async def pause_generation(self, request: PauseGenerationRequest, context) -> ControlReply:
        return await self._control(Pause(mode=request.mode))

    async def continue_generation(self, request: ContinueGenerationRequest, context) -> ControlReply:
        return await self._control(Continue())

    async def abort_all(self, request: AbortAllRequest, context) -> ControlReply:
        return await self._control(AbortAll())

    async def flush_cache(self, request: FlushCacheRequest, context) -> ControlReply:
        return await self._control(FlushCache(reset_running_requests=request.reset_running_requests))

    async def update_weight_version(self, request: UpdateWeightVersionRequest, context) -> ControlReply:
        if not request.new_version:
            return self._refused("new_version: must not be empty")
        abort = True if request.abort_all_requests is None else request.abort_all_requests  # SGLang's default
        return await self._control(SetWeightVersion(version=request.new_version, abort_all_requests=abort))

    async def _update_weights(self, read: Callable[[ServedWeights], StagedWeights], abort_all_requests: bool,
                              version: str | None) -> ControlReply:
        """`read(weights)` (blocking: a worker thread) checks and stages the new weights; the engine swaps them in.
        A call whose client leaves after that still applies (SGLang's too)."""
        if self.weights is None:
            return self._refused(SYNTHETIC_HAS_NO_WEIGHTS)
        if version == "":  # as update_weight_version's new_version (None: the version stays)
            return self._refused("weight_version: must not be empty")
        async with self._updating:
            try:
                staged = await asyncio.to_thread(read, self.weights)
            except WeightsRefused as exc:
                log.warning("weight update refused: %s", exc)
                return self._refused(str(exc))
            if (session := self._session) is not None:
                return self._stage_in(session, staged, abort_all_requests, version)
            return await self._control(UpdateWeights(staged=staged, abort_all_requests=abort_all_requests,
                                                     weight_version=version))

    def _stage_in(self, session: WeightSession, staged: StagedWeights, abort_all_requests: bool,
                  version: str | None) -> ControlReply:
        assert self.weights is not None
        session.updates += 1
        session.abort_all_requests |= abort_all_requests
        session.weight_version = version if version is not None else session.weight_version
        if session.staged is not None:
            staged = self.weights.merged(session.staged, staged, "")
        staged.description = f"{len(staged.pairs)} tensors from {session.updates} updates of a weight-update session"
        session.staged = staged
        return self._reply(f"Staged: {len(staged.pairs)} tensors so far in this session; they apply at "
                           "end_weight_update.")

    def _weights_released(self) -> bool:
        """A disk or pushed update would be checked against released (empty) tensors; the engine refuses it
        anyway. (A broadcast is still received, so that the trainer's collective completes.)"""
        occupation = self.engine.rollout.occupation
        return occupation is not None and "weights" in occupation.released

    async def _control(self, command: Control) -> ControlReply:
        return await asyncio.wrap_future(self.engine.control(command))

    def _refused(self, message: str) -> ControlReply:
        """SGLang answers a refused control call with success false and the reason, not an error status."""
        return ControlReply(success=False, message=message, weight_version=self.engine.weight_version)

    def _reply(self, message: str) -> ControlReply:
        return ControlReply(success=True, message=message, weight_version=self.engine.weight_version)
