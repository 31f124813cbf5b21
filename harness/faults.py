"""Fault scenarios: kill, stop and restart each hop under load; count what every request got.

The three services run as separate processes on loopback (a harness.stack.Stack), as compose
runs them. For each scenario, N requests go in flight (greedy, ignore_eos, top-k logprobs; a
mix of non-streaming HTTP with flat base64 top-k, streaming HTTP, and streaming gRPC with raw
arrays), a fault is injected once every request has tokens, and each request is classified:

- identical: complete, and its ids, text and logprob bytes equal what the scheduler
  produced for it (a tap subscribed to the scheduler's step stream records that: the
  undisturbed reference, bit for bit);
- failed explicitly: HTTP 503 with an error body, a streaming error event, or gRPC
  UNAVAILABLE, with the time from the fault to the failure;
- truncated silently: a "complete" response that differs from the reference;
- hung: no end within HANG_S of the fault;
- other: anything else (e.g. HTTP 500, a stream cut without an error).

`python -m bench.faults` runs every scenario and writes RELIABILITY.md;
tests/reliability/test_faults.py runs them with fewer requests and asserts the outcomes.
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import numpy as np
import orjson
import pybase64
from flatwire_client import FlatwireClient

from harness.scheduler_client import Tap
from harness.stack import Stack

# The scenarios' scheduler: room for every request they put in flight at once (bench.faults: 48).
SCHEDULER_ARGS = ("--max-running-requests", "64")
K = 128
HANG_S = 90.0
OUTCOMES = ("identical", "failed explicitly", "truncated silently", "hung", "other")


@dataclass
class Received:
    """What one client got."""

    kind: str
    ended: float | None = None  # time.monotonic() when it ended
    status: str = ""  # "complete", "error", or what else happened
    detail: str = ""
    rid: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_logprobs: np.ndarray | None = None
    topk_values: bytes | None = None
    topk_ids: bytes | None = None


@contextmanager
def _http_errors(got: Received):
    """A client-side timeout leaves the request unended (hung); a broken connection ends it."""
    try:
        yield
    except httpx.TimeoutException:
        pass
    except httpx.HTTPError as exc:
        got.ended, got.status, got.detail = time.monotonic(), "connection lost", repr(exc)


def _http(url: str, prompt: str, tokens: int) -> Received:
    got = Received("http")
    body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": K, "return_flat_raw_output_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": True}
    with _http_errors(got):
        reply = httpx.post(f"{url}/generate", json=body, timeout=HANG_S + 60)
        got.ended = time.monotonic()
        if reply.status_code == 503:
            got.status, got.detail = "error", reply.json()["error"]["message"]
        elif reply.status_code != 200:
            got.status, got.detail = f"HTTP {reply.status_code}", reply.text[:200]
        else:
            result = reply.json()
            meta = result["meta_info"]
            reason = meta["finish_reason"]
            got.status = "complete" if reason["type"] == "length" else f"finish {reason}"
            got.rid, got.token_ids, got.text = meta["id"], result["output_ids"], result["text"]
            got.token_logprobs = np.array([row[0] for row in meta["output_token_logprobs"]], dtype="<f4")
            got.topk_values = pybase64.b64decode(meta["output_top_logprobs_val_flat_b64"])
            got.topk_ids = pybase64.b64decode(meta["output_top_logprobs_idx_flat_b64"])
    return got


def _http_stream(url: str, prompt: str, tokens: int) -> Received:
    """Streamed, so the error event counts: 200 and then `data: {"error": ...}`."""
    got = Received("http stream")
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    with _http_errors(got), httpx.stream("POST", f"{url}/generate", json=body, timeout=HANG_S + 60) as reply:
        if reply.status_code != 200:
            got.ended = time.monotonic()
            got.status = "error" if reply.status_code == 503 else f"HTTP {reply.status_code}"
            got.detail = reply.read().decode()[:200]
            return got
        last, done = None, False
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                last = orjson.loads(line[6:])
                if "error" in last:
                    got.ended, got.status, got.detail = time.monotonic(), "error", last["error"]["message"]
                    return got
        got.ended = time.monotonic()
        if not done or last is None:
            got.status = "stream cut without an error"
        else:
            reason = last["meta_info"]["finish_reason"]
            got.status = "complete" if reason and reason["type"] == "length" else f"finish {reason}"
            got.rid, got.token_ids, got.text = last["meta_info"]["id"], last["output_ids"], last["text"]
    return got


def _grpc_stream(address: str, prompt: str, tokens: int) -> Received:
    got = Received("grpc stream")
    ids, text, values, topk_ids, logprobs = [], [], [], [], []
    try:
        with FlatwireClient(address) as client:
            for chunk in client.stream(prompt, max_new_tokens=tokens, temperature=0, ignore_eos=True,
                                       top_logprobs_num=K):
                ids += chunk.token_ids.tolist()
                text.append(chunk.text)
                if chunk.output is not None:
                    logprobs.append(chunk.output.token_logprobs.tobytes())
                    values.append(chunk.output.topk_values.tobytes())
                    topk_ids.append(chunk.output.topk_ids.tobytes())
                if chunk.finish_reason is not None:
                    got.rid, got.status = chunk.rid, "complete" if chunk.finish_reason == "length" else "finish"
    except grpc.RpcError as exc:
        got.ended = time.monotonic()
        got.status = "error" if exc.code() == grpc.StatusCode.UNAVAILABLE else f"gRPC {exc.code().name}"
        got.detail = exc.details() or ""
        return got
    got.ended = time.monotonic()
    if got.status != "complete":
        got.status = got.status or "stream cut without an error"
        return got
    got.token_ids, got.text = ids, "".join(text)
    got.token_logprobs = np.frombuffer(b"".join(logprobs), dtype="<f4")
    got.topk_values, got.topk_ids = b"".join(values), b"".join(topk_ids)
    return got


CLIENTS = (_http, _http, _http, _http_stream, _grpc_stream)  # the mix, cycled over the requests


def classify(got: Received, tap: Tap, tokenizer, fault_at: float) -> str:
    if got.ended is None or got.ended - fault_at > HANG_S:
        return "hung"
    if got.status in ("error", "connection lost"):  # the client knows: never a 200
        return "failed explicitly"
    if got.status != "complete":
        return "other"
    produced = tap.requests.get(got.rid)
    if produced is None or produced.output_tokens is None:
        return "truncated silently"  # complete, yet the scheduler never finished it
    n = produced.output_tokens
    positions = range(n)
    if got.token_ids != [produced.tokens.get(p) for p in positions]:
        return "truncated silently"
    if got.text != tokenizer.decode(got.token_ids, skip_special_tokens=True):
        return "truncated silently"
    if got.topk_values is not None:
        rows = [produced.rows.get(p) for p in positions]
        if any(row is None for row in rows):
            return "truncated silently"
        if (got.token_logprobs.tobytes() != b"".join(row[0] for row in rows)
                or got.topk_values != b"".join(row[1] for row in rows)
                or got.topk_ids != b"".join(row[2] for row in rows)):
            return "truncated silently"
    return "identical"


@dataclass
class Admission:
    """A new request sent while the hop is still down, and the gateway's /health then."""

    status: int
    seconds: float
    health_status: int
    health: dict

    def note(self) -> str:
        problems = [s["problem"] for s in self.health["schedulers"].values() if s["problem"]]
        return (f"a new request then: HTTP {self.status} in {self.seconds:.2f}s; /health {self.health_status}: "
                f"{'; '.join(problems)}")


@dataclass
class ScenarioResult:
    name: str
    counts: Counter
    fail_times: list[float]  # seconds from the fault to each explicit failure
    notes: list[str]
    details: list[str]  # one example message per outcome other than identical
    admission: Admission | None = None


def probe_admission(stack: Stack) -> Admission:
    started = time.monotonic()
    reply = httpx.post(f"{stack.http_url}/generate", timeout=60,
                       json={"text": "probe", "sampling_params": {"max_new_tokens": 2}})
    seconds = time.monotonic() - started
    health = httpx.get(f"{stack.http_url}/health", timeout=10)
    return Admission(reply.status_code, seconds, health.status_code, health.json())


def _detokenizer_restarted(stack: Stack) -> list[str]:
    stack.kill("detokenizer")
    started = time.monotonic()
    stack.start("detokenizer")
    return [f"detokenizer back after {time.monotonic() - started:.1f}s"]


def _detokenizer_killed(stack: Stack) -> list[str]:
    stack.kill("detokenizer")
    return []


def _scheduler_killed(stack: Stack) -> list[str]:
    stack.kill("scheduler")
    return []


def _scheduler_terminated(stack: Stack) -> list[str]:
    stack.stop("scheduler")  # told to stop (SIGINT, as SIGTERM: a restart, a scale-down), not a crash
    return []


@contextmanager
def busy_cores() -> Iterator[None]:
    """A process spinning on each core, for as long as the block runs (a host busy with other work)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _cores_busy(stack: Stack, seconds: float = 15.0) -> list[str]:
    with busy_cores():
        time.sleep(seconds)
    return [f"every core spun by another process for {seconds:.0f}s"]


def _scheduler_stalls(stack: Stack, times: int = 3, seconds: float = 2.5) -> list[str]:
    for _ in range(times):
        stack.signal("scheduler", signal.SIGSTOP)
        time.sleep(seconds)
        stack.signal("scheduler", signal.SIGCONT)
        time.sleep(1.5)
    return [f"scheduler stopped {times} times for {seconds:g}s"]


def _scheduler_stopped(stack: Stack, seconds: float = 20.0) -> list[str]:
    stack.signal("scheduler", signal.SIGSTOP)
    time.sleep(seconds)
    stack.signal("scheduler", signal.SIGCONT)
    return [f"scheduler stopped for {seconds:.0f}s"]


def _gateway_killed(stack: Stack) -> list[str]:
    stack.kill("gateway")
    return []


@dataclass
class Scenario:
    inject: Callable[[Stack], list[str]]  # returns notes
    restart: tuple[str, ...] = ()  # services to start again afterwards
    orphans_after: str = ""  # check that the scheduler ends up idle, every request aborted, after this
    tokens_factor: int = 1  # longer requests, to outlast the detokenizer's owner grace period
    probe_admission: bool = False  # send a new request while the hop is still down


SCENARIOS = {
    "no fault": Scenario(lambda stack: []),
    "cores busy (contention)": Scenario(_cores_busy),
    "scheduler stalls of 2.5s": Scenario(_scheduler_stalls),
    "detokenizer killed and restarted": Scenario(_detokenizer_restarted),
    "detokenizer killed for good": Scenario(_detokenizer_killed, restart=("detokenizer",), probe_admission=True),
    "scheduler killed": Scenario(_scheduler_killed, restart=("scheduler",), probe_admission=True),
    "scheduler terminated": Scenario(_scheduler_terminated, restart=("scheduler",)),
    "scheduler stopped 20s": Scenario(_scheduler_stopped, orphans_after="SIGCONT"),
    "gateway killed": Scenario(_gateway_killed, restart=("gateway",), orphans_after="the gateway's death",
                               tokens_factor=3),
}


def run_scenario(stack: Stack, name: str, requests: int, tokens: int, tokenizer) -> ScenarioResult:
    scenario = SCENARIOS[name]
    tokens *= scenario.tokens_factor
    stack.wait_ready()
    aborted_before = stack.stats().aborted
    tap = Tap(stack.scheduler_address)
    tap.catch_up()
    pool = concurrent.futures.ThreadPoolExecutor(requests)
    clients = [CLIENTS[i % len(CLIENTS)] for i in range(requests)]
    futures = [pool.submit(client, stack.grpc_address if client is _grpc_stream else stack.http_url,
                           f"request {i}: a rollout", tokens) for i, client in enumerate(clients)]
    deadline = time.monotonic() + 120
    while tap.running(min_tokens=8) < requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the requests never all ran")
        time.sleep(0.02)
    fault_at = time.monotonic()
    notes = scenario.inject(stack)
    received = [future.result() for future in futures]
    pool.shutdown()
    tap.close()
    counts = Counter({outcome: 0 for outcome in OUTCOMES})
    details: dict[str, str] = {}
    fail_times = []
    for got in received:
        outcome = classify(got, tap, tokenizer, fault_at)
        counts[outcome] += 1
        if outcome == "failed explicitly":
            fail_times.append(got.ended - fault_at)
        if outcome != "identical":
            details.setdefault(outcome, f"{got.kind}: {got.status} {got.detail}".strip())
    if scenario.orphans_after:
        notes.append(_orphans_after(stack, scenario.orphans_after, aborted_before, requests))
    admission = probe_admission(stack) if scenario.probe_admission else None
    if admission:
        notes.append(admission.note())
    for service in scenario.restart:
        stack.start(service)
    return ScenarioResult(name, counts, fail_times, notes, list(details.values()), admission)


def _orphans_after(stack: Stack, event: str, aborted_before: int, requests: int, within: float = 30.0) -> str:
    """Wait until the scheduler runs nothing; say how long that took and whether every request was aborted."""
    started = time.monotonic()
    while (stats := stack.stats()).running or stats.waiting:
        if time.monotonic() - started > within:
            return f"ORPHANS: scheduler still running {stats.running} requests {within:.0f}s after {event}"
        time.sleep(0.2)
    aborted = stats.aborted - aborted_before
    prefix = "" if aborted == requests else "ORPHANS: "
    idle_after = time.monotonic() - started
    return f"{prefix}{aborted} of {requests} aborted in the scheduler, idle {idle_after:.1f}s after {event}"
