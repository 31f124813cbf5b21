"""What rank 0 tells the other tensor-parallel ranks (ranks.py sends these, worker.py runs them).

On the step channel, in the engine thread's order: each step's rows (Forward), a weight update to swap in
(Install, with how each rank stages its part: RankUpdate), memory release and resume, and Stop. On the weights
channel, from the threads that serve a trainer's group calls: joining its group, receiving a broadcast, leaving;
each answered by every rank (a Done), so that rank 0 replies for all of them.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flatwire_wire.control import InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest, WeightsRelease

from services.scheduler.model.linear_attention import StateRows


@dataclass(frozen=True)
class Forward:
    """One step's rows (ModelRunner.forward): row i feeds positions [starts[i], ends[i]) whose KV lives in
    tables[g][i] (the pages its context reaches) in layer group g; `states`: a linear-attention model's state
    slots (every rank keeps the whole state: transformers' plans keep those layers whole)."""

    tables: list[list[np.ndarray]]  # the pages of each group, each row
    starts: np.ndarray
    ends: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    states: StateRows | None = None


# How a rank stages its part of a weight update (ServedWeights cuts each full tensor to the rank's part).
@dataclass(frozen=True)
class FromDisk:
    model_path: Path
    load_format: str


@dataclass(frozen=True)
class FromSafetensors:
    data: bytes


@dataclass(frozen=True)
class FromTensors:
    tensors: dict  # name -> a full tensor on the CPU


@dataclass(frozen=True)
class Received:
    """Tensors the rank received itself over the trainer's group (Receive with this id)."""

    update: int


RankUpdate = FromDisk | FromSafetensors | FromTensors | Received


@dataclass(frozen=True)
class Install:
    """Swap in one update: its parts staged in order, a later one's tensor replacing an earlier one's (a
    weight-update session's)."""

    parts: tuple[RankUpdate, ...]


@dataclass(frozen=True)
class Release:
    tags: tuple[str, ...]
    weights: WeightsRelease


@dataclass(frozen=True)
class Resume:
    tags: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class JoinGroup:
    request: InitWeightsUpdateGroupRequest  # rank_offset is rank 0's; rank r joins at rank_offset + r


@dataclass(frozen=True)
class Receive:
    update: int
    request: UpdateWeightsFromDistributedRequest


@dataclass(frozen=True)
class LeaveGroup:
    group_name: str


@dataclass(frozen=True)
class Done:
    """A rank's answer to a weights-channel call: None, or why it failed there."""

    rank: int
    error: str | None = None


StepCall = Forward | Install | Release | Resume | Stop
WeightsCall = JoinGroup | Receive | LeaveGroup
