"""docker-compose.yml: valid, deployable as declared, and runnable as local processes.

No Docker engine here: `docker-compose config` validates the file, and each service's
declared command and environment are started as processes on loopback (compose
hostnames -> 127.0.0.1, declared ports -> free ones), in depends_on order, each
waited on with its own declared healthcheck.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from graphlib import TopologicalSorter
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from services.common.auth import SECRET_METADATA
from services.common.config import env_name
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.detokenizer.config import DetokenizerConfig
from services.gateway.config import GatewayConfig
from services.replica import ReplicaConfig
from services.scheduler.config import SchedulerConfig
from tests.procs import ROOT, ServiceProcess, free_port

pytestmark = pytest.mark.slow  # runs services as processes of its own

COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "docker-compose.gpu.yml"
# Each compose service: its `flatwire` command, and the configs that read its environment (`flatwire replica`
# passes its own to the scheduler and the detokenizer it runs).
COMMANDS = {"scheduler": "replica", "gateway": "gateway"}
CONFIGS = {"scheduler": (ReplicaConfig, SchedulerConfig, DetokenizerConfig), "gateway": (GatewayConfig,)}
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "0.0.0.0"}
HEALTH_WAIT_S = 180.0


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
    for files in (["-f", "docker-compose.yml"], ["-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml"]):
        result = subprocess.run(["docker-compose", *files, "config"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        merged = yaml.safe_load(result.stdout)
        assert set(merged["services"]) == set(CONFIGS)


def test_deployment_rules(services):
    assert set(services) == set(CONFIGS)
    for name, service in services.items():
        assert ("ports" in service) == (name == "gateway"), f"{name}: only the gateway publishes ports"
        assert service["healthcheck"]["test"][:3] == ["CMD", "flatwire", "health"], name
        for dependency, rule in service.get("depends_on", {}).items():
            assert rule == {"condition": "service_healthy"}, f"{name} -> {dependency}"
        # Configured only through variables its own configs read.
        known = {env_name(field) for config in CONFIGS[name] for field in config.__dataclass_fields__}
        assert set(service["environment"]) <= known, f"{name}: unknown {set(service['environment']) - known}"
    # `--scale scheduler=N` needs no fixed name and no host port.
    assert "container_name" not in services["scheduler"] and "ports" not in services["scheduler"]
    # The gateway reaches every replica's scheduler and detokenizer by the service name, which resolves to all of
    # them; each replica's detokenizer follows its own scheduler (`flatwire replica`).
    gateway, replica = services["gateway"]["environment"], services["scheduler"]["environment"]
    assert gateway["FLATWIRE_SCHEDULERS"] == f"scheduler:{replica['FLATWIRE_SCHEDULER_PORT']}"
    assert gateway["FLATWIRE_DETOKENIZERS"] == f"scheduler:{replica['FLATWIRE_DETOKENIZER_PORT']}"
    assert "FLATWIRE_SCHEDULERS" not in replica
    # One internal secret for all three: from one variable, else one file on a volume all of them mount.
    secret_file = services["scheduler"]["environment"]["FLATWIRE_INTERNAL_SECRET_FILE"]
    for name, service in services.items():
        environment = service["environment"]
        assert environment["FLATWIRE_INTERNAL_SECRET"] == "${FLATWIRE_INTERNAL_SECRET:-}", name
        assert environment["FLATWIRE_INTERNAL_SECRET_FILE"] == secret_file, name
        assert any(volume.split(":")[1] == str(Path(secret_file).parent) for volume in service["volumes"]), name
    assert services["gateway"]["environment"]["FLATWIRE_API_KEY"] == "${API_KEY:-}"


def test_gpu_override_reserves_a_gpu_for_the_scheduler(services):
    override = load(GPU_OVERRIDE)["services"]
    assert set(override) == {"scheduler"}
    devices = override["scheduler"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    # Its own CUDA image: the base file's CPU image must not be overwritten by (or run) it.
    assert override["scheduler"]["build"]["args"]["TORCH_VARIANT"] == "cuda"
    assert override["scheduler"]["image"] != services["scheduler"]["image"]
    assert "deploy" not in services["scheduler"], "the base file must run on a CPU host"


class LocalCompose:
    """Compose addresses rewritten for processes sharing one loopback."""

    def __init__(self, services: dict, model_dir: Path, volume_dir: Path):
        self.services = services
        self.model_dir = model_dir
        self.volume_dir = volume_dir  # stands for the volumes other than the models'
        self.ports: dict[tuple[str, int], int] = {}  # (service, declared port) -> local port
        for name, service in services.items():
            for key, value in service["environment"].items():
                if key.endswith("PORT"):
                    self.ports[name, int(value)] = free_port()

    def address(self, text: str, service: str) -> str:
        """host:port in a value -> 127.0.0.1:local port (a loopback host means the service itself)."""
        def local(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            owner = service if host in LOOPBACK_NAMES else host
            assert owner in self.services, f"{service}: {host} is neither a service nor loopback"
            return f"127.0.0.1:{self.ports[owner, port]}"
        return re.sub(r"([\w.-]+):(\d+)", local, text)

    def environment(self, service: str) -> dict[str, str]:
        env = {}
        for key, raw in self.services[service]["environment"].items():
            value = interpolate(str(raw))
            if key.endswith("PORT"):
                value = str(self.ports[service, int(value)])
            elif key == "FLATWIRE_HOST":
                value = "127.0.0.1"
            elif key == "FLATWIRE_MODEL":
                value = value or str(self.model_dir)
            elif key == "FLATWIRE_CACHE_DIR":
                value = str(self.model_dir.parent)
            elif key == "FLATWIRE_INTERNAL_SECRET_FILE":
                value = str(self.volume_dir / Path(value).name)
            else:
                value = self.address(value, service)
            env[key] = value
        return env

    def healthcheck(self, service: str) -> list[str]:
        kind, program, *args = self.services[service]["healthcheck"]["test"]
        assert kind == "CMD" and program == "flatwire", f"{service}: healthcheck {kind} {program}"
        return [sys.executable, "-m", "services", *(self.address(arg, service) for arg in args)]

    def start_order(self) -> list[str]:
        graph = {name: set(service.get("depends_on", {})) for name, service in self.services.items()}
        return list(TopologicalSorter(graph).static_order())


def wait_healthy(proc: ServiceProcess, check: list[str]) -> None:
    deadline = time.monotonic() + HEALTH_WAIT_S
    while subprocess.run(check, cwd=ROOT, capture_output=True, timeout=30).returncode != 0:
        assert proc.proc.poll() is None, f"{proc.command} exited:\n{proc.log()[-4000:]}"
        assert time.monotonic() < deadline, f"{proc.command} unhealthy after {HEALTH_WAIT_S}s:\n{proc.log()[-4000:]}"
        time.sleep(0.5)


def test_declared_services_serve_generate(services, model_dir, log_dir, monkeypatch, tmp_path):
    # Only the declared environment may configure the services: none of this shell's FLATWIRE_*.
    for key in [key for key in os.environ if key.startswith("FLATWIRE_")]:
        monkeypatch.delenv(key)
    compose = LocalCompose(services, model_dir, tmp_path)
    order = compose.start_order()
    assert order == ["scheduler", "gateway"]
    started = []
    try:
        for name in order:
            program, command, *args = services[name]["command"]
            assert program == "flatwire" and command == COMMANDS[name]
            proc = ServiceProcess(command, args, log_dir, compose.environment(name))
            started.append(proc)
            wait_healthy(proc, compose.healthcheck(name))
        http_port = compose.ports["gateway", int(services["gateway"]["environment"]["FLATWIRE_PORT"])]
        reply = httpx.post(f"http://127.0.0.1:{http_port}/generate", timeout=60,
                           json={"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["meta_info"]["completion_tokens"] == 4
        # With no FLATWIRE_INTERNAL_SECRET, the first service generated one that all of them use.
        secret = (tmp_path / "internal-secret").read_text().strip()
        replica = services["scheduler"]["environment"]
        scheduler_port = compose.ports["scheduler", int(replica["FLATWIRE_SCHEDULER_PORT"])]
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats
            with pytest.raises(grpc.RpcError) as refused:
                stats(scheduler_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stats(scheduler_pb2.StatsRequest(), timeout=10, metadata=[(SECRET_METADATA, secret)])
    finally:
        for proc in reversed(started):
            proc.stop()
