"""Two scheduler replicas behind one gateway: balancing, failover, and rejoining.

One detokenizer follows both replicas; the gateway balances across them by
outstanding work. A replica killed mid-run (SIGKILL: no goodbye on its streams) must
fail its in-flight requests with HTTP 503 naming it within the hop timeout while the
other keeps serving, and must come back into rotation when restarted on the same port.
"""

import concurrent.futures
import signal
import time

import grpc
import httpx
import pytest
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER, SchedulerStats

from harness.procs import ServiceProcess, free_port

pytestmark = pytest.mark.slow  # runs services as processes of its own

SCHEDULER_ARGS = ("--max-running-requests", "16")
SHORT = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
REQUEST_TIMEOUT_S = 120  # a hung request fails the test instead of stalling it
HOP_TIMEOUT_S = 3.0


class Scheduler:
    """A scheduler replica that can be killed and restarted on the same port."""

    def __init__(self, model_dir, log_dir):
        self.model_dir, self.log_dir = model_dir, log_dir
        self.address = f"127.0.0.1:{free_port()}"
        self.proc: ServiceProcess | None = None

    def launch(self) -> None:
        port = self.address.rsplit(":", 1)[1]
        self.proc = ServiceProcess("scheduler", ["--port", port, "--model", str(self.model_dir), *SCHEDULER_ARGS],
                                   self.log_dir)

    def start(self) -> None:
        self.launch()
        self.proc.wait_healthy(self.address)

    def kill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)
        self.proc.proc.wait(timeout=30)
        self.proc.stop()  # closes the log

    def stats(self) -> SchedulerStats:
        with grpc.insecure_channel(self.address) as channel:
            return SCHEDULER.calls(channel)["GetStats"](EMPTY, timeout=10)


class Cluster:
    def __init__(self, schedulers: list[Scheduler], http_url: str):
        self.schedulers = schedulers
        self.http_url = http_url

    def finished(self) -> list[int]:
        return [s.stats().finished for s in self.schedulers]

    def generate_all(self, count: int, sampling: dict) -> list[concurrent.futures.Future]:
        """`count` concurrent /generate requests; each future gives its meta_info."""
        pool = concurrent.futures.ThreadPoolExecutor(count)
        futures = [pool.submit(self._generate, f"request {i}: the quick brown fox", sampling) for i in range(count)]
        pool.shutdown(wait=False)
        return futures

    def _generate(self, text: str, sampling: dict) -> dict:
        reply = httpx.post(f"{self.http_url}/generate", json={"text": text, "sampling_params": sampling},
                           timeout=REQUEST_TIMEOUT_S)
        if reply.status_code == 503:
            return {"error": reply.json()["error"]["message"], "ended": time.monotonic()}
        assert reply.status_code == 200, reply.text
        return reply.json()["meta_info"]


def results(futures: list[concurrent.futures.Future]) -> list[dict]:
    return [f.result(timeout=REQUEST_TIMEOUT_S + 10) for f in futures]


@pytest.fixture(scope="module")
def cluster(model_dir, log_dir):
    schedulers = [Scheduler(model_dir, log_dir), Scheduler(model_dir, log_dir)]
    addresses = ",".join(s.address for s in schedulers)
    detokenizer_port, http_port, grpc_port = free_port(), free_port(), free_port()
    common = ["--model", str(model_dir), "--schedulers", addresses]
    started = []
    try:
        for scheduler in schedulers:
            scheduler.launch()
            started.append(scheduler.proc)
        for scheduler in schedulers:
            scheduler.proc.wait_healthy(scheduler.address)
        detokenizer = ServiceProcess("detokenizer", ["--port", str(detokenizer_port), *common], log_dir)
        started.append(detokenizer)
        detokenizer.wait_healthy(f"127.0.0.1:{detokenizer_port}")
        gateway = ServiceProcess("gateway", [
            "--port", str(http_port), "--grpc-port", str(grpc_port), *common,
            "--detokenizers", f"127.0.0.1:{detokenizer_port}", "--health-interval-s", "0.2",
            "--hop-timeout-s", str(HOP_TIMEOUT_S)], log_dir)
        started.append(gateway)
        gateway.wait_healthy(f"127.0.0.1:{grpc_port}")
        yield Cluster(schedulers, f"http://127.0.0.1:{http_port}")
    finally:
        for proc in reversed(started):
            proc.stop()
        for scheduler in schedulers:  # a restarted one
            if scheduler.proc not in started:
                scheduler.proc.stop()


def test_concurrent_requests_spread_over_both_replicas(cluster):
    before = cluster.finished()
    metas = results(cluster.generate_all(40, SHORT))
    assert all(meta["finish_reason"] == {"type": "length", "length": 8} for meta in metas), metas
    served = [after - b for after, b in zip(cluster.finished(), before)]
    print(f"\n40 concurrent requests, served per replica: {served}")
    assert sum(served) == 40 and min(served) > 0, served


def test_killed_replica_fails_its_requests_and_the_other_keeps_serving(cluster):
    victim, survivor = cluster.schedulers
    futures = cluster.generate_all(16, LONG)
    deadline = time.monotonic() + 60
    while not (victim.stats().running and survivor.stats().running):
        assert time.monotonic() < deadline, "the long requests never ran on both replicas"
        time.sleep(0.05)
    victim.kill()
    killed = time.monotonic()
    metas = results(futures)  # every one ends: none hangs on the dead replica

    failed = [meta for meta in metas if "error" in meta]
    completed = [meta for meta in metas if meta.get("finish_reason") == {"type": "length", "length": 128}]
    print(f"\nkill mid-run: {len(failed)} in-flight requests failed (503), {len(completed)} completed on the "
          f"survivor; first error: {failed[0]['error'] if failed else None!r}")
    assert len(failed) + len(completed) == len(metas), metas
    assert failed and completed
    assert all(victim.address in meta["error"] for meta in failed), failed
    # Within the hop timeout, plus a health round and its check's own timeout.
    assert max(meta["ended"] for meta in failed) - killed < HOP_TIMEOUT_S + 3, failed

    metas = results(cluster.generate_all(10, SHORT))  # new requests avoid the dead replica
    assert all(meta["finish_reason"]["type"] == "length" for meta in metas), metas


def test_restarted_replica_rejoins_rotation(cluster):
    victim, _ = cluster.schedulers
    victim.start()
    # Requests right after it is healthy again: none may be lost while the pipeline reconnects.
    deadline = time.monotonic() + 60
    while victim.stats().finished == 0:
        assert time.monotonic() < deadline, "no request reached the restarted replica"
        metas = results(cluster.generate_all(8, SHORT))
        assert all(meta["finish_reason"]["type"] == "length" for meta in metas), metas
    print(f"\nrestarted replica served {victim.stats().finished} requests")


def test_one_detokenizer_per_scheduler(model_dir, log_dir):
    """The other topology: each replica followed by its own detokenizer; the gateway listens to both."""
    schedulers = [Scheduler(model_dir, log_dir), Scheduler(model_dir, log_dir)]
    http_port, grpc_port = free_port(), free_port()
    detokenizers = [f"127.0.0.1:{free_port()}" for _ in schedulers]
    started = []
    try:
        for scheduler in schedulers:
            scheduler.launch()
            started.append(scheduler.proc)
        for scheduler, detokenizer in zip(schedulers, detokenizers):
            scheduler.proc.wait_healthy(scheduler.address)
            proc = ServiceProcess("detokenizer", ["--port", detokenizer.rsplit(":", 1)[1], "--model", str(model_dir),
                                                  "--schedulers", scheduler.address], log_dir)
            started.append(proc)
            proc.wait_healthy(detokenizer)
        gateway = ServiceProcess("gateway", [
            "--port", str(http_port), "--grpc-port", str(grpc_port), "--model", str(model_dir),
            "--schedulers", ",".join(s.address for s in schedulers), "--detokenizers", ",".join(detokenizers),
            "--health-interval-s", "0.2"], log_dir)
        started.append(gateway)
        gateway.wait_healthy(f"127.0.0.1:{grpc_port}")
        cluster = Cluster(schedulers, f"http://127.0.0.1:{http_port}")
        metas = results(cluster.generate_all(12, SHORT))
        assert all(meta["finish_reason"] == {"type": "length", "length": 8} for meta in metas), metas
        served = cluster.finished()
        assert sum(served) == 12 and min(served) > 0, served
    finally:
        for proc in reversed(started):
            proc.stop()
