"""`flatwire replica`: a scheduler and a detokenizer that follows it alone, run and stopped together.

Docker compose's `scheduler` service runs this, so that `--scale scheduler=N` scales the pairs, as the
Kubernetes manifests' scheduler pod does with two containers (docs/deployment.md): every scheduler's steps
are decoded once, by its own detokenizer. Both services are child processes with this process's
environment (the model, the internal secret, ...) plus their own port. The detokenizer follows the scheduler
at the address other containers reach this one by (what the gateway resolves the service name to), since a
gateway sends a scheduler requests only once a detokenizer says it follows that very address. When either
child exits, the other is stopped and this process exits with the child's code, for the container's restart
policy to restart the pair; SIGTERM or SIGINT stops both.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from services.common.config import option, parse_config

STOP_WAIT_S = 30.0  # a child still running this long after SIGTERM is killed


@dataclass
class ReplicaConfig:
    """flatwire replica: a scheduler and the detokenizer that follows it (other options: the services' own
    FLATWIRE_* variables, which both children read)."""

    host: str = option("0.0.0.0", "address both services listen on")
    scheduler_port: int = option(30010, "the scheduler's port")
    detokenizer_port: int = option(30020, "the detokenizer's port")
    advertise_host: str | None = option(None, "the address other containers reach this one by; default: --host, "
                                        "or the address this host's name resolves to when --host is 0.0.0.0")

    @property
    def followed_scheduler(self) -> str:
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{self.scheduler_port}"


def _start(command: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services", command], env={**os.environ, **env})


def _stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    config = parse_config(ReplicaConfig, argv, prog)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    children = {
        "scheduler": _start("scheduler", {"FLATWIRE_HOST": config.host, "FLATWIRE_PORT": str(config.scheduler_port)}),
        "detokenizer": _start("detokenizer", {"FLATWIRE_HOST": config.host,
                                              "FLATWIRE_PORT": str(config.detokenizer_port),
                                              "FLATWIRE_SCHEDULERS": config.followed_scheduler}),
    }
    while not stopping:
        exited = next((name for name, child in children.items() if child.poll() is not None), None)
        if exited is not None:
            code = children[exited].returncode
            print(f"flatwire replica: {exited} exited with code {code}; stopping the other", file=sys.stderr,
                  flush=True)
            _stop(list(children.values()))
            sys.exit(code or 1)
        time.sleep(0.2)
    _stop(list(children.values()))
