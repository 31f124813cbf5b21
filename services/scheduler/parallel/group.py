"""This process's place among a scheduler's tensor-parallel ranks (ranks.py starts them): the torch.distributed
group of the model's all-reduces (NCCL on CUDA, gloo on CPU), and the two gloo channels through which rank 0 tells
the others what to run (calls.py): the step channel, written by the engine thread alone (each step's rows, weight
installs, memory release and resume), and the weights channel, by the threads that serve a trainer's group calls,
whose every call each rank answers.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from services.scheduler.model.weights import WeightsRefused
from services.scheduler.parallel.calls import Done, StepCall, WeightsCall

# The channels wait as long as the engine idles; the model's all-reduces, as long as a step may take.
CHANNEL_TIMEOUT = timedelta(days=365)
STEP_TIMEOUT = timedelta(minutes=30)
T = TypeVar("T")


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device of the scheduler's --device: its own GPU (cuda:N counts from N)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


@dataclass(frozen=True)
class RankSetup:
    """What a spawned rank needs to start (pickled to it)."""

    rank: int
    size: int
    address: str  # host:port of rank 0's rendezvous
    backend: str
    runner: dict  # ModelRunner's arguments, with rank 0's device
    log_level: str
    weights_sync_timeout_s: float


class RankGroup:
    """This process's place among the ranks, and the channels."""

    def __init__(self, rank: int, size: int, address: str, backend: str, device: str):
        """`device`: this rank's (rank_device's); on CUDA the process's current device, NCCL's."""
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                                timeout=STEP_TIMEOUT)
        self.rank, self.size = rank, size
        self.devices = dist.group.WORLD  # the model's all-reduces
        self._steps = dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)
        self._weights = dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)
        self._weights_lock = threading.Lock()  # one weights-channel exchange at a time (rank 0's threads)

    def agree_min(self, value: int) -> int:
        """The least of every rank's `value` (each rank's KV pages: the page tables are shared)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._steps)
        return int(tensor.item())

    # -- rank 0 ------------------------------------------------------------------------------------------

    def tell(self, call: StepCall) -> None:
        """Engine thread: every other rank runs `call` next."""
        dist.broadcast_object_list([call], src=0, group=self._steps)

    def ask(self, call: WeightsCall, own: Callable[[], T]) -> T:
        """Every other rank runs `call` while this one runs `own()`; own's result, once every rank has answered
        (its exception, if it raises; else WeightsRefused naming a rank where the call failed)."""
        with self._weights_lock:
            dist.broadcast_object_list([call], src=0, group=self._weights)
            answers: list = [None] * self.size
            try:
                result = own()
            finally:  # taken whatever own did, so that the channel stays in step
                dist.gather_object(Done(0), answers, dst=0, group=self._weights)
        failed = [answer for answer in answers[1:] if answer.error is not None]
        if failed:
            raise WeightsRefused("; ".join(f"tensor-parallel rank {answer.rank}: {answer.error}" for answer in failed))
        return result

    # -- the other ranks ---------------------------------------------------------------------------------

    def next_step_call(self) -> StepCall:
        received: list = [None]
        dist.broadcast_object_list(received, src=0, group=self._steps)
        return received[0]

    def next_weights_call(self) -> WeightsCall:
        received: list = [None]
        dist.broadcast_object_list(received, src=0, group=self._weights)
        return received[0]

    def answer(self, done: Done) -> None:
        dist.gather_object(done, None, dst=0, group=self._weights)


