"""The tensor-parallel ranks of one scheduler (--tp-size N). Rank 0 is the scheduler service's process: the gRPC
service, the scheduling policy, the prefix cache, sampling and the output path. It spawns ranks 1..N-1, one
process each (torch.multiprocessing, worker.py), which hold their shard of the model (sharding.py) and run what rank
0 tells them (group.py).

The ranks are one unit: a rank that exits takes the scheduler down (rank 0 watches the others' processes, the others
watch rank 0), and `flatwire up`, compose or Kubernetes restart the scheduler, ranks and all.
"""

import logging
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time

import torch.multiprocessing

from services.scheduler.parallel.calls import Stop
from services.scheduler.parallel.group import RankGroup, RankSetup, rank_device
from services.scheduler.parallel.worker import main as rank_main

log = logging.getLogger(__name__)
STOP_WAIT_S = 10.0


class Ranks:
    """Rank 0's handle on the other ranks: starts them, watches them, stops them."""

    def __init__(self, processes: list, group: RankGroup):
        self.processes = processes
        self.group = group
        self._stopping = False
        threading.Thread(target=self._watch, name="tp-ranks", daemon=True).start()

    @classmethod
    def start(cls, size: int, runner: dict, log_level: str, weights_sync_timeout_s: float) -> "Ranks":
        """Spawn ranks 1..size-1 and join them as rank 0 (returns once every rank joined)."""
        device = rank_device(runner["device"], 0)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        with socket.socket() as probe:  # a free port for the rendezvous
            probe.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{probe.getsockname()[1]}"
        context = torch.multiprocessing.get_context("spawn")
        processes = []
        for rank in range(1, size):
            setup = RankSetup(rank, size, address, backend, runner, log_level, weights_sync_timeout_s)
            pickle.dumps(setup)  # what cannot travel fails here, named, rather than in the child
            process = context.Process(target=rank_main, args=(setup,), name=f"tp-rank-{rank}", daemon=True)
            process.start()
            processes.append(process)
        log.info("tensor parallelism: %d ranks over %s, ranks 1-%d spawned", size, backend, size - 1)
        return cls(processes, RankGroup(0, size, address, backend, device))

    def _watch(self) -> None:
        sentinels = {process.sentinel: process for process in self.processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        process = sentinels[ready[0]]  # type: ignore[index]
        process.join()
        log.error("tensor-parallel %s exited (code %s): the scheduler stops with it, as one unit", process.name,
                  process.exitcode)
        logging.shutdown()
        os._exit(1)

    def stop(self) -> None:
        """After the engine stopped: the other ranks stop too."""
        self._stopping = True
        try:
            self.group.tell(Stop())
        except RuntimeError:  # a rank already gone
            pass
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
