"""Bounded resources: body size, slow clients, stop strings, response size, gRPC message size,
memory after rejected requests, an event loop free while prompts are tokenized, admission control.

Against real services as processes: the session's default stack, and a `tight` one of our own
(one running slot, a waiting list of one, a gateway admitting two generations, 1 s read timeouts)
so that each bound is reached with a handful of requests.
"""

import dataclasses
import json
import random
import re
import socket
import statistics
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
from flatwire_client import FlatwireClient
from flatwire_wire import public
from flatwire_wire.scheduler import LogprobParams

from harness.http import post
from harness.stack import Stack, another_gateway
from services.common.rpc import message_options
from services.gateway.config import GatewayConfig
from services.gateway.http.parsers import MAX_HEAD_BYTES
from services.gateway.protocol.cost import logprob_elements

pytestmark = pytest.mark.slow  # runs services as processes of its own

DEFAULTS = GatewayConfig()
MAX_BODY = DEFAULTS.max_request_mb * 1024 * 1024


# -- helpers ------------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def steady_rss_mb(pid: int, timeout: float = 15.0) -> float:
    """RSS once it has not changed by more than 0.5 MB, either way, for 1.5 s."""
    deadline = time.monotonic() + timeout
    last, last_at = rss_mb(pid), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last_at < 1.5:
        time.sleep(0.1)
        if abs((now := rss_mb(pid)) - last) > 0.5:
            last, last_at = now, time.monotonic()
    return last


def settled_rss_mb(pid: int, timeout: float = 10.0) -> float:
    """RSS once freed memory has gone back (the gateway trims 0.2 s after a big request, at most every
    0.5 s): the lowest reading, once it has not gone lower for 1.5 s."""
    deadline = time.monotonic() + timeout
    low, low_at = rss_mb(pid), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - low_at < 1.5:
        time.sleep(0.1)
        now = rss_mb(pid)
        if now < low - 0.5:
            low, low_at = now, time.monotonic()
    return low


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def raw_exchange(address: tuple[str, int], head: bytes, body_parts=(), timeout: float = 20.0) -> tuple[int, bytes]:
    """Send a request head and body parts on a raw socket, then read until the server closes.
    Returns (body bytes sent, what came back). A refusal may cut the send short (reset)."""
    sent = 0
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
                sent += len(part)
        except OSError:  # the server answered and closed while we were still sending
            pass
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:  # reset after the answer: what was read is what counts
            pass
    return sent, data


def parse_response(data: bytes) -> tuple[int, dict, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_error(status_and_body, status: int, param: str | None, *words: str) -> dict:
    got_status, body = status_and_body
    assert got_status == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def words_text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    out, size = [], 0
    while size < chars:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = f"{name}{{{labels}}}" if labels else name
    for row in text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    raise AssertionError(f"{line} not in /metrics")


@pytest.fixture(scope="module")
def model(stack) -> str:
    return httpx.get(stack.http_url + "/v1/models", timeout=10).json()["data"][0]["id"]


# -- HTTP body size ---------------------------------------------------------------------------------------


def test_a_declared_300mb_body_is_refused_before_it_is_read(stack):
    pid = stack.procs["gateway"].proc.pid
    before = rss_mb(pid)
    head = (b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 300000000\r\n\r\n")
    started = time.perf_counter()
    _, data = raw_exchange(host_port(stack.http_url), head, [b'{"text": "' + b"a" * (1 << 20)])
    elapsed = time.perf_counter() - started
    status, headers, body = parse_response(data)
    assert_error((status, body), 413, "body", "300000000 bytes", str(MAX_BODY))
    assert headers["connection"] == "close"
    assert elapsed < 5
    assert rss_mb(pid) - before < 50


def test_a_300mb_chunked_body_is_cut_at_the_limit(stack):
    """No length announced: the gateway reads up to the limit, answers 413 and closes; the client could
    not push more than the limit and the socket buffers."""
    pid = stack.procs["gateway"].proc.pid
    before = rss_mb(pid)
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    megabyte = b"a" * (1 << 20)
    chunk = b"%x\r\n" % len(megabyte) + megabyte + b"\r\n"
    started = time.perf_counter()
    sent, data = raw_exchange(host_port(stack.http_url), head, (chunk for _ in range(300)))
    elapsed = time.perf_counter() - started
    status, headers, body = parse_response(data)
    assert_error((status, body), 413, "body", f"more than {MAX_BODY} bytes")
    assert sent < 2 * MAX_BODY, f"{sent} bytes went through"
    print(f"chunked 300 MB: refused after {sent / 2**20:.0f} MiB sent, in {elapsed:.2f} s")
    assert settled_rss_mb(pid) - before < 50


def test_a_body_within_the_limit_is_served(stack):
    body = b'{"text": "hi",' + b" " * (4 << 20) + b'"sampling_params": {"max_new_tokens": 2}}'  # 4 MB of JSON
    response = httpx.post(stack.http_url + "/generate", content=body, timeout=120,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text[:300]


# -- slow clients ---------------------------------------------------------------------------------------


def _open_many(address, count: int, payload: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(address, timeout=15)
        if payload:
            sock.sendall(payload)
        socks.append(sock)
    return socks


def _read_to_close(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def test_half_sent_requests_are_cut_off(tight):
    """300 half-sent bodies get 408 and are closed, 300 half-sent heads and 20 silent connections are
    closed, all within the 1 s timeouts (plus slack for this machine), not left open."""
    address = host_port(tight.http_url)
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    started = time.perf_counter()
    bodies = _open_many(address, 300, head + b'{"text": "')
    heads = _open_many(address, 300, b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Le")
    silent = _open_many(address, 20, b"")
    opened = time.perf_counter() - started
    answers = [_read_to_close(sock) for sock in bodies]
    cut = [_read_to_close(sock) for sock in heads + silent]
    elapsed = time.perf_counter() - started
    for sock in bodies + heads + silent:
        sock.close()
    print(f"620 slow connections opened in {opened:.1f} s, all closed after {elapsed:.1f} s")
    for data in answers:
        status, headers, body = parse_response(data)
        assert_error((status, body), 408, "body", "1 s")
        assert headers["connection"] == "close"
    assert all(data == b"" for data in cut)
    assert elapsed < opened + 1 + 8  # the 1 s timeout, and slack for a loaded 2-core machine
    assert httpx.get(tight.http_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("where", ["url", "headers", "one value", "a whole head"])
def test_a_request_head_past_the_bound_is_refused_and_closed(stack, where):
    """httptools (the default parser) keeps every header line it is sent: the gateway bounds the head as h11
    does, so a client sending header after header is answered 400 and cut once past the bound, not buffered;
    a whole head past it (one read: never seen unfinished) is refused too."""
    filler = "a" * 1024
    if where == "a whole head":
        head = "GET /health HTTP/1.1\r\nHost: t\r\nx-filler: " + "a" * (MAX_HEAD_BYTES + 1024) + "\r\n\r\n"
    elif where == "url":
        head = f"GET /health?{filler * (MAX_HEAD_BYTES // 1024 + 1)} HTTP/1.1\r\nHost: t\r\n"
    elif where == "headers":
        head = "GET /health HTTP/1.1\r\nHost: t\r\n" + "".join(
            f"x-filler-{i}: {filler}\r\n" for i in range(MAX_HEAD_BYTES // 1024 + 1))
    else:  # a value that never ends: httptools holds it whole until its line does
        head = "GET /health HTTP/1.1\r\nHost: t\r\nx-filler: " + filler * (MAX_HEAD_BYTES // 1024 + 1)
    with socket.create_connection(host_port(stack.http_url), timeout=10) as sock:
        sock.sendall(head.encode())  # never finished: the gateway answers as soon as the bound is passed
        data = _read_to_close(sock)
    assert data.startswith(b"HTTP/1.1 400") and b"Request head larger than" in data, data[:200]
    assert httpx.get(stack.http_url + "/health", timeout=10).status_code == 200


def test_a_gateway_on_h11_and_asyncio_serves_as_the_default_does(stack):
    """--http h11 --loop asyncio: the pure-Python fallbacks, with the same limits."""
    with another_gateway(stack, "--http", "h11", "--loop", "asyncio") as client:
        reply = client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["meta_info"]["completion_tokens"] == 4
        too_long = client.post("/generate", content=b"{}", headers={"x-filler": "a" * (MAX_HEAD_BYTES + 1)})
        assert too_long.status_code in (400, 431), too_long.text


# -- stop strings -----------------------------------------------------------------------------------------


def test_stop_strings_are_bounded(stack, model):
    too_many = ["ab"] * (DEFAULTS.max_stop_strings + 1)
    too_long = "a" * (DEFAULTS.max_stop_length + 1)

    def status(response):
        return response.status_code, response.json()

    for stop, word in ((too_many, f"{DEFAULTS.max_stop_strings + 1} stop strings"),
                       ([too_long], f"{DEFAULTS.max_stop_length + 1} characters"),
                       (too_long, f"{DEFAULTS.max_stop_length + 1} characters")):
        assert_error(status(post(stack.http_url, "/generate", {"text": "hi", "sampling_params": {
            "max_new_tokens": 2, "stop": stop}})), 400, "sampling_params.stop", word, "max_stop")
        assert_error(status(post(stack.http_url, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": stop})),
            400, "stop", word)
        assert_error(status(post(stack.http_url, "/v1/completions", {
            "model": model, "prompt": "hi", "max_tokens": 2, "stop": stop})), 400, "stop", word)
    with FlatwireClient(stack.grpc_address) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate("hi", max_new_tokens=2, stop=too_many)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("stop:") and "max_stop_strings" in refused.value.details()
    # At the limits: served.
    at_limit = [f"{i:04d}" + "z" * (DEFAULTS.max_stop_length - 4) for i in range(DEFAULTS.max_stop_strings)]
    response = post(stack.http_url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2,
                                                                                     "stop": at_limit}})
    assert response.status_code == 200, response.text[:300]


# -- response size (logprob values) -----------------------------------------------------------------------


def test_the_bound_counts_the_rows_a_response_would_carry():
    """A prompt from position 0 has a row for every token but the first; from position s, for s on."""
    params = LogprobParams(return_logprob=True, top_logprobs_num=4, token_ids_logprob=[1, 2], logprob_start_len=0)
    assert logprob_elements(1025, 0, params) == (1024, 6)
    assert logprob_elements(1025, 16, dataclasses.replace(params, logprob_start_len=25)) == (1016, 6)
    assert logprob_elements(1025, 16, dataclasses.replace(params, logprob_start_len=-1)) == (16, 6)


def test_the_response_a_request_asks_for_is_bounded(stack, model):
    """positions x (k + ids): the issue's 1000-token prompt from position 0 (999 rows: the first token has
    none) at top-256 with 4000 ids is (999 + 128) x 4256 = 4.8M values, past the 4Mi default; each API names
    its own fields."""
    limit = DEFAULTS.max_logprob_elements
    prompt = list(range(1000, 2000))
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 256,
            "token_ids_logprob": list(range(4000))}
    response = post(stack.http_url, "/generate", body)
    assert_error((response.status_code, response.json()), 400, "top_logprobs_num", "4796512", str(limit),
                 "sampling_params.max_new_tokens", "logprob_start_len", "token_ids_logprob")
    # ids alone name token_ids_logprob
    response = post(stack.http_url, "/generate", {**body, "top_logprobs_num": 0,
                                                  "token_ids_logprob": list(range(4000)) * 2})
    assert_error((response.status_code, response.json()), 400, "token_ids_logprob", str(limit))
    # a batch counts all its prompts: 8 x 128 positions x 4256 values
    response = post(stack.http_url, "/generate", {**body, "input_ids": [[1, 2, 3]] * 8, "logprob_start_len": -1})
    assert_error((response.status_code, response.json()), 400, "top_logprobs_num", "8 generations")
    # without logprobs nothing is counted
    response = post(stack.http_url, "/generate", {**body, "return_logprob": False,
                                                  "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 200, response.text[:300]
    # completions: echo x n; chat: max_tokens x top_logprobs x n
    response = post(stack.http_url, "/v1/completions", {"model": model, "prompt": prompt, "echo": True,
                                                        "logprobs": 256, "max_tokens": 16, "n": 17})
    assert_error((response.status_code, response.json()), 400, "logprobs", "echo", "x n", str(limit))
    response = post(stack.http_url, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 256,
        "max_tokens": 4000, "n": 5})
    assert_error((response.status_code, response.json()), 400, "top_logprobs", str(limit))
    with FlatwireClient(stack.grpc_address) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(input_ids=prompt, max_new_tokens=128, top_logprobs_num=256, logprob_start_len=0,
                            token_ids_logprob=list(range(4000)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("top_logprobs_num:") and "sampling.max_new_tokens" in \
        refused.value.details()


# -- gRPC message size ------------------------------------------------------------------------------------


def test_the_public_grpc_server_refuses_a_message_past_the_request_limit(stack):
    """A 40 MB message (the issue sent 900 MB) is refused as its length arrives: RESOURCE_EXHAUSTED, and
    refusing more of them keeps nothing. The first grows the gateway by a bounded amount (130-170 MB here,
    no more for a 200 MB message), which the next ones reuse."""
    pid = stack.procs["gateway"].proc.pid
    request = public.GenerateRequest(text="a" * (40 << 20), sampling=public.SamplingParams(max_new_tokens=2))

    def send() -> grpc.RpcError:
        with grpc.insecure_channel(stack.grpc_address, options=message_options(1024)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(public.GENERATION.calls(channel)["Generate"](request, timeout=60))
        return refused.value

    send()
    before = steady_rss_mb(pid)  # the gateway grows for a second after its first refusal
    for _ in range(3):
        refused = send()
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
        assert "larger than max" in refused.details()
    assert settled_rss_mb(pid) - before < 20


# -- nothing left behind by rejected requests --------------------------------------------------------------


def test_rejected_20mb_bodies_leave_the_gateway_as_it_was(stack, model):
    """/generate with 20 MB of text: a 400 that neither tokenizes it (it cannot fit 4096 tokens: more
    than 128 bytes a token) nor leaves memory behind. 50 of them (plus 10 each through completions,
    chat, a 20 MB stop string, and gRPC text and stop) leave the gateway's RSS within 10 MB of where it
    was after warm-up."""
    pid = stack.procs["gateway"].proc.pid
    text = words_text(20_000_000)
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 2}}).encode()
    completion = json.dumps({"model": model, "prompt": text, "max_tokens": 2}).encode()
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}).encode()
    # refused by a validator this time (pydantic keeps the input and the exception in its error)
    stop = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": [text]}}).encode()
    headers = {"Content-Type": "application/json"}

    def rejected(client: httpx.Client, path: str, content: bytes) -> None:
        response = client.post(path, content=content, headers=headers)
        assert response.status_code == 400, response.text[:300]
        assert "at least" in response.json()["error"]["message"] or "max_stop_length" in response.text

    with httpx.Client(base_url=stack.http_url, timeout=120) as client, \
            FlatwireClient(stack.grpc_address) as grpc_client:
        def rejected_grpc():
            for request in ({"text": text}, {"text": "hi", "stop": [text]}):
                with pytest.raises(grpc.RpcError) as refused:
                    grpc_client.generate(max_new_tokens=2, **request)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        for _ in range(5):  # warm-up: every path once or more
            rejected(client, "/generate", body)
            rejected(client, "/v1/completions", completion)
            rejected(client, "/v1/chat/completions", chat)
            rejected(client, "/generate", stop)
            rejected_grpc()
        assert client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).is_success
        start = settled_rss_mb(pid)
        started = time.perf_counter()
        peak = start
        for i in range(50):
            rejected(client, "/generate", body)
            if i % 5 == 0:
                rejected(client, "/v1/completions", completion)
                rejected(client, "/v1/chat/completions", chat)
                rejected(client, "/generate", stop)
                rejected_grpc()
            peak = max(peak, rss_mb(pid))
        elapsed = time.perf_counter() - started
    end = settled_rss_mb(pid)
    print(f"100 rejected 20 MB requests in {elapsed:.1f} s: RSS {start:.0f} MB -> {end:.0f} MB (peak {peak:.0f})")
    assert end - start < 10


# -- the event loop stays free --------------------------------------------------------------------------


@contextmanager
def probing_health(url: str, interval: float = 0.01):
    """Latencies of GET /health, probed every `interval` while the block runs."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get(url + "/health")
                latencies.append(time.perf_counter() - started)
                time.sleep(interval)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.3)
    try:
        yield latencies
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_health_answers_while_long_prompts_are_tokenized(stack, api):
    """Four 500 KB prompts (under the 512 KiB that could still fit, so they are tokenized: ~240k tokens
    each, then refused as too long) keep the tokenizer busy; /health keeps answering within 50 ms.
    Before, gRPC tokenized on the event loop: 20 MB froze /health for 11.8 s."""
    texts = [words_text(500_000, seed) for seed in range(4)]
    stack.wait_warm()  # the gateway's startup thread (its renderers' tables) is not what is measured

    def one(text):
        if api == "grpc":
            with FlatwireClient(stack.grpc_address) as client:
                with pytest.raises(grpc.RpcError) as refused:
                    client.generate(text, max_new_tokens=2)
            return refused.value.details()
        return post(stack.http_url, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}}).text

    with probing_health(stack.http_url) as latencies:
        started = time.perf_counter()
        first = len(latencies)
        threads = [threading.Thread(target=lambda t=text: answers.append(one(t))) for text in texts]
        answers: list[str] = []
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        busy = time.perf_counter() - started
        during = latencies[first:]
    assert len(answers) == 4 and all("the prompt has" in answer and "tokens" in answer for answer in answers)
    during_ms = sorted(latency * 1000 for latency in during)
    p90 = during_ms[int(0.9 * (len(during_ms) - 1))]
    print(f"{api}: tokenizing for {busy:.2f} s; {len(during_ms)} /health probes: median "
          f"{statistics.median(during_ms):.1f} ms, p90 {p90:.1f} ms, max {during_ms[-1]:.1f} ms")
    assert len(during_ms) >= 10
    assert statistics.median(during_ms) < 50 and p90 < 50
    assert during_ms[-1] < 500  # one slow probe is this shared machine; a blocked loop would be seconds


# -- admission control ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight(model_dir, log_dir) -> Iterator[Stack]:
    """One running slot and a waiting list of one (the scheduler holds 2); a gateway admitting 2
    generations (batches of 2) with 1 s read timeouts; a second gateway ("gateway-1") with the automatic limits."""
    stack = Stack(model_dir, log_dir, scheduler_args=("--max-running-requests", "1", "--max-waiting-requests", "1"),
                  gateway_args=("--max-batch-size", "2", "--max-outstanding-requests", "2",
                                "--http-header-timeout-s", "1", "--http-body-timeout-s", "1"))
    stack.add("gateway")
    with stack:
        yield stack.start()


LONG = {"text": "count", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "stream": True}


@contextmanager
def holding(url: str, count: int, expect_outstanding: int):
    """`count` long streaming generations, held open (unread) on raw sockets until the block ends."""
    body = json.dumps(LONG).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    socks = [socket.create_connection(host_port(url), timeout=30) for _ in range(count)]
    try:
        for sock in socks:
            sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while metric(url, "flatwire_outstanding_generations") < expect_outstanding:
            assert time.monotonic() < deadline, "the held generations were not admitted"
            time.sleep(0.1)
        yield
    finally:
        for sock in socks:
            sock.close()


def _wait_idle(stack: Stack) -> None:
    """Until the gateway has no generation out and the scheduler holds none (it drops an aborted one at its next
    step, after the gateway has let go of it)."""
    deadline = time.monotonic() + 30
    while metric(stack.http_url, "flatwire_outstanding_generations") > 0 or stack.stats().running or \
            stack.stats().waiting:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_past_the_gateways_limit_requests_get_429(tight):
    assert metric(tight.http_url, "flatwire_admission_limit") == 2
    rejected = metric(tight.http_url, "flatwire_admission_rejected_total", 'queue="gateway"')
    with holding(tight.http_url, 2, expect_outstanding=2):
        response = post(tight.http_url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert response.headers["retry-after"] == "1"
        error = assert_error((response.status_code, response.json()), 429, None, "max_outstanding_requests")
        assert error["type"] == "RateLimitError"
        with FlatwireClient(tight.grpc_address) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate("hi", max_new_tokens=2)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert metric(tight.http_url, "flatwire_admission_rejected_total", 'queue="gateway"') == rejected + 2
        assert metric(tight.http_url, "flatwire_request_errors_total", 'endpoint="/generate",status="429"') >= 1
    _wait_idle(tight)
    response = post(tight.http_url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200, response.text[:300]


def test_a_batch_is_admitted_whole_or_refused_whole(tight):
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}
    with holding(tight.http_url, 1, expect_outstanding=1):
        response = post(tight.http_url, "/generate", batch)
        assert_error((response.status_code, response.json()), 429, None, "2 generations")
        assert metric(tight.http_url, "flatwire_outstanding_generations") == 1  # none of the batch started
    _wait_idle(tight)
    response = post(tight.http_url, "/generate", batch)
    assert response.status_code == 200 and len(response.json()) == 2, response.text[:300]


def test_past_the_schedulers_waiting_list_requests_get_429(tight):
    """The first gateway fills the scheduler (1 running, 1 waiting); the second gateway, far from its own
    limit, gets RESOURCE_EXHAUSTED from the scheduler and answers 429 too, the replica kept in rotation."""
    second = tight.services["gateway-1"].http_url
    # max(2 x 4096, 8 x 1 slot): the largest request holds half the automatic admission at most
    assert metric(second, "flatwire_admission_limit") == 2 * DEFAULTS.max_batch_size
    with holding(tight.http_url, 2, expect_outstanding=2):
        response = post(second, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert response.headers["retry-after"] == "1"
        assert_error((response.status_code, response.json()), 429, None, "max_waiting_requests")
        assert metric(second, "flatwire_admission_rejected_total", 'queue="scheduler"') == 1
        assert httpx.get(second + "/health", timeout=10).json()["healthy"]
    _wait_idle(tight)
    deadline = time.monotonic() + 30
    while (response := post(second, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
           ).status_code == 429:  # the scheduler drops the aborted requests at its next step
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert response.status_code == 200, response.text[:300]


# -- clients that stop reading --------------------------------------------------------------------------

# A response of about 15 MB (every prompt position's top-256 with their texts): more than the kernel's socket
# buffers and the transport's hold, so a client that reads nothing leaves the gateway with bytes waiting.
BIG_RESPONSE = {"input_ids": list(range(1000, 2500)), "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": 256, "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 1}}


TCP_ESTABLISHED = "01"  # Linux's tcp_states.h, as /proc/net/tcp writes it


def _request_unread(url: str) -> socket.socket:
    body = json.dumps(BIG_RESPONSE).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the gateway's side fills up
    sock.connect(host_port(url))
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _read_all(sock: socket.socket, pause_s: float = 0.0) -> bytes:
    data = bytearray()
    sock.settimeout(30)
    try:
        while chunk := sock.recv(256 * 1024):
            data += chunk
            time.sleep(pause_s)
    except (ConnectionResetError, TimeoutError):
        pass
    return bytes(data)


def _wait_cut(sock: socket.socket, timeout_s: float) -> None:
    """Until the gateway has closed its end of `sock`'s connection (its socket in /proc/net/tcp leaves
    ESTABLISHED). The client cannot tell yet: the bytes the gateway's kernel still holds reach it first."""
    client_port, server_port = sock.getsockname()[1], sock.getpeername()[1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [fields[3] for fields in (line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:])
                  if int(fields[1].rsplit(":", 1)[1], 16) == server_port
                  and int(fields[2].rsplit(":", 1)[1], 16) == client_port]
        if states != [TCP_ESTABLISHED]:
            return
        time.sleep(0.1)


def test_a_client_that_reads_nothing_is_cut_and_a_slow_one_is_not(stack):
    with another_gateway(stack, "--http-write-timeout-s", "2") as http:
        url = str(http.base_url).rstrip("/")
        stalled = _request_unread(url)
        _wait_cut(stalled, 30)  # the response is rendered and sent by ~5 s here; cut 2 s after the buffers filled
        stalled_got = _read_all(stalled)
        slow = _request_unread(url)
        got = _read_all(slow, pause_s=0.001)  # a few KB (its window) at a time, a pause after each: never stalled
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))
        assert b"200 OK" in head and len(body) == length > 8 << 20, (len(body), length)
        assert len(stalled_got) < length - 1024, "a client that read nothing past the write timeout was not cut"
        assert http.get("/health").status_code == 200
