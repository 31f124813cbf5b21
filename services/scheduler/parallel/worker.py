"""A tensor-parallel rank besides rank 0 (ranks.py spawns it): its shard of the model (rank 0's ModelRunner, cut by
sharding.py), its own KV pages at the page ids rank 0's KV manager hands out, and its own copy of the weights'
state (updates, memory release). It runs what rank 0 tells it (calls.py) and nothing else: no service, no
scheduling, no sampling. A call that fails here ends the process, and with it the scheduler (ranks.py): a rank whose
weights or memory differ from rank 0's must not go on computing.
"""

import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path

from services.common.logs import setup_logging
from services.common.signals import exit_now
from services.scheduler.model.occupation import MemoryOccupation
from services.scheduler.model.runner import ModelRunner
from services.scheduler.model.weight_sync import WeightGroups
from services.scheduler.model.weights import ServedWeights, StagedWeights, WeightsRefused
from services.scheduler.parallel.calls import (
    Done,
    Forward,
    FromDisk,
    FromSafetensors,
    FromTensors,
    Install,
    JoinGroup,
    LeaveGroup,
    RankUpdate,
    Receive,
    Release,
    Resume,
    Stop,
)
from services.scheduler.parallel.group import RankGroup, RankSetup, rank_device

log = logging.getLogger(__name__)
PARENT_POLL_S = 1.0


class Worker:
    def __init__(self, runner: ModelRunner, group: RankGroup, model_dir: Path, from_disk: bool,
                 weights_sync_timeout_s: float):
        self.runner = runner
        self.group = group
        assert runner.sharding is not None
        self.weights = ServedWeights(runner.model, model_dir, runner.eos_token_ids, runner.sharding)
        self.occupation = MemoryOccupation(runner.kv, self.weights, runner.device, model_dir if from_disk else None)
        self.weight_groups = WeightGroups(runner.device, weights_sync_timeout_s)
        self.received: dict[int, StagedWeights] = {}  # by update id: what a Receive staged, until installed
        self._received_lock = threading.Lock()

    def serve_steps(self) -> None:
        while True:
            call = self.group.next_step_call()
            if isinstance(call, Forward):
                self.runner.forward_rows(call)
            elif isinstance(call, Install):
                self._install(call.parts)
            elif isinstance(call, Release):
                self.occupation.release(list(call.tags), call.weights)
                self.runner.memory_moved()
            elif isinstance(call, Resume):
                self.occupation.resume(list(call.tags))
                self.runner.memory_moved()
            elif isinstance(call, Stop):
                return
            else:
                raise TypeError(f"not a step call: {call!r}")

    def _install(self, parts: tuple[RankUpdate, ...]) -> None:
        staged: StagedWeights | None = None
        for part in parts:
            mine = self._stage(part)
            staged = mine if staged is None else self.weights.merged(staged, mine, mine.description)
        if staged is None:
            return
        staged.install()
        self.runner.memory_moved()
        self.occupation.updated(staged)

    def _stage(self, part: RankUpdate) -> StagedWeights:
        if isinstance(part, FromDisk):
            return self.weights.read_checkpoint(str(part.model_path), part.load_format)
        if isinstance(part, FromSafetensors):
            return self.weights.read_safetensors(part.data)
        if isinstance(part, FromTensors):
            return self.weights.stage_copies(part.tensors, f"{len(part.tensors)} tensors from rank 0")
        with self._received_lock:  # a Received: ours, and any older one rank 0 refused, let go
            staged = self.received.pop(part.update)
            for update in [update for update in self.received if update < part.update]:
                del self.received[update]
        return staged

    def serve_weights(self) -> None:
        """The weights channel's calls, each answered (its own thread: a receive waits for the trainer)."""
        while True:
            call = self.group.next_weights_call()
            error = None
            try:
                if isinstance(call, JoinGroup):
                    request = dataclasses.replace(call.request, rank_offset=call.request.rank_offset + self.group.rank)
                    self.weight_groups.init(request)
                elif isinstance(call, Receive):
                    staged = self.weight_groups.receive(call.request, self.weights)
                    with self._received_lock:
                        self.received[call.update] = staged
                elif isinstance(call, LeaveGroup):
                    self.weight_groups.destroy(call.group_name)
            except WeightsRefused as exc:
                error = str(exc)
            self.group.answer(Done(self.group.rank, error))


def _watch_parent(parent: int) -> None:
    """Rank 0 gone (killed without a word): this rank goes too."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main(setup: RankSetup) -> None:
    # Ctrl-C and a stop reach the whole process group: rank 0 stops this rank, in order (ranks.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(setup.log_level, f"scheduler-rank-{setup.rank}")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        arguments = {**setup.runner, "device": rank_device(setup.runner["device"], setup.rank),
                     "routed_experts": False}  # rank 0 records them
        group = RankGroup(setup.rank, setup.size, setup.address, setup.backend, arguments["device"])
        runner = ModelRunner(**arguments, ranks=group)
        worker = Worker(runner, group, Path(arguments["model_dir"]), arguments.get("load_format") != "dummy",
                        setup.weights_sync_timeout_s)
        threading.Thread(target=worker.serve_weights, name="tp-weights", daemon=True).start()
        worker.serve_steps()
    except Exception:
        log.exception("tensor-parallel rank %d failed", setup.rank)
        exit_now(1)
    exit_now(0)
