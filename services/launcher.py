"""`flatwire up`: scheduler, detokenizer and gateway as processes on loopback.

Builds (or finds) the model first, starts the three services, waits until the
gateway's /health is 200, prints where to connect, and stops all three on Ctrl-C
or as soon as one of them exits.
"""

import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from services.common.config import option, parse_config
from services.common.model_store import resolve_model
from services.common.rpc import check_health


@dataclass
class UpConfig:
    """flatwire up: run the whole pipeline on this machine."""

    model: str | None = option(None, "local Hugging Face checkpoint; default: the embedded default model")
    cache_dir: str | None = option(None, "where the default model is built (default ~/.cache/flatwire)")
    host: str = option("127.0.0.1", "address the gateway listens on")
    port: int = option(30000, "gateway HTTP port")
    grpc_port: int = option(30001, "gateway public gRPC port")
    scheduler_port: int = option(30010, "scheduler port (loopback)")
    detokenizer_port: int = option(30020, "detokenizer port (loopback)")
    device: str = option("auto", "scheduler device: auto, cpu or cuda")
    startup_timeout_s: float = option(600.0, "give up if the pipeline is not healthy by then")


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
    model = str(resolve_model(config.model, config.cache_dir))
    scheduler = f"127.0.0.1:{config.scheduler_port}"
    detokenizer = f"127.0.0.1:{config.detokenizer_port}"
    common = ["--model", model]
    commands = {
        "scheduler": ["--port", str(config.scheduler_port), "--device", config.device, *common],
        "detokenizer": ["--port", str(config.detokenizer_port), "--schedulers", scheduler, *common],
        "gateway": ["--host", config.host, "--port", str(config.port), "--grpc-port", str(config.grpc_port),
                    "--schedulers", scheduler, "--detokenizers", detokenizer, *common],
    }
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + config.startup_timeout_s
    http = f"http://{'127.0.0.1' if config.host == '0.0.0.0' else config.host}:{config.port}"
    try:
        for name, args in commands.items():
            # The services handle SIGINT themselves; the launcher forwards it.
            procs.append(subprocess.Popen([sys.executable, "-m", "services", name, *args],
                                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)))
        _wait(lambda: check_health(scheduler), "the scheduler", procs, deadline)
        _wait(lambda: check_health(detokenizer), "the detokenizer", procs, deadline)
        _wait(lambda: _http_ok(f"{http}/health"), "the gateway", procs, deadline)
        print(f"\nflatwire is up (model {model})\n"
              f"  HTTP  {http}  (POST /generate, /v1/chat/completions, /v1/completions; GET /v1/models, /metrics)\n"
              f"  gRPC  {config.host}:{config.grpc_port}  (flatwire.v1.Generation)\n"
              f"  Ctrl-C stops all three.\n", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("a service exited; stopping the others", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
