"""`flatwire up` starts the three services, serves, restarts a crashed one, and stops them all on Ctrl-C; two run
side by side on their own internal ports; it takes every option of the services and passes those given on.

Serving and Ctrl-C's drain run on the default model; the launcher's other tests, whose subject is the processes,
on the small vocabulary's (tests/conftest.py small_model_dir: its services start without reading 248k tokens)."""

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from flatwire_client import FlatwireClient

from harness.certificates import make_certificates
from harness.http import post
from harness.launcher import Launcher
from harness.procs import ROOT, ServiceProcess, free_port, tensor_parallel_ranks
from services.common.config import env_name
from services.common.model_store import DEFAULT_MODEL_NAME
from services.common.rpc import check_health
from services.launcher import SERVICES, Supervised, UpConfig, internal_ports, parse_up, service_options
from tests.deploy.hub_cache import HUB_MODEL_ID, offline_env, populate_hub_cache

pytestmark = pytest.mark.slow  # runs services as processes of its own


def _start_up(model_dir: Path, log_path: Path) -> Launcher:
    """`flatwire up` on free ports, once it has printed that it is up."""
    up = Launcher(log_path, model_dir)
    up.wait_up()
    return up


def _stop_up(up: Launcher) -> None:
    """Ctrl-C stops the launcher cleanly and all three services with it."""
    assert up.stop() == 0, up.log()
    for name in ("scheduler-port", "detokenizer-port", "grpc-port"):
        assert not check_health(f"127.0.0.1:{up.ports[name]}", timeout=0.5), f"{name} still serving"


def _hello(up: Launcher, timeout: float = 60) -> httpx.Response:
    return post(up.http_url, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
                timeout=timeout)


def test_up_serves_and_stops_cleanly(model_dir, tmp_path):
    up = _start_up(model_dir, tmp_path / "up.log")
    try:
        reply = _hello(up)
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 4
        assert check_health(up.grpc_address)
    finally:
        _stop_up(up)


def _served_again(up: Launcher, service: str, code: int) -> None:
    """`service` exited with `code`: the launcher says it restarts it, and /generate answers 200 again."""
    deadline = time.monotonic() + 10
    while f"{service} exited with code {code}; restarting it in" not in up.log():
        assert up.proc.poll() is None and time.monotonic() < deadline, f"no restart logged:\n{up.log()}"
        time.sleep(0.2)

    # The gateway may answer 503 (or not answer in time) until the new service is up.
    deadline = time.monotonic() + 60
    while True:
        try:
            reply = _hello(up, timeout=10)
            if reply.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"no /generate success after restart:\n{up.log()}"
        time.sleep(1)
    assert reply.json()["meta_info"]["completion_tokens"] == 4
    assert up.proc.poll() is None, up.log()


def test_up_restarts_a_crashed_service(small_model_dir, tmp_path):
    up = _start_up(small_model_dir, tmp_path / "up.log")
    try:
        detokenizer = up.child_pid("detokenizer")
        assert detokenizer is not None, "no detokenizer child found"
        os.kill(detokenizer, signal.SIGKILL)
        _served_again(up, "detokenizer", -9)
        assert up.child_pid("detokenizer") not in (None, detokenizer)
    finally:
        _stop_up(up)


def test_up_restarts_a_tensor_parallel_scheduler_as_one_unit(small_model_dir, tmp_path):
    """`flatwire up --tp-size 2`: a rank killed takes its scheduler down (exit 1), and the launcher brings the
    scheduler back, ranks and all."""
    up = Launcher(tmp_path / "up.log", small_model_dir, ("--tp-size", "2"))
    up.wait_up()
    try:
        scheduler = up.child_pid("scheduler")
        assert scheduler is not None, "no scheduler child found"
        [rank] = tensor_parallel_ranks(scheduler)
        os.kill(rank, signal.SIGKILL)
        _served_again(up, "scheduler", 1)
        restarted = up.child_pid("scheduler")
        assert restarted not in (None, scheduler) and len(tensor_parallel_ranks(restarted)) == 1
    finally:
        _stop_up(up)


def test_ctrl_c_lets_the_requests_in_flight_finish(model_dir, tmp_path):
    """The gateway drains first; the scheduler and the detokenizer stop only after it (they had stopped with it,
    and its drain failed every request with 503)."""
    up = _start_up(model_dir, tmp_path / "up.log")
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(post, up.http_url, "/generate", body, timeout=120) for _ in range(2)]
        time.sleep(1.5)  # generating
        assert not any(reply.done() for reply in replies)
        _stop_up(up)
        for reply in replies:
            assert reply.result().status_code == 200, reply.result().text
            assert reply.result().json()["meta_info"]["completion_tokens"] == 200


def test_a_killed_launcher_takes_its_services_with_it(small_model_dir, tmp_path):
    """kill -9 (or the OOM killer) of `flatwire up`: its services stop too, and free the ports for the next one."""
    up = _start_up(small_model_dir, tmp_path / "up.log")
    children = [pid for service in ("scheduler", "detokenizer", "gateway") for pid in up.children(service)]
    assert len(children) == 3
    up.proc.kill()
    up.proc.wait()
    deadline = time.monotonic() + 30
    try:
        while alive := [pid for pid in children if Path(f"/proc/{pid}").exists() and not _zombie(pid)]:
            assert time.monotonic() < deadline, f"still running: {alive}"
            time.sleep(0.2)
    finally:
        for pid in children:  # what a failure left
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for port in up.ports.values():
        assert not _taken(port), port


def _zombie(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("which", ["--port", "--grpc-port"])
def test_a_taken_port_stops_up_before_it_starts_anything(model_dir, tmp_path, which):
    """Another server on the port (here a bare listener; a flatwire answering /health had up report itself up
    and restart its gateway forever): one line naming the port, exit 1, nothing started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = Launcher(tmp_path / "up.log", model_dir, options=[f"{which}={port}"])
        up.proc.wait(timeout=240)
    assert up.proc.returncode == 1, up.log()
    what = "HTTP" if which == "--port" else "gRPC"
    assert up.log().strip() == (f"flatwire up: the gateway's {what} port {port} is taken: another process listens "
                                f"on 127.0.0.1:{port}")


def test_a_service_that_exits_while_starting_stops_up_with_one_line_that_names_it(small_model_dir, tmp_path):
    """A service that exits during startup (here the gateway: its TLS key is not there) is a setup error: `flatwire
    up` stops the others and exits 1 with one line naming it."""
    up = Launcher(tmp_path / "up.log", small_model_dir,
                  options=["--ssl-keyfile=/no/such.key", "--ssl-certfile=/no/such.crt"])
    up.proc.wait(timeout=240)
    assert up.proc.returncode == 1, up.log()
    last = up.log().rstrip().splitlines()[-1]
    assert last.startswith("flatwire up: gateway exited with code ") and "its log above says why" in last, up.log()
    assert "/no/such.key" in up.log()
    for service in ("scheduler", "detokenizer"):  # stopped by the launcher, before it exited
        assert f"flatwire.{service}: stopping" in up.log(), up.log()


def test_the_health_command_says_why_a_target_is_unhealthy():
    """On stderr (a container's health log shows it): it exited 1 saying nothing."""
    port = free_port()
    for kind, target, says in (("grpc", f"127.0.0.1:{port}", "UNAVAILABLE"),
                               ("http", f"http://127.0.0.1:{port}/health", "Connection refused")):
        result = subprocess.run([sys.executable, "-m", "services", "health", kind, target], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and result.stderr.startswith(f"flatwire health: {target}: "), result.stderr
        assert says in result.stderr, result.stderr


def test_a_gateway_alone_says_it_waits_for_its_scheduler(small_model_dir, tmp_path):
    """It serves once a scheduler answers; until then its log says which one it waits for (it said nothing)."""
    scheduler = f"127.0.0.1:{free_port()}"
    gateway = ServiceProcess("gateway", ["--port", str(free_port()), "--grpc-port", str(free_port()), "--model",
                                         str(small_model_dir), "--schedulers", scheduler, "--detokenizers",
                                         f"127.0.0.1:{free_port()}"], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while f"waiting for a scheduler to answer before serving ({scheduler}: UNAVAILABLE)" not in gateway.log():
            assert time.monotonic() < deadline and gateway.proc.poll() is None, gateway.log()
            time.sleep(0.2)
    finally:
        gateway.stop()


def test_a_gateway_alone_on_a_taken_port_says_so_before_it_waits():
    """One line at once, as `up` says it: it found out only once a scheduler had answered and it bound."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "services", "gateway", "--port", str(port), "--grpc-port",
                                 str(free_port()), "--schedulers", f"127.0.0.1:{free_port()}", "--detokenizers",
                                 f"127.0.0.1:{free_port()}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == f"flatwire gateway: --port {port} is taken: another process listens on " \
                                    f"127.0.0.1:{port}"


@pytest.mark.parametrize("command", ["up", "scheduler", "detokenizer", "gateway"])
def test_a_model_that_is_not_there_is_one_line(command):
    result = subprocess.run([sys.executable, "-m", "services", command, "--model", "/no/such/checkpoint"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"flatwire {command}: --model /no/such/checkpoint: neither a local directory "
                                     "nor a Hugging Face Hub model id (Org/Name)")


def test_ctrl_c_while_the_default_model_is_built_stops_quietly(tmp_path):
    """Ctrl-C before the services start (here: while the default model is built into an empty cache)
    ends `up` with status 130, no traceback, and no half-built model left behind."""
    up = subprocess.Popen([sys.executable, "-m", "services", "up", "--port", "0", "--grpc-port", "0"], cwd=ROOT,
                          text=True, env={**os.environ, "FLATWIRE_CACHE_DIR": str(tmp_path)}, stderr=subprocess.PIPE)
    try:
        assert up.stderr is not None
        read = ""
        while "converting the Qwen3.5 vocabulary" not in read:  # the build is under way
            line = up.stderr.readline()
            assert line, read
            read += line
        up.send_signal(signal.SIGINT)
        _, stderr = up.communicate(timeout=60)
    finally:
        up.kill()
    assert up.returncode == 130 and "Traceback" not in stderr, read + stderr
    assert [path.name for path in tmp_path.iterdir()] == [f"{DEFAULT_MODEL_NAME}.lock"]


def test_restart_delay_doubles_up_to_the_cap_and_resets(capsys):
    config = UpConfig(restart_delay_s=1, restart_max_delay_s=4, restart_reset_s=60)
    service = Supervised("detokenizer", [sys.executable, "-c", "raise SystemExit(3)"], config.restart_delay_s)

    def crash(up_for: float = 0) -> float:
        """Start the service and let it exit, as if after `up_for` seconds up; the restart delay it gets."""
        service.start()
        service.proc.wait(timeout=30)
        service.started_at -= up_for
        service.supervise(config)
        return round(service.restart_at - time.monotonic())

    assert [crash() for _ in range(4)] == [1, 2, 4, 4]
    assert crash(up_for=60) == 1
    assert "detokenizer exited with code 3; restarting it in 1 s" in capsys.readouterr().err
    service.restart_at = time.monotonic()
    crashed = service.proc
    service.supervise(config)
    assert service.proc is not crashed and service.restart_at is None
    service.proc.wait(timeout=30)


def test_internal_ports_are_free_and_distinct_unless_given():
    picked = [internal_ports(UpConfig()) for _ in range(2)]
    ports = [port for pair in picked for port in pair]
    assert len(set(ports)) == len(ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free
    assert internal_ports(UpConfig(scheduler_port=30010, detokenizer_port=30020)) == (30010, 30020)
    scheduler, detokenizer = internal_ports(UpConfig(scheduler_port=30010))
    assert scheduler == 30010 and detokenizer != 30010


def test_two_launchers_side_by_side(small_model_dir, tmp_path):
    """Two `flatwire up` on their own public ports, without internal ones, at once; the second serves a Hub model
    id from the Hugging Face cache (offline), resolved alike by all three of its services."""
    hub_cache = tmp_path / "hub"
    populate_hub_cache(hub_cache, HUB_MODEL_ID, small_model_dir)
    local = Launcher(tmp_path / "local.log", small_model_dir)
    hub = Launcher(tmp_path / "hub.log", HUB_MODEL_ID, env=offline_env(HF_HUB_CACHE=str(hub_cache)))
    launched = [local, hub]
    try:
        for up in launched:
            up.wait_up()
        assert not set(local.ports.values()) & set(hub.ports.values())
        for up in launched:
            reply = _hello(up)
            assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 4
        models = httpx.get(f"{hub.http_url}/v1/models", timeout=10).json()
        assert [model["id"] for model in models["data"]] == [HUB_MODEL_ID]
    finally:
        for up in launched:
            if "scheduler-port" in up.ports:
                _stop_up(up)
            else:  # the other one did not come up
                up.stop()


def test_up_help_lists_every_service_option_by_service():
    result = subprocess.run([sys.executable, "-m", "services", "up", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())  # argparse wraps lines
    for flag in ("--max-running-requests", "--stream-interval", "--stall-timeout-s", "--resolve-interval-s",
                 "--restart-delay-s", "[default 64; env FLATWIRE_MAX_RUNNING_REQUESTS]",
                 "[default 1.0; env FLATWIRE_RESTART_DELAY_S]"):
        assert flag in help_text
    for group in ("all three services", "scheduler (options", "detokenizer (options", "gateway (options",
                  "scheduler and detokenizer (options"):
        assert group in help_text
    # Every field of every service's config but the addresses the launcher sets itself.
    for cls in SERVICES.values():
        for field in cls.__dataclass_fields__:
            if field not in ("host", "port", "grpc_port", "schedulers", "detokenizers"):
                assert f"--{field.replace('_', '-')} " in help_text, field


def test_given_options_go_to_the_services_that_have_them():
    assert set(service_options()["stall_timeout_s"]) == {"scheduler", "detokenizer"}
    assert set(service_options()["log_level"]) == set(SERVICES)
    config, flags, env = parse_up(["--max-running-requests", "3", "--stall-timeout-s=2", "--stream-interval", "4",
                                   "--incremental-streaming-output", "--api-key", "k", "--log-level", "debug",
                                   "--restart-delay-s", "5", "--port", "8000"], "flatwire up")
    assert (config.restart_delay_s, config.port) == (5, 8000)
    assert {service: set(given) for service, given in flags.items()} == {
        "scheduler": {"--max-running-requests=3", "--stall-timeout-s=2", "--log-level=debug"},
        "detokenizer": {"--stall-timeout-s=2", "--log-level=debug"},
        "gateway": {"--stream-interval=4", "--incremental-streaming-output=true", "--log-level=debug"},
    }
    assert env == {"FLATWIRE_API_KEY": "k"}  # secrets travel in the environment, not on command lines
    assert parse_up([], "flatwire up") == (UpConfig(), {service: [] for service in SERVICES}, {})


def test_up_takes_vllm_s_names_of_the_lora_and_parallel_options_and_passes_sglang_s():
    _, flags, _ = parse_up(["--enable-lora", "--max-loras", "3", "--lora-modules", "a=/x", "--max-cpu-loras", "6",
                            "--max-lora-rank", "32", "--tensor-parallel-size", "2"], "flatwire up")
    assert set(flags["scheduler"]) == {"--enable-lora=true", "--max-loras-per-batch=3", "--lora-paths=a=/x",
                                       "--max-loaded-loras=6", "--max-lora-rank=32", "--tp-size=2"}
    assert flags["gateway"] == flags["detokenizer"] == []


def test_up_passes_options_on_and_leaves_the_rest_to_the_environment(small_model_dir, tmp_path):
    """A flag given to `flatwire up` reaches its service; a FLATWIRE_* variable still reaches it unchanged; a
    secret is on no command line."""
    env = {**os.environ, env_name("max_top_logprobs"): "7"}
    up = Launcher(tmp_path / "up.log", small_model_dir, ("--engine", "synthetic", "--max-running-requests", "3",
                                                          "--stream-interval", "2", "--api-key", "up-test-key"), env)
    try:
        up.wait_up()
        info = httpx.get(f"{up.http_url}/server_info", timeout=10,
                         headers={"Authorization": "Bearer up-test-key"}).json()
        assert (info["max_running_requests"], info["max_top_logprobs"], info["stream_interval"]) == (3, 7, 2)
        argv = {service: up.child_argv(service) for service in SERVICES}
        assert "--max-running-requests=3" in argv["scheduler"] and "--stream-interval=2" in argv["gateway"]
        assert not any("--stream-interval=2" in arg for arg in argv["scheduler"] + argv["detokenizer"])
        assert not any("up-test-key" in arg for args in argv.values() for arg in args)
        stream = post(up.http_url, "/generate", {"text": "hello", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 6}},
                      headers={"Authorization": "Bearer up-test-key"}, timeout=60)
        sizes = [len(json.loads(line[6:])["output_ids"]) for line in stream.text.splitlines()
                 if line.startswith("data: {")]
        # 2 tokens a message (--stream-interval 2); a gateway that reads late sends two in one event
        assert sizes[-1] == 6 and all(size % 2 == 0 for size in sizes), sizes
    finally:
        _stop_up(up)


def test_up_with_tls_serves_https_and_mutual_tls_inside(small_model_dir, tmp_path):
    certs = make_certificates(tmp_path / "tls")
    up = Launcher(tmp_path / "up.log", small_model_dir, ["--ssl-keyfile", str(certs.key), "--ssl-certfile",
                                                          str(certs.cert), "--ssl-ca-certs", str(certs.ca)])
    up.wait_up()
    try:
        https = up.http_url.replace("http://", "https://")
        assert https in up.log()  # where to connect, as it printed it
        reply = post(https, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60,
                     verify=ssl.create_default_context(cafile=certs.ca))
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 4
        assert not check_health(f"127.0.0.1:{up.ports['scheduler-port']}")  # no plaintext inside either
    finally:
        assert up.stop() == 0, up.log()


def test_up_with_two_gateway_workers_serves_from_both(small_model_dir, tmp_path):
    up = Launcher(tmp_path / "up.log", small_model_dir, ["--gateway-workers", "2"])
    up.wait_up()
    try:
        gateways = up.children("gateway")
        assert len(gateways) == 2, up.log()
        seen = set()
        for _ in range(40):  # a new connection each time: the kernel spreads them over the two
            seen.add(httpx.get(f"{up.http_url}/get_server_info", timeout=30).json()["gateway_id"])
            if len(seen) == 2:
                break
        assert len(seen) == 2, seen
        assert _hello(up).status_code == 200
        with FlatwireClient(up.grpc_address) as client:  # the public gRPC port is shared too
            assert client.generate("hello", max_new_tokens=2).completion_tokens == 2
    finally:
        assert up.stop() == 0, up.log()
