"""Two scheduler replicas behind one gateway: balancing, prefix-aware routing, failover, and rejoining.

One detokenizer follows both replicas; the gateway sends a request where its session or prompt prefix
went before (that replica's prefix cache holds it), else to the replica with the least outstanding work.
A replica killed mid-run (SIGKILL: no goodbye on its streams) must fail its in-flight requests with HTTP
503 naming it within the hop timeout while the other keeps serving, and must come back into rotation when
restarted on the same port.
"""

import concurrent.futures
import time

import pytest

from harness.http import post
from harness.stack import Stack, running

pytestmark = pytest.mark.slow  # runs services as processes of its own

SCHEDULER_ARGS = ("--max-running-requests", "16")
SHORT = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
REQUEST_TIMEOUT_S = 120  # a hung request fails the test instead of stalling it
HOP_TIMEOUT_S = 3.0


class Cluster:
    """A stack of scheduler replicas, and the requests its gateway is sent."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.replicas = [service.name for service in stack.services.values() if service.kind == "scheduler"]

    def finished(self) -> list[int]:
        return [self.stack.stats(name).finished for name in self.replicas]

    def generate_all(self, count: int, sampling: dict) -> list[concurrent.futures.Future]:
        """`count` concurrent /generate requests; each future gives its meta_info."""
        pool = concurrent.futures.ThreadPoolExecutor(count)
        futures = [pool.submit(self._request, f"request {i}: the quick brown fox", sampling) for i in range(count)]
        pool.shutdown(wait=False)
        return futures

    def _request(self, text: str, sampling: dict) -> dict:
        """Its meta_info; a 503's error message, and when it came."""
        reply = post(self.stack.http_url, "/generate", {"text": text, "sampling_params": sampling},
                     timeout=REQUEST_TIMEOUT_S)
        if reply.status_code == 503:
            return {"error": reply.json()["error"]["message"], "ended": time.monotonic()}
        assert reply.status_code == 200, reply.text
        return reply.json()["meta_info"]


def results(futures: list[concurrent.futures.Future]) -> list[dict]:
    return [f.result(timeout=REQUEST_TIMEOUT_S + 10) for f in futures]


@pytest.fixture(scope="module")
def cluster(model_dir, log_dir):
    """Two replicas, one detokenizer following both."""
    with running(model_dir, log_dir, schedulers=2, scheduler_args=SCHEDULER_ARGS,
                 gateway_args=("--health-interval-s", "0.2", "--hop-timeout-s", str(HOP_TIMEOUT_S))) as stack:
        yield Cluster(stack)


def test_concurrent_requests_spread_over_both_replicas(cluster):
    before = cluster.finished()
    metas = results(cluster.generate_all(40, SHORT))
    assert all(meta["finish_reason"] == {"type": "length", "length": 8} for meta in metas), metas
    served = [after - b for after, b in zip(cluster.finished(), before)]
    print(f"\n40 concurrent requests, served per replica: {served}")
    assert sum(served) == 40 and min(served) > 0, served


def test_samples_of_one_prompt_go_to_one_replica(cluster):
    """GRPO's n samples: the replica that computes the prompt serves them all, from its cache."""
    stack = cluster.stack
    before = [stack.stats(name) for name in cluster.replicas]
    prompt = "A prompt long enough to share: " + "the quick brown fox jumps over the lazy dog. " * 30
    reply = post(stack.http_url, "/generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": 8, "n": 8, "temperature": 1.0}}, timeout=REQUEST_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    after = [stack.stats(name) for name in cluster.replicas]
    served = [a.finished - b.finished for a, b in zip(after, before)]
    prefilled = sum(a.prefill_tokens - b.prefill_tokens for a, b in zip(after, before))
    prompt_tokens = reply.json()[0]["meta_info"]["prompt_tokens"]
    print(f"\nn=8 samples of a {prompt_tokens}-token prompt: served per replica {served}, {prefilled} tokens prefilled")
    assert sorted(served) == [0, 8], served
    assert prefilled <= 1.2 * prompt_tokens, prefilled


@pytest.mark.parametrize("header", ["X-SMG-Routing-Key", "X-Session-ID"])
def test_a_session_key_keeps_its_replica(cluster, header):
    """Unrelated short prompts (no shared prefix to follow) of one session all go where its first went, though
    the other replica is as idle; the first went to the least loaded, the one not running a long request."""
    stack = cluster.stack
    busy = concurrent.futures.ThreadPoolExecutor(1).submit(cluster._request, "keep one replica busy", LONG)
    deadline = time.monotonic() + 60
    while not any(stack.stats(name).running for name in cluster.replicas):
        assert time.monotonic() < deadline, "the long request never ran"
        time.sleep(0.02)
    idle = next(i for i, name in enumerate(cluster.replicas) if not stack.stats(name).running)
    before = cluster.finished()

    def turn(i: int) -> None:
        reply = post(stack.http_url, "/generate", {"text": f"turn {i} of a session", "sampling_params": SHORT},
                     headers={header: f"session-{header}"}, timeout=REQUEST_TIMEOUT_S)
        assert reply.status_code == 200, reply.text

    turn(0)
    busy.result(timeout=REQUEST_TIMEOUT_S)
    for i in range(1, 6):
        turn(i)
    served = [after - b for after, b in zip(cluster.finished(), before)]
    assert served[idle] == 6 and served[1 - idle] == 1, served  # the other served only the long request


def test_killed_replica_fails_its_requests_and_the_other_keeps_serving(cluster):
    stack = cluster.stack
    victim, survivor = cluster.replicas
    futures = cluster.generate_all(16, LONG)
    deadline = time.monotonic() + 60
    while not (stack.stats(victim).running and stack.stats(survivor).running):
        assert time.monotonic() < deadline, "the long requests never ran on both replicas"
        time.sleep(0.05)
    stack.kill(victim)
    killed = time.monotonic()
    metas = results(futures)  # every one ends: none hangs on the dead replica

    failed = [meta for meta in metas if "error" in meta]
    completed = [meta for meta in metas if meta.get("finish_reason") == {"type": "length", "length": 128}]
    print(f"\nkill mid-run: {len(failed)} in-flight requests failed (503), {len(completed)} completed on the "
          f"survivor; first error: {failed[0]['error'] if failed else None!r}")
    assert len(failed) + len(completed) == len(metas), metas
    assert failed and completed
    assert all(stack.services[victim].address in meta["error"] for meta in failed), failed
    # Within the hop timeout, plus a health round and its check's own timeout.
    assert max(meta["ended"] for meta in failed) - killed < HOP_TIMEOUT_S + 3, failed

    metas = results(cluster.generate_all(10, SHORT))  # new requests avoid the dead replica
    assert all(meta["finish_reason"]["type"] == "length" for meta in metas), metas


def test_restarted_replica_rejoins_rotation(cluster):
    stack = cluster.stack
    victim, _ = cluster.replicas
    stack.start(victim)  # on the same port
    # Requests right after it is healthy again: none may be lost while the pipeline reconnects.
    deadline = time.monotonic() + 60
    while stack.stats(victim).finished == 0:
        assert time.monotonic() < deadline, "no request reached the restarted replica"
        metas = results(cluster.generate_all(8, SHORT))
        assert all(meta["finish_reason"]["type"] == "length" for meta in metas), metas
    print(f"\nrestarted replica served {stack.stats(victim).finished} requests")


def test_one_detokenizer_per_scheduler(model_dir, log_dir):
    """The other topology: each replica followed by its own detokenizer; the gateway listens to both."""
    with running(model_dir, log_dir, schedulers=2, detokenizers=2, scheduler_args=SCHEDULER_ARGS,
                 gateway_args=("--health-interval-s", "0.2")) as stack:
        cluster = Cluster(stack)
        metas = results(cluster.generate_all(12, SHORT))
        assert all(meta["finish_reason"] == {"type": "length", "length": 8} for meta in metas), metas
        served = cluster.finished()
        assert sum(served) == 12 and min(served) > 0, served
