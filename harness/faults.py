"""Fault scenarios: kill, stop and restart each hop under load; count what every request got.

The three services run as separate processes on loopback, as compose runs them. For
each scenario, N requests go in flight (greedy, ignore_eos, top-k logprobs; a mix of
non-streaming HTTP with flat base64 top-k, streaming HTTP, and streaming gRPC with raw
arrays), a fault is injected once every request has tokens, and each request is
classified:

- identical: complete, and its ids, text and logprob bytes equal what the scheduler
  produced for it (a tap subscribed to the scheduler's step stream records that: the
  undisturbed reference, bit for bit);
- failed explicitly: HTTP 503 with an error body, a streaming error event, or gRPC
  UNAVAILABLE, with the time from the fault to the failure;
- truncated silently: a "complete" response that differs from the reference;
- hung: no end within HANG_S of the fault;
- other: anything else (e.g. HTTP 500, a stream cut without an error).

    python -m bench.faults                 # writes RELIABILITY.md (and bench/out/faults.{md,json})
    python -m bench.faults --requests 16   # fewer requests per scenario

tests/test_faults.py runs the same scenarios with fewer requests and asserts the
outcomes.
"""

import argparse
import concurrent.futures
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
import orjson
import pybase64
from flatwire_client import FlatwireClient
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER, SchedulerStats
from flatwire_wire.steps import StepMessage

from harness.procs import ServiceProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
K = 128
HANG_S = 90.0
LONG_HOP_TIMEOUT_S = 15.0
OUTCOMES = ("identical", "failed explicitly", "truncated silently", "hung", "other")


class Pipeline:
    """Scheduler, detokenizer and gateway as processes on fixed loopback ports, each restartable."""

    def __init__(self, model_dir: Path, log_dir: Path, gateway_args: tuple[str, ...] = (),
                 detokenizer_args: tuple[str, ...] = (), scheduler_args: tuple[str, ...] = ()):
        self.ports = {name: free_port() for name in ("scheduler", "detokenizer", "http", "grpc")}
        self.scheduler = f"127.0.0.1:{self.ports['scheduler']}"
        self.detokenizer = f"127.0.0.1:{self.ports['detokenizer']}"
        self.http_url = f"http://127.0.0.1:{self.ports['http']}"
        self.grpc_address = f"127.0.0.1:{self.ports['grpc']}"
        common = ("--model", str(model_dir))
        self.commands = {
            "scheduler": ["--port", str(self.ports["scheduler"]), "--max-running-requests", "64", *common,
                          *scheduler_args],  # later flags win: scheduler_args may replace the 64
            "detokenizer": ["--port", str(self.ports["detokenizer"]), "--schedulers", self.scheduler, *common,
                            *detokenizer_args],
            "gateway": ["--port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
                        "--schedulers", self.scheduler, "--detokenizers", self.detokenizer, *common, *gateway_args],
        }
        self._gateway_command = list(self.commands["gateway"])
        self.health = {"scheduler": self.scheduler, "detokenizer": self.detokenizer, "gateway": self.grpc_address}
        self.log_dir = log_dir
        self.procs: dict[str, ServiceProcess] = {}
        self._old: list[ServiceProcess] = []

    def start(self, name: str | None = None) -> None:
        for service in [name] if name else list(self.commands):
            if service in self.procs:
                self._old.append(self.procs[service])
            self.procs[service] = ServiceProcess(service, self.commands[service], self.log_dir)
            self.procs[service].wait_healthy(self.health[service])

    def restart_gateway(self, *args: str) -> None:
        """Stop the gateway and start it again with `args` added to its command."""
        self.procs["gateway"].stop()
        self.commands["gateway"] = [*self._gateway_command, *args]
        self.start("gateway")

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].proc.wait(timeout=30)

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the gateway admits requests again (its /health is 200)."""
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.http_url}/health", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not become healthy")
            time.sleep(0.2)

    def stats(self) -> SchedulerStats:
        with grpc.insecure_channel(self.scheduler) as channel:
            return SCHEDULER.calls(channel)["GetStats"](EMPTY, timeout=10)

    def close(self) -> None:
        for proc in [*self.procs.values(), *self._old]:
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)
            proc.stop()


@contextmanager
def running(model_dir: Path, log_dir: Path, **options) -> Iterator[Pipeline]:
    """A started Pipeline, closed (every process stopped) on the way out."""
    pipeline = Pipeline(model_dir, log_dir, **options)
    try:
        pipeline.start()
        yield pipeline
    finally:
        pipeline.close()


@dataclass
class Produced:
    """What the scheduler produced for one request, by position."""

    tokens: dict[int, int] = field(default_factory=dict)
    rows: dict[int, tuple[bytes, bytes, bytes]] = field(default_factory=dict)  # token_logprob, topk values, ids
    output_tokens: int | None = None  # from its Finish


class Tap:
    """A subscriber of the scheduler's step stream, recording every request's output."""

    def __init__(self, scheduler: str):
        self.requests: dict[str, Produced] = defaultdict(Produced)
        self.last_step = 0
        self._channel = grpc.insecure_channel(scheduler, options=[("grpc.max_receive_message_length", 1 << 30)])
        self._call = SCHEDULER.calls(self._channel)["StreamSteps"](EMPTY)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for step in self._call:
                self._record(step)
        except grpc.RpcError:
            pass  # cancelled, or the scheduler died

    def _record(self, step: StepMessage) -> None:
        self.last_step = max(self.last_step, step.step)
        for i, (rid, position) in enumerate(zip(step.rids, step.positions)):
            produced = self.requests[rid]
            entry = step.output.request(i) if step.output is not None else None
            for j, token in enumerate(step.entry_tokens(i)):
                produced.tokens[position + j] = token
                if entry is not None and entry.n:
                    produced.rows[position + j] = (entry.token_logprobs[j:j + 1].tobytes(),
                                                   entry.topk_values[j].tobytes(), entry.topk_ids[j].tobytes())
        for finish in step.finished:
            self.requests[finish.rid].output_tokens = finish.output_tokens

    def catch_up(self, pipeline: Pipeline, timeout: float = 30) -> None:
        """With the scheduler idle, until the tap has read its whole replay (earlier requests, finished)."""
        deadline = time.monotonic() + timeout
        while (stats := pipeline.stats()).running or stats.waiting or self.last_step < stats.steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"scheduler not idle, or the tap behind: {stats}")
            time.sleep(0.05)

    def running(self, min_tokens: int) -> int:
        """Requests with at least `min_tokens` tokens and no finish yet."""
        return sum(len(p.tokens) >= min_tokens and p.output_tokens is None for p in list(self.requests.values()))

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


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


def probe_admission(pipeline: Pipeline) -> Admission:
    started = time.monotonic()
    reply = httpx.post(f"{pipeline.http_url}/generate", timeout=60,
                       json={"text": "probe", "sampling_params": {"max_new_tokens": 2}})
    seconds = time.monotonic() - started
    health = httpx.get(f"{pipeline.http_url}/health", timeout=10)
    return Admission(reply.status_code, seconds, health.status_code, health.json())


def _detokenizer_restarted(pipeline: Pipeline) -> list[str]:
    pipeline.signal("detokenizer", signal.SIGKILL)
    started = time.monotonic()
    pipeline.start("detokenizer")
    return [f"detokenizer back after {time.monotonic() - started:.1f}s"]


def _detokenizer_killed(pipeline: Pipeline) -> list[str]:
    pipeline.signal("detokenizer", signal.SIGKILL)
    return []


def _scheduler_killed(pipeline: Pipeline) -> list[str]:
    pipeline.signal("scheduler", signal.SIGKILL)
    return []


def _scheduler_stopped(pipeline: Pipeline, seconds: float = 20.0) -> list[str]:
    pipeline.signal("scheduler", signal.SIGSTOP)
    time.sleep(seconds)
    pipeline.signal("scheduler", signal.SIGCONT)
    return [f"scheduler stopped for {seconds:.0f}s"]


def _gateway_killed(pipeline: Pipeline) -> list[str]:
    pipeline.signal("gateway", signal.SIGKILL)
    return []


@dataclass
class Scenario:
    inject: Callable[[Pipeline], list[str]]  # returns notes
    restart: tuple[str, ...] = ()  # services to start again afterwards
    orphans_after: str = ""  # check that the scheduler ends up idle, every request aborted, after this
    tokens_factor: int = 1  # longer requests, to outlast the detokenizer's owner grace period
    probe_admission: bool = False  # send a new request while the hop is still down


SCENARIOS = {
    "no fault": Scenario(lambda pipeline: []),
    "detokenizer killed and restarted": Scenario(_detokenizer_restarted),
    "detokenizer killed for good": Scenario(_detokenizer_killed, restart=("detokenizer",), probe_admission=True),
    "scheduler killed": Scenario(_scheduler_killed, restart=("scheduler",), probe_admission=True),
    "scheduler stopped 20s": Scenario(_scheduler_stopped, orphans_after="SIGCONT"),
    "gateway killed": Scenario(_gateway_killed, restart=("gateway",), orphans_after="the gateway's death",
                               tokens_factor=3),
}


def run_scenario(pipeline: Pipeline, name: str, requests: int, tokens: int, tokenizer) -> ScenarioResult:
    scenario = SCENARIOS[name]
    tokens *= scenario.tokens_factor
    pipeline.wait_ready()
    aborted_before = pipeline.stats().aborted
    tap = Tap(pipeline.scheduler)
    tap.catch_up(pipeline)
    pool = concurrent.futures.ThreadPoolExecutor(requests)
    clients = [CLIENTS[i % len(CLIENTS)] for i in range(requests)]
    futures = [pool.submit(client, pipeline.grpc_address if client is _grpc_stream else pipeline.http_url,
                           f"request {i}: a rollout", tokens) for i, client in enumerate(clients)]
    deadline = time.monotonic() + 120
    while tap.running(min_tokens=8) < requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the requests never all ran")
        time.sleep(0.02)
    fault_at = time.monotonic()
    notes = scenario.inject(pipeline)
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
        notes.append(_orphans_after(pipeline, scenario.orphans_after, aborted_before, requests))
    admission = probe_admission(pipeline) if scenario.probe_admission else None
    if admission:
        notes.append(admission.note())
    for service in scenario.restart:
        pipeline.start(service)
    return ScenarioResult(name, counts, fail_times, notes, list(details.values()), admission)


def _orphans_after(pipeline: Pipeline, event: str, aborted_before: int, requests: int, within: float = 30.0) -> str:
    """Wait until the scheduler runs nothing; say how long that took and whether every request was aborted."""
    started = time.monotonic()
    while (stats := pipeline.stats()).running or stats.waiting:
        if time.monotonic() - started > within:
            return f"ORPHANS: scheduler still running {stats.running} requests {within:.0f}s after {event}"
        time.sleep(0.2)
    aborted = stats.aborted - aborted_before
    prefix = "" if aborted == requests else "ORPHANS: "
    idle_after = time.monotonic() - started
    return f"{prefix}{aborted} of {requests} aborted in the scheduler, idle {idle_after:.1f}s after {event}"


def table(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | " + " | ".join(OUTCOMES) + " | time to fail (max) | notes |",
             "|---" * (len(OUTCOMES) + 3) + "|"]
    for result in results:
        worst = f"{max(result.fail_times):.1f} s" if result.fail_times else "-"
        notes = "; ".join(result.notes + result.details)
        lines.append(f"| {result.name} | " + " | ".join(str(result.counts[o]) for o in OUTCOMES)
                     + f" | {worst} | {notes} |")
    return "\n".join(lines)


def main() -> None:
    from transformers import AutoTokenizer

    from bench.common import machine_line
    from services.common.model_store import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = parser.parse_args()
    model_dir = resolve_model(None, None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    log_dir = ROOT / "bench" / "out" / "faults-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with running(model_dir, log_dir) as pipeline:
        for name in args.scenarios:
            print(f"{name} ...", flush=True)
            results.append(run_scenario(pipeline, name, args.requests, args.tokens, tokenizer))
            print(table(results[-1:]).splitlines()[-1], flush=True)
        if "detokenizer killed and restarted" in args.scenarios:
            # The same restart, with a hop timeout longer than the detokenizer takes to come back.
            pipeline.restart_gateway("--hop-timeout-s", str(LONG_HOP_TIMEOUT_S))
            result = run_scenario(pipeline, "detokenizer killed and restarted", args.requests, args.tokens,
                                  tokenizer)
            result.name += f" (--hop-timeout-s {LONG_HOP_TIMEOUT_S:.0f})"
            results.append(result)
            print(table(results[-1:]).splitlines()[-1], flush=True)
    command = "python -m bench.faults " + " ".join(
        f"--{k} {v}" for k, v in (("requests", args.requests), ("tokens", args.tokens)))
    report = ROOT / "RELIABILITY.md"
    fuzzing = report.read_text().partition("\n## Fuzzing\n") if report.exists() else ("", "", "")
    report.write_text(REPORT.format(command=command, machine=machine_line(), requests=args.requests,
                                    tokens=args.tokens, k=K, table=table(results))
                      + (f"\n## Fuzzing\n{fuzzing[2]}" if fuzzing[1] else ""))
    print("RELIABILITY.md written")


REPORT = """# Reliability

What each request got when a hop was killed, stopped or restarted under load (`bench/faults.py`;
the invariants are in docs/reliability.md). Target: 0 truncated silently, 0 hung, in every row.

Command: `{command}`. Machine: {machine}.
Per scenario: {requests} requests in flight ({tokens} tokens each, greedy, ignore_eos; non-streaming HTTP
with flat base64 top-{k}, streaming HTTP, streaming gRPC with raw top-{k} arrays), the services as separate
processes with default settings (hop timeout 5 s), the fault injected once every request had 8 tokens.
"identical" means ids, text and the logprob bytes equal what the scheduler produced, as recorded by a
subscriber of its step stream. "time to fail" is from the fault to the last explicit failure.

{table}
"""


if __name__ == "__main__":
    main()
