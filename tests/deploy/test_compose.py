"""docker-compose.yml: valid, deployable as declared, and runnable as local processes.

No Docker engine here: `docker-compose config` validates the file, and each service's
declared command and environment are started as processes on loopback (compose
hostnames -> 127.0.0.1, declared ports -> free ones), in depends_on order, each
waited on with its own declared healthcheck. `--scale scheduler=2` is two scheduler
processes, the name `scheduler` standing for both addresses (what its DNS name resolves
to). Under load, the detokenizer is killed and started again with its own command, as
the restart policy does: every request still completes, with the undisturbed run's output.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from graphlib import TopologicalSorter
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
import yaml
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER, SchedulerStats

from harness.procs import ROOT, ServiceProcess, free_port
from services.common.auth import SECRET_METADATA
from services.common.config import env_name
from services.detokenizer.config import DetokenizerConfig
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig

pytestmark = pytest.mark.slow  # runs services as processes of its own

COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
TLS_OVERRIDE = ROOT / "docker-compose.tls.yml"
CONFIGS = {"scheduler": SchedulerConfig, "detokenizer": DetokenizerConfig, "gateway": GatewayConfig}
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "0.0.0.0"}
HEALTH_WAIT_S = 180.0
SCALE = {"scheduler": 2}  # `docker compose up --scale scheduler=2`
DETOKENIZER_RESTART_S = 2.0  # a detokenizer's start on this 2-core machine (about 1.1 s idle)
REQUESTS = 24  # in flight at once, every other one streaming
TOKENS = 96


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set: the default."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


@pytest.fixture(scope="module")
def services() -> dict:
    return load(COMPOSE)["services"]


def test_docker_compose_config_validates():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose binary not installed (Debian: apt-get install docker-compose)")
    for files in (["-f", "docker-compose.yml"], ["-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml"],
                  ["-f", "docker-compose.yml", "-f", "docker-compose.tls.yml"]):
        result = subprocess.run(["docker-compose", *files, "config"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        merged = yaml.safe_load(result.stdout)
        assert set(merged["services"]) == set(CONFIGS)


def test_deployment_rules(services):
    assert set(services) == set(CONFIGS)
    for name, service in services.items():
        assert ("ports" in service) == (name == "gateway"), f"{name}: only the gateway publishes ports"
        assert service["command"] == ["flatwire", name], name
        assert service["restart"] in ("unless-stopped", "on-failure"), name
        port = service["environment"]["FLATWIRE_PORT"]
        expected = ["grpc", f"127.0.0.1:{port}"] if name != "gateway" else ["http", f"http://127.0.0.1:{port}/health"]
        assert service["healthcheck"]["test"] == ["CMD", "flatwire", "health", *expected], name
        # Configured only through variables its own config reads.
        known = {env_name(field) for field in CONFIGS[name].__dataclass_fields__}
        assert set(service["environment"]) <= known, f"{name}: unknown {set(service['environment']) - known}"
    # The gateway waits for a healthy path; the detokenizer may start with the scheduler (it connects when it can).
    assert services["gateway"]["depends_on"] == {name: {"condition": "service_healthy"}
                                                 for name in ("scheduler", "detokenizer")}
    assert services["detokenizer"]["depends_on"] == {"scheduler": {"condition": "service_started"}}
    # `--scale scheduler=N` needs no fixed name and no host port.
    assert "container_name" not in services["scheduler"] and "ports" not in services["scheduler"]
    # The detokenizer and the gateway reach every scheduler replica by the service name, which resolves to all.
    env = {name: service["environment"] for name, service in services.items()}
    scheduler = f"scheduler:{env['scheduler']['FLATWIRE_PORT']}"
    assert env["detokenizer"]["FLATWIRE_SCHEDULERS"] == env["gateway"]["FLATWIRE_SCHEDULERS"] == scheduler
    assert env["gateway"]["FLATWIRE_DETOKENIZERS"] == f"detokenizer:{env['detokenizer']['FLATWIRE_PORT']}"
    # A detokenizer restart is within the gateway's hop timeout, and what it missed within the replay window.
    hop_timeout_s = float(env["gateway"].get("FLATWIRE_HOP_TIMEOUT_S", GatewayConfig.hop_timeout_s))
    replay_window_s = float(env["scheduler"].get("FLATWIRE_REPLAY_WINDOW_S", SchedulerConfig.replay_window_s))
    assert 2 * DETOKENIZER_RESTART_S < hop_timeout_s < replay_window_s
    # One internal secret for all three: from one variable, else one file on a volume all of them mount.
    secret_file = env["scheduler"]["FLATWIRE_INTERNAL_SECRET_FILE"]
    for name, service in services.items():
        assert service["environment"]["FLATWIRE_INTERNAL_SECRET"] == "${FLATWIRE_INTERNAL_SECRET:-}", name
        assert service["environment"]["FLATWIRE_INTERNAL_SECRET_FILE"] == secret_file, name
        assert any(volume.split(":")[1] == str(Path(secret_file).parent) for volume in service["volumes"]), name
    assert env["gateway"]["FLATWIRE_API_KEY"] == "${API_KEY:-}"


def test_gpu_override_reserves_a_gpu_for_the_scheduler(services):
    override = load(GPU_OVERRIDE)["services"]
    assert set(override) == {"scheduler"}
    devices = override["scheduler"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    # --tp-size N takes N GPUs: the reservation follows the variable the scheduler reads.
    assert [device["count"] for device in devices] == ["${FLATWIRE_TP_SIZE:-1}"]
    assert override["scheduler"]["environment"]["FLATWIRE_TP_SIZE"] == "${FLATWIRE_TP_SIZE:-1}"
    # Its own CUDA image: the base file's CPU image must not be overwritten by (or run) it.
    assert override["scheduler"]["build"]["args"]["TORCH_VARIANT"] == "cuda"
    assert override["scheduler"]["image"] != services["scheduler"]["image"]
    assert "deploy" not in services["scheduler"], "the base file must run on a CPU host"


def test_tls_override_turns_tls_on_for_every_service(services):
    override = load(TLS_OVERRIDE)["services"]
    assert set(override) == set(CONFIGS)
    for name, service in override.items():
        env = service["environment"]
        assert set(env) == {env_name(f) for f in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")}, name
        mounted = {interpolate(volume).split(":")[1] for volume in service["volumes"]}
        assert all(str(Path(path).parent) in mounted for path in env.values()), name
    # The gateway's healthcheck speaks HTTPS, checked against the CA the variables name.
    assert override["gateway"]["healthcheck"]["test"] == ["CMD", "flatwire", "health", "http",
                                                          "https://127.0.0.1:30000/health"]


class LocalCompose:
    """Compose addresses rewritten for processes sharing one loopback, each service's replicas on ports of their
    own."""

    def __init__(self, services: dict, model_dir: Path, volume_dir: Path, scale: dict[str, int]):
        self.services = services
        self.model_dir = model_dir
        self.volume_dir = volume_dir  # stands for the volumes other than the models'
        self.replicas = {name: scale.get(name, 1) for name in services}
        self.ports: dict[tuple[str, int, int], int] = {}  # (service, replica, declared port) -> local port
        for name, service in services.items():
            for key, value in service["environment"].items():
                if key.endswith("PORT"):
                    for replica in range(self.replicas[name]):
                        self.ports[name, replica, int(value)] = free_port()

    def address(self, text: str, service: str, replica: int) -> str:
        """host:port in a value -> 127.0.0.1:local port: a loopback host is this replica, a service name stands
        for each of its replicas (comma-separated, as the name resolves to all of them)."""
        def local(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in LOOPBACK_NAMES:
                return f"127.0.0.1:{self.ports[service, replica, port]}"
            assert host in self.services, f"{service}: {host} is neither a service nor loopback"
            return ",".join(f"127.0.0.1:{self.ports[host, other, port]}" for other in range(self.replicas[host]))
        return re.sub(r"([\w.-]+):(\d+)", local, text)

    def environment(self, service: str, replica: int) -> dict[str, str]:
        env = {}
        for key, raw in self.services[service]["environment"].items():
            value = interpolate(str(raw))
            if key.endswith("PORT"):
                value = str(self.ports[service, replica, int(value)])
            elif key == "FLATWIRE_HOST":
                value = "127.0.0.1"
            elif key == "FLATWIRE_MODEL":
                value = value or str(self.model_dir)
            elif key == "FLATWIRE_CACHE_DIR":
                value = str(self.model_dir.parent)
            elif key == "FLATWIRE_INTERNAL_SECRET_FILE":
                value = str(self.volume_dir / Path(value).name)
            else:
                value = self.address(value, service, replica)
            env[key] = value
        return env

    def healthcheck(self, service: str, replica: int) -> list[str]:
        kind, program, *args = self.services[service]["healthcheck"]["test"]
        assert kind == "CMD" and program == "flatwire", f"{service}: healthcheck {kind} {program}"
        return [sys.executable, "-m", "services", *(self.address(arg, service, replica) for arg in args)]

    def start_order(self) -> list[str]:
        graph = {name: set(service.get("depends_on", {})) for name, service in self.services.items()}
        return list(TopologicalSorter(graph).static_order())

    def local_port(self, service: str, replica: int = 0, key: str = "FLATWIRE_PORT") -> int:
        return self.ports[service, replica, int(self.services[service]["environment"][key])]


class Deployment:
    """The compose services running as processes: one per replica, each startable again with its command."""

    def __init__(self, compose: LocalCompose, log_dir: Path):
        self.compose = compose
        self.log_dir = log_dir
        self.procs: dict[tuple[str, int], ServiceProcess] = {}

    def start(self, service: str, replica: int = 0) -> None:
        program, command, *args = self.compose.services[service]["command"]
        assert program == "flatwire" and command == service
        self.procs[service, replica] = ServiceProcess(command, args, self.log_dir,
                                                      self.compose.environment(service, replica))

    def wait_healthy(self, service: str) -> None:
        for replica in range(self.compose.replicas[service]):
            proc, check = self.procs[service, replica], self.compose.healthcheck(service, replica)
            deadline = time.monotonic() + HEALTH_WAIT_S
            while subprocess.run(check, cwd=ROOT, capture_output=True, timeout=30).returncode != 0:
                assert proc.proc.poll() is None, f"{service} exited:\n{proc.log()[-4000:]}"
                assert time.monotonic() < deadline, f"{service} unhealthy after {HEALTH_WAIT_S}s:\n{proc.log()[-4000:]}"
                time.sleep(0.5)

    def up(self) -> None:
        """As `docker compose up`: each service once its service_healthy dependencies are healthy."""
        healthy: set[str] = set()
        for service in self.compose.start_order():
            for dependency, rule in self.compose.services[service].get("depends_on", {}).items():
                if rule["condition"] == "service_healthy" and dependency not in healthy:
                    self.wait_healthy(dependency)
                    healthy.add(dependency)
            for replica in range(self.compose.replicas[service]):
                self.start(service, replica)
        for service in self.compose.services.keys() - healthy:
            self.wait_healthy(service)

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            proc.stop()


@pytest.fixture(scope="module")
def deployment(services, model_dir, log_dir, tmp_path_factory) -> Iterator[Deployment]:
    with pytest.MonkeyPatch.context() as env:
        # Only the declared environment may configure the services: none of this shell's FLATWIRE_*.
        for key in [key for key in os.environ if key.startswith("FLATWIRE_")]:
            env.delenv(key)
        running = Deployment(LocalCompose(services, model_dir, tmp_path_factory.mktemp("volume"), SCALE), log_dir)
        try:
            running.up()
            yield running
        finally:
            running.stop()


def scheduler_stats(deployment: Deployment) -> list[SchedulerStats]:
    secret = (deployment.compose.volume_dir / "internal-secret").read_text().strip()
    stats = []
    for replica in range(deployment.compose.replicas["scheduler"]):
        with grpc.insecure_channel(f"127.0.0.1:{deployment.compose.local_port('scheduler', replica)}") as channel:
            stub = SCHEDULER.calls(channel)
            stats.append(stub["GetStats"](EMPTY, timeout=10,
                                       metadata=[(SECRET_METADATA, secret)]))
    return stats


def test_declared_services_serve_generate(deployment):
    reply = httpx.post(f"http://127.0.0.1:{deployment.compose.local_port('gateway')}/generate", timeout=60,
                       json={"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["completion_tokens"] == 4
    # With no FLATWIRE_INTERNAL_SECRET, the first service generated one that all of them use.
    with grpc.insecure_channel(f"127.0.0.1:{deployment.compose.local_port('scheduler')}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            SCHEDULER.calls(channel)["GetStats"](EMPTY, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(scheduler_stats(deployment)) == SCALE["scheduler"]


def generate(url: str, i: int, streaming: threading.Event) -> tuple[str, list[int], dict]:
    """Request i's text, output ids and finish_reason; every other request streams (and sets `streaming` once it
    has tokens)."""
    body = {"text": f"request {i}: once upon a time", "stream": i % 2 == 1,
            "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}}
    if not body["stream"]:
        reply = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        result = reply.json()
    else:
        result = {}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    result = orjson.loads(line[6:])  # cumulative: the last event has the whole output
                    assert "error" not in result, result
                    if len(result["output_ids"]) >= 8:
                        streaming.set()
    assert result["meta_info"]["completion_tokens"] == TOKENS
    return result["text"], result["output_ids"], result["meta_info"]["finish_reason"]


def run_load(url: str, during=None) -> list[tuple[str, list[int], dict]]:
    """REQUESTS at once; `during()` runs once a stream has tokens, while they are all in flight."""
    streaming = threading.Event()
    with ThreadPoolExecutor(REQUESTS) as pool:
        results = [pool.submit(generate, url, i, streaming) for i in range(REQUESTS)]
        if during is not None:
            assert streaming.wait(60), "no stream got tokens"
            assert not any(result.done() for result in results), "the load ended before the fault"
            during()
        return [result.result() for result in results]


def test_a_detokenizer_killed_under_load_loses_nothing(deployment):
    """kill -9 of the detokenizer mid-load, then its restart (as the restart policy does): the scheduler replays
    what the new one missed, and every request of both schedulers completes with its undisturbed output."""
    url = f"http://127.0.0.1:{deployment.compose.local_port('gateway')}"
    finished_before = [stats.finished for stats in scheduler_stats(deployment)]
    reference = run_load(url)
    restarted = []

    def kill_and_restart() -> None:
        os.kill(deployment.procs["detokenizer", 0].proc.pid, signal.SIGKILL)
        deployment.procs["detokenizer", 0].stop()  # reaps it
        started = time.monotonic()
        deployment.start("detokenizer")
        deployment.wait_healthy("detokenizer")
        restarted.append(time.monotonic() - started)

    assert run_load(url, kill_and_restart) == reference
    assert all(reason["type"] == "length" for _, _, reason in reference)
    print(f"\ndetokenizer back after {restarted[0]:.1f}s")
    # Both schedulers took requests of each run, and every one of them was decoded.
    finished = [stats.finished - before for stats, before in zip(scheduler_stats(deployment), finished_before)]
    assert sum(finished) == 2 * REQUESTS and all(finished), finished
