"""`flatwire up` as a child process: the launcher's topology (one process starting and supervising the three
services, with an internal secret of its own), which harness.stack.Stack does not build."""

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harness.procs import ROOT, free_port


class Launcher:
    """`flatwire up` on free public ports (its internal ports left to it), its output in a log file.

    `model` None: the default model; `env` None: this process's environment (else the whole environment).
    `ports` holds "port" and "grpc-port", and once wait_up() has seen it up, "scheduler-port" and
    "detokenizer-port".
    """

    def __init__(self, log_path: Path, model: str | Path | None = None, options: Sequence[str] = (),
                 env: dict[str, str] | None = None):
        self.log_path = log_path
        self.ports = {name: free_port() for name in ("port", "grpc-port")}
        args = [f"--{name}={port}" for name, port in self.ports.items()]
        model_args = [] if model is None else ["--model", str(model)]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services", "up", *model_args, *args, *options],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['port']}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc-port']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_up(self, timeout: float = 240) -> None:
        """Until it has printed that it is up (its gateway's /health is 200 then); adds the internal ports its
        services listen on to `ports`. Killed, and RuntimeError, if it exits or times out first."""
        deadline = time.monotonic() + timeout
        while "flatwire is up" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"flatwire up did not come up:\n{self.log()}")
            time.sleep(0.5)
        for service in ("scheduler", "detokenizer"):
            argv = self.child_argv(service)
            if argv is None:
                raise RuntimeError(f"flatwire up runs no {service}")
            self.ports[f"{service}-port"] = int(argv[argv.index("--port") + 1])

    def child_pid(self, service: str) -> int | None:
        """The pid of its (first) child running `python -m services <service>`."""
        return next(iter(self.children(service)), None)

    def children(self, service: str) -> list[int]:
        """The pids of its children running `python -m services <service>`, from /proc (no psutil here)."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit() or f"PPid:\t{self.proc.pid}\n" not in (entry / "status").read_text():
                    continue
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # the process went away while we looked
                continue
            if argv[2:4] == [b"services", service.encode()]:
                found.append(int(entry.name))
        return sorted(found)

    def child_argv(self, service: str) -> list[str] | None:
        """The command line of its child running `python -m services <service>`."""
        pid = self.child_pid(service)
        return None if pid is None else (Path("/proc") / str(pid) / "cmdline").read_text().split("\0")

    def stop(self, timeout: float = 30) -> int:
        """Ctrl-C (SIGINT: it stops its services); its exit status. Killed, and TimeoutExpired, past `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
