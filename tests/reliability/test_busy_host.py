"""No false outages (issue 24): on a host whose cores are busy with other work, and through short stalls of the
scheduler, requests that could be served are served. A replica leaves rotation on a hard signal or after
--health-failure-threshold late answers in a row, never for one slow check; a constrained request's Submit
answers before its grammar compiles; while the only replica is merely slow, a new request waits for it (for
--hop-timeout-s) rather than failing at once.

Against a stack of our own (a fresh scheduler: its first grammar also reads the vocabulary), with other
processes spinning on every core where the test says so."""

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from harness.faults import busy_cores
from harness.stack import Stack, running

pytestmark = pytest.mark.slow  # runs services as processes of its own

HOP_TIMEOUT_S = 5.0  # the gateway's default


@pytest.fixture(scope="module")
def stack(model_dir, log_dir) -> Iterator[Stack]:
    with running(model_dir, log_dir, scheduler_args=("--max-running-requests", "8")) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture(scope="module")
def model(stack) -> str:
    return httpx.get(f"{stack.http_url}/v1/models").json()["data"][0]["id"]


def chat(http: httpx.Client, model: str, i: int, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": f"Request {i}: say something."}],
        "max_tokens": 8, "temperature": 0, **fields})


def test_structured_requests_on_a_busy_host_fail_nothing(stack, model):
    """Every tenth request has a JSON schema of its own (a grammar to compile); the cores are all busy."""

    def one(i: int) -> tuple[int, str]:
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}
        fields = {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
                  "max_tokens": 64} if i % 10 == 0 else {}
        reply = chat(http, model, i, **fields)
        return reply.status_code, reply.text[:300]

    with busy_cores(), httpx.Client(base_url=stack.http_url, timeout=300) as http, ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(120)))
    assert [reply for reply in replies if reply[0] != 200] == []


def test_short_stalls_of_the_scheduler_fail_nothing(stack, model):
    """The scheduler stopped for 2.5 s, three times, while four clients keep sending: every request is served
    (those sent during a stall wait for it)."""
    replies: list[int] = []
    done = threading.Event()

    def client(c: int) -> None:
        with httpx.Client(base_url=stack.http_url, timeout=120) as http:
            i = 0
            while not done.is_set():
                replies.append(chat(http, model, c * 1000 + i).status_code)
                i += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(3):
            time.sleep(1.5)
            stack.signal("scheduler", signal.SIGSTOP)
            time.sleep(2.5)
            stack.signal("scheduler", signal.SIGCONT)
        time.sleep(1.5)
    finally:
        stack.signal("scheduler", signal.SIGCONT)
        done.set()
        for thread in threads:
            thread.join(120)
    assert len(replies) > 12 and set(replies) == {200}, sorted(set(replies))


def test_a_long_stall_fails_new_requests_after_the_hop_timeout_not_at_once(stack, model):
    """Stopped for longer than the gateway waits: a new request fails with 503 once it has waited about the hop
    timeout (not at once, not forever); after SIGCONT requests are served again."""
    with httpx.Client(base_url=stack.http_url, timeout=120) as http:
        stack.signal("scheduler", signal.SIGSTOP)
        try:
            time.sleep(1)
            started = time.monotonic()
            reply = chat(http, model, 0)
            waited = time.monotonic() - started
            time.sleep(max(0.0, 13 - waited))  # past --health-failure-threshold late checks: out of rotation
            started = time.monotonic()
            later = chat(http, model, 1)
            waited_later = time.monotonic() - started
        finally:
            stack.signal("scheduler", signal.SIGCONT)
        assert reply.status_code == 503 and HOP_TIMEOUT_S - 0.5 <= waited <= HOP_TIMEOUT_S + 5, (waited, reply.text)
        assert later.status_code == 503 and HOP_TIMEOUT_S - 0.5 <= waited_later <= HOP_TIMEOUT_S + 5, (
            waited_later, later.text)
        deadline = time.monotonic() + 30
        while (status := chat(http, model, 2).status_code) != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert status == 200
