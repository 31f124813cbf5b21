"""Start real flatwire services as processes on loopback (for the tests and the benchmarks)."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from services.common.rpc import check_health
from services.common.tls import TlsFiles

ROOT = Path(__file__).resolve().parent.parent


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, for a service to bind a moment later: from below the kernel's ephemeral range
    (ip_local_port_range), which the outgoing connections of the tests and the services take their ports from:
    one of those could take a port of that range in the meantime. None is handed out twice in a process, nor
    by two pytest-xdist workers (each picks from a slice of its own)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:  # not Linux
        low = 0
    ports = range(max(1024, low - 16384), low)
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    if worker:  # "gw0", "gw1", ...
        ports = ports[int(worker.removeprefix("gw"))::workers]
    for port in random.sample(ports, min(64, len(ports))):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # no free port found below the ephemeral range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceProcess:
    """`flatwire <command> ...` in a child process, its output in a log file."""

    def __init__(self, command: str, args: list[str], log_dir: Path, env: dict | None = None):
        self.command = command
        self.log_path = log_dir / f"{command}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        environ = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "services", command, *args],
                                     cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=environ)
        self._tls = TlsFiles.from_env(environ)  # its FLATWIRE_SSL_* if any

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, address: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if check_health(address, 1.0, self._tls.checking_channel(), self._tls.server_name):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.command} not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def tensor_parallel_ranks(scheduler_pid: int) -> list[int]:
    """The pids of a scheduler's spawned tensor-parallel ranks (--tp-size), not multiprocessing's resource tracker."""
    children = subprocess.run(["pgrep", "-P", str(scheduler_pid), "-f", "multiprocessing.spawn"],
                              capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in children if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]


def start_service(command: str, args: list[str], log_dir: Path, env: dict | None = None) -> tuple[ServiceProcess, str]:
    """`flatwire <command> --port P *args` on a free loopback port P (a scheduler or a detokenizer: the gateway
    serves HTTP there, harness.stack.Stack runs gateways), once its gRPC health answers SERVING: (process,
    "127.0.0.1:P"). A service that does not come up is stopped."""
    port = free_port()
    proc = ServiceProcess(command, ["--port", str(port), *args], log_dir, env)
    address = f"127.0.0.1:{port}"
    try:
        proc.wait_healthy(address)
    except BaseException:
        proc.stop()
        raise
    return proc, address
