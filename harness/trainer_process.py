"""harness/trainer.py as a process, for the tests: rank 0 of a weight update group, broadcasting a checkpoint to
the servers that join it over HTTP."""

import json
import subprocess
import sys
from pathlib import Path

from harness.procs import free_port


class Trainer:
    """The trainer process, broadcasting `checkpoint` to `world_size - 1` server ranks."""

    def __init__(self, checkpoint: Path, world_size: int, *options: str, group: str = "weight_update_group"):
        self.port, self.group, self.world_size = free_port(), group, world_size
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.trainer", "--port", str(self.port),
                                      "--world-size", str(world_size), "--checkpoint", str(checkpoint),
                                      "--group-name", group, *options], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.tensors = json.loads(self.proc.stdout.readline())  # names, dtypes, shapes

    def join(self, http) -> dict:
        """The servers join at ranks 1 .. world_size - 1 (init_weights_update_group through the gateway)."""
        reply = http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1, "world_size": self.world_size,
            "group_name": self.group, "backend": "gloo"})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def wait(self) -> int:
        return self.proc.wait(timeout=120)
