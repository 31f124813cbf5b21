"""`flatwire replica` (compose's scheduler service): its detokenizer follows its scheduler, and the pair lives and
dies together, so that the container's restart policy restarts both."""

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.discovery import subscription_health_name
from services.common.rpc import check_health
from tests.procs import ServiceProcess, free_port

pytestmark = pytest.mark.slow  # runs services as processes of its own


def children(pid: int) -> dict[str, int]:
    """The replica's child services by command ('scheduler', 'detokenizer') -> pid."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = stat.read_bytes().split(b"\0")
            ppid = int(Path(stat.parent, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"services" in args:
            found[args[args.index(b"services") + 1].decode()] = int(stat.parent.name)
    return found


def start_replica(log_dir, model_dir) -> tuple[ServiceProcess, str, str]:
    scheduler, detokenizer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {"FLATWIRE_HOST": "127.0.0.1", "FLATWIRE_SCHEDULER_PORT": scheduler.split(":")[1],
           "FLATWIRE_DETOKENIZER_PORT": detokenizer.split(":")[1], "FLATWIRE_MODEL": str(model_dir)}
    replica = ServiceProcess("replica", [], log_dir, env)
    deadline = time.monotonic() + 180
    # The detokenizer is SERVING only once it follows its scheduler's step stream.
    while not (check_health(scheduler, timeout=1) and check_health(detokenizer, timeout=1)):
        assert replica.proc.poll() is None and time.monotonic() < deadline, replica.log()[-3000:]
        time.sleep(0.2)
    with grpc.insecure_channel(detokenizer) as channel:
        following = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=subscription_health_name(scheduler)), timeout=5)
    assert following.status == health_pb2.HealthCheckResponse.SERVING  # it follows its own scheduler
    return replica, scheduler, detokenizer


def wait_exit(replica: ServiceProcess, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while replica.proc.poll() is None:
        assert time.monotonic() < deadline, replica.log()[-3000:]
        time.sleep(0.1)
    return replica.proc.returncode


def test_a_dead_child_stops_the_pair(log_dir, model_dir):
    replica, _, _ = start_replica(log_dir, model_dir)
    try:
        pids = children(replica.proc.pid)
        assert set(pids) == {"scheduler", "detokenizer"}
        os.kill(pids["scheduler"], signal.SIGKILL)
        assert wait_exit(replica) != 0
        assert not Path(f"/proc/{pids['detokenizer']}").exists()  # stopped and reaped by the replica
        assert "scheduler exited" in replica.log()
    finally:
        replica.stop()


def test_sigterm_stops_both(log_dir, model_dir):
    replica, scheduler, detokenizer = start_replica(log_dir, model_dir)
    try:
        pids = children(replica.proc.pid)
        replica.proc.send_signal(signal.SIGTERM)
        assert wait_exit(replica) == 0
        for pid in pids.values():
            assert not Path(f"/proc/{pid}").exists()
        assert not check_health(scheduler, timeout=1) and not check_health(detokenizer, timeout=1)
    finally:
        replica.stop()
