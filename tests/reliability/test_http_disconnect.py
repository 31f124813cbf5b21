"""A client that goes away mid-generation aborts its request in the scheduler."""

import socket
import time
from urllib.parse import urlsplit

import grpc
import httpx
import orjson
import pytest
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER

LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def scheduler(stack):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stub = SCHEDULER.calls(channel)
        yield lambda: stub["GetStats"](EMPTY, timeout=10)


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a plain socket, so the test decides when the connection closes."""
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=60)
    payload = orjson.dumps(body)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(payload), payload))
    return sock


def client_closed_count(url: str) -> float:
    """/generate requests the gateway answered 499 (client closed request), from its /metrics."""
    line = 'flatwire_request_errors_total{endpoint="/generate",status="499"} '
    rows = [row for row in httpx.get(url + "/metrics", timeout=10).text.splitlines() if row.startswith(line)]
    return float(rows[0].split()[-1]) if rows else 0.0


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "tell me everything", "sampling_params": LONG, "stream": True}),
    ("/v1/chat/completions", {"stream": True, "max_tokens": 3000, "ignore_eos": True,
                              "messages": [{"role": "user", "content": "tell me everything"}]}),
])
def test_streaming_client_disconnect_aborts(stack, scheduler, path, body):
    if path.startswith("/v1/"):
        body = {**body, "model": httpx.get(stack.http_url + "/v1/models").json()["data"][0]["id"]}
    before = scheduler()
    sock = raw_post(stack.http_url, path, body)
    received = b""
    while received.count(b"data: ") < 2:  # generation is under way
        data = sock.recv(65536)
        assert data, received
        received += data
    assert scheduler().running > before.running
    sock.close()
    wait_for(lambda: scheduler().aborted > before.aborted, "the scheduler to count an abort")
    wait_for(lambda: scheduler().running <= before.running, "the scheduler to drop the request")


def test_non_streaming_client_disconnect_aborts(stack, scheduler):
    before = scheduler()
    sock = raw_post(stack.http_url, "/generate", {"text": "tell me everything", "sampling_params": LONG})
    wait_for(lambda: scheduler().running > before.running, "the request to run")
    sock.close()
    wait_for(lambda: scheduler().aborted > before.aborted, "the scheduler to count an abort")
    wait_for(lambda: scheduler().running <= before.running, "the scheduler to drop the request")
    wait_for(lambda: client_closed_count(stack.http_url) >= 1, "the gateway to count the request as 499")
    # the gateway is still fine
    response = httpx.post(stack.http_url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                          timeout=60)
    assert response.status_code == 200
