"""Rollout-control commands for the engine thread (RL trainers): pause, continue, abort_all, weight updates,
weight_version relabelling, flushing the prefix cache, releasing and resuming the model's memory, checking the
weights, loading and unloading LoRA adapters (engine/lora_registry.py applies those two). They join the engine's
inbox with new requests and aborts, so that the engine thread alone decides when each applies: always between two
steps (engine.py says how)."""

import concurrent.futures
from dataclasses import dataclass, field

from flatwire_wire.control import ControlReply, PauseMode, WeightsRelease

from services.scheduler.model.lora_adapter import LoraAdapter
from services.scheduler.model.weights import StagedWeights

ABORTING_PAUSES = (PauseMode.UNSPECIFIED, PauseMode.ABORT)
WEIGHTS_RELEASED = "Weights not updated: they are released; resume_memory_occupation first."


@dataclass(kw_only=True)
class Control:
    """A command; `done` gets its ControlReply once the engine thread applied it (or refused it)."""

    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(kw_only=True)
class Pause(Control):
    mode: PauseMode


@dataclass(kw_only=True)
class Continue(Control):
    pass


@dataclass(kw_only=True)
class AbortAll(Control):
    pass


@dataclass(kw_only=True)
class UpdateWeights(Control):
    staged: StagedWeights  # checked and staged off the engine thread; the engine swaps them in
    abort_all_requests: bool
    weight_version: str | None  # None: the version stays
    aborted_requests: int = 0


@dataclass(kw_only=True)
class FlushCache(Control):
    """None: SGLang's flush_cache (refused while requests run or wait); a bool: vLLM's reset_prefix_cache (refused
    while requests run, unless true: they are retracted first)."""

    reset_running_requests: bool | None = None


@dataclass(kw_only=True)
class ReleaseMemory(Control):
    tags: list[str]  # checked (MemoryOccupation.tags_of)
    weights: WeightsRelease = WeightsRelease.UNSPECIFIED


@dataclass(kw_only=True)
class ResumeMemory(Control):
    tags: list[str]


@dataclass(kw_only=True)
class CheckWeights(Control):
    action: str  # SGLang's weights_checker: snapshot, reset_tensors, compare
    skip: set[str]  # compare: names left out


@dataclass(kw_only=True)
class SetWeightVersion(Control):
    version: str
    abort_all_requests: bool


@dataclass(kw_only=True)
class LoadAdapter(Control):
    adapter: LoraAdapter  # read and checked off the engine thread
    replace: bool  # an adapter of its name is replaced (else the load is refused)


@dataclass(kw_only=True)
class UnloadAdapter(Control):
    name: str


def stopped_reply() -> ControlReply:
    return ControlReply(success=False, message="the scheduler is stopping: nothing was changed")
