"""`flatwire up`: scheduler, detokenizer and gateway as processes on loopback.

Builds, finds or downloads the model first, starts the three services (scheduler and detokenizer on free
loopback ports unless given, so that several launchers run side by side), waits until the
gateway's /health is 200, prints where to connect, then supervises them: a service
that exits is restarted with the same command after an exponential backoff
(--restart-delay-s doubling up to --restart-max-delay-s, back to the first delay once
the service has stayed up --restart-reset-s). A service that exits during startup
stops everything instead, since that is usually a setup error (port taken, bad model)
that a restart would not fix. Ctrl-C or SIGTERM stops all three.
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass

from services.common.config import option, parse_config
from services.common.model_store import model_name, resolve_model
from services.common.rpc import check_health


@dataclass
class UpConfig:
    """flatwire up: run the whole pipeline on this machine."""

    model: str | None = option(None, "local Hugging Face checkpoint directory, or a Hugging Face Hub model id "
                               "(Org/Name) from the Hugging Face cache or downloaded into it; default: the "
                               "embedded default model")
    cache_dir: str | None = option(None, "where the default model is built (default ~/.cache/flatwire)")
    host: str = option("127.0.0.1", "address the gateway listens on")
    port: int = option(30000, "gateway HTTP port")
    grpc_port: int = option(30001, "gateway public gRPC port")
    scheduler_port: int | None = option(None, "scheduler port (loopback); default: a free port, picked at start")
    detokenizer_port: int | None = option(None, "detokenizer port (loopback); default: a free port, picked at "
                                          "start")
    device: str = option("auto", "scheduler device: auto, cpu or cuda")
    api_key: str | None = option(None, "the gateway's API key (HTTP `Authorization: Bearer`, gRPC `authorization` "
                                 "metadata); default: none")
    admin_api_key: str | None = option(None, "the gateway's admin key: the only key that opens rollout control "
                                       "(weight updates, pause, abort_all); default: none (the API key opens it)")
    startup_timeout_s: float = option(600.0, "give up if the pipeline is not healthy by then")
    restart_delay_s: float = option(1.0, "wait before restarting a crashed service; doubles on each crash")
    restart_max_delay_s: float = option(30.0, "cap on the restart delay")
    restart_reset_s: float = option(60.0, "a service up this long gets the first restart delay again")


@dataclass
class Supervised:
    """One child service, restarted with exponential backoff when it exits."""

    name: str
    command: list[str]
    backoff_s: float
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while the service is down, waiting to be restarted

    def start(self) -> subprocess.Popen:
        # The services handle SIGINT themselves; the launcher forwards it.
        self.proc = subprocess.Popen(self.command, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        self.started_at = time.monotonic()
        self.restart_at = None
        return self.proc

    def supervise(self, config: UpConfig) -> None:
        """Schedule a restart if the service has exited; do it once the delay is over."""
        now = time.monotonic()
        assert self.proc is not None, "supervised before it was started"
        if self.restart_at is not None:
            if now >= self.restart_at:
                print(f"flatwire up: restarting {self.name}", file=sys.stderr, flush=True)
                self.start()
        elif self.proc.poll() is not None:
            if now - self.started_at >= config.restart_reset_s:
                self.backoff_s = config.restart_delay_s
            print(f"flatwire up: {self.name} exited with code {self.proc.returncode}; "
                  f"restarting it in {self.backoff_s:g} s", file=sys.stderr, flush=True)
            self.restart_at = now + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, config.restart_max_delay_s)


def internal_ports(config: UpConfig) -> tuple[int, int]:
    """The scheduler's and detokenizer's ports: as configured, else free loopback ports the kernel picks
    (both held until both are picked, so they differ)."""
    with ExitStack() as held:
        scheduler, detokenizer = (port if port is not None else _hold_free_port(held)
                                  for port in (config.scheduler_port, config.detokenizer_port))
    return scheduler, detokenizer


def _hold_free_port(held: ExitStack) -> int:
    sock = held.enter_context(socket.socket())
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _wait(check, what: str, procs: list[subprocess.Popen], deadline: float) -> None:
    while not check():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a service exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in time")
        time.sleep(0.25)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    config = parse_config(UpConfig, argv, prog)
    # Ctrl-C or `kill`: both stop the three services. Set explicitly, since a shell that starts
    # us in the background leaves SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    model_dir = resolve_model(config.model, config.cache_dir)
    # The services get --model as given, so that a Hub model keeps its id as its name, and resolve it offline:
    # from the cache it was just fetched into, the revision fetched here, never waiting on the Hub (restarts too).
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Passed in the environment (not in the command lines, which ps shows). The internal hops use a secret
    # of this run unless one is configured, so that no other local process can call the internal ports.
    if config.api_key:
        os.environ["FLATWIRE_API_KEY"] = config.api_key
    if config.admin_api_key:
        os.environ["FLATWIRE_ADMIN_API_KEY"] = config.admin_api_key
    if not (os.environ.get("FLATWIRE_INTERNAL_SECRET") or os.environ.get("FLATWIRE_INTERNAL_SECRET_FILE")):
        os.environ["FLATWIRE_INTERNAL_SECRET"] = secrets.token_urlsafe(32)
    scheduler_port, detokenizer_port = internal_ports(config)
    scheduler = f"127.0.0.1:{scheduler_port}"
    detokenizer = f"127.0.0.1:{detokenizer_port}"
    common = ["--model", config.model or str(model_dir)]
    commands = {
        "scheduler": ["--port", str(scheduler_port), "--device", config.device, *common],
        "detokenizer": ["--port", str(detokenizer_port), "--schedulers", scheduler, *common],
        "gateway": ["--host", config.host, "--port", str(config.port), "--grpc-port", str(config.grpc_port),
                    "--schedulers", scheduler, "--detokenizers", detokenizer, *common],
    }
    services = [Supervised(name, [sys.executable, "-m", "services", name, *args], config.restart_delay_s)
                for name, args in commands.items()]
    deadline = time.monotonic() + config.startup_timeout_s
    http = f"http://{'127.0.0.1' if config.host == '0.0.0.0' else config.host}:{config.port}"
    try:
        procs = [service.start() for service in services]
        _wait(lambda: check_health(scheduler), "the scheduler", procs, deadline)
        _wait(lambda: check_health(detokenizer), "the detokenizer", procs, deadline)
        _wait(lambda: _http_ok(f"{http}/health"), "the gateway", procs, deadline)
        print(f"\nflatwire is up (model {model_name(config.model, model_dir)} from {model_dir})\n"
              f"  HTTP  {http}  (POST /generate, /v1/chat/completions, /v1/completions; GET /v1/models, /metrics)\n"
              f"  gRPC  {config.host}:{config.grpc_port}  (flatwire.v1.Generation)\n"
              f"  Ctrl-C stops all three; a service that crashes is restarted.\n", flush=True)
        while True:
            for service in services:
                service.supervise(config)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        procs = [service.proc for service in services if service.proc is not None]
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
