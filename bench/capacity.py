"""Capacity: the tokens/s the detokenizer and gateway deliver against a synthetic scheduler's offer.

The scheduler runs `--engine synthetic --step-ms S` (no weights: one token per running
request every S ms, the default model's real vocabulary), so it offers C x 1000 / S
tokens/s with C requests running; the real detokenizer and gateway run beside it,
each its own process (harness.stack.Stack). C closed-loop HTTP clients each send
POST /generate (a 16-token prompt, max_new_tokens N, ignore_eos) again as soon as the
last one ends, for a warm-up and then a measured window. Per configuration (C x k x
format x mode):

- delivered tokens/s: output tokens of the requests that completed in the window,
  over the window; and its fraction of the offer;
- CPU microseconds per delivered token of each service process (utime + stime from
  /proc/PID/stat, before and after the window), and of this client process, which
  shares the cores;
- the scheduler's measured step time (its steps over the window: above S when the
  scheduler's own output building falls behind), median and p99 request latency,
  and errors (non-200 replies, error events, transport failures).

Formats: flat_b64 (`return_flat_raw_output_top_logprobs` + `_b64`: base64 <f4/<i4
arrays) and nested ([logprob, id, text] rows); k=0 is `return_logprob: false`, one
row per mode whatever the formats (flat_b64 streams each event's rows only).
Non-streaming rows are run at each
--output-intervals value (50, the default, and 1: a message per token, everything
else equal), so the same run shows what coalescing saves. --gateway-workers runs each
configuration with that many gateway processes sharing the HTTP port (--reuse-port, as
`flatwire up --gateway-workers N`); their CPU is summed. --patterns burst has the C clients
submit together and again once every reply is in (an RL rollout's batch), measured over
--burst-rounds rounds after a first; --clients httpx sends through an httpx.AsyncClient per
client (its own connection), httpx-pool through one AsyncClient shared by all (a pooled
connection each), rather than the minimal client.

    python -m bench.capacity                  # the full matrix: writes bench/out/capacity.{md,json}
    python -m bench.capacity --concurrency 32 --k 128 --formats flat_b64 --modes nonstream --duration 5
    python -m bench.capacity --concurrency 512 --modes stream --gateway-workers 1,2 --name capacity_workers
    python -m bench.capacity --concurrency 512 --k 128 --formats flat_b64 --modes nonstream --output-intervals 50 \
        --patterns spread,burst --clients raw,httpx,httpx-pool --name capacity_bursts
    python -m bench.capacity --replot         # redraw bench/plots/capacity.png (needs matplotlib)
"""

import argparse
import asyncio
import os
import re
import shlex
import ssl
import statistics
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.common import OUT_DIR, Progress, Table, write_results
from bench.e2e import cpu_seconds
from harness.stack import Stack, running
from services.common.model_store import resolve_model

PROMPT_IDS = list(range(1000, 1016))  # a fixed 16-token prompt
SERVICES = ("scheduler", "detokenizer", "gateway")
FORMATS = ("flat_b64", "nested")
MODES = ("nonstream", "stream")
PATTERNS = ("spread", "burst")
ROUND_TIMEOUT_S = 120  # one burst round (a request's whole generation), at most
CLIENTS = ("raw", "httpx", "httpx-pool")
FLAT_B64 = {"return_flat_raw_top_logprobs": True, "return_flat_raw_output_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": True}
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
PLOT = Path(__file__).resolve().parent / "plots" / "capacity.png"


@dataclass(frozen=True)
class Config:
    concurrency: int
    k: int
    format: str  # flat_b64, nested, or "-" (k=0)
    mode: str  # nonstream or stream
    interval: int = 50  # the scheduler's --output-interval: tokens per entry of a request that does not stream
    gateways: int = 1  # gateway processes behind the HTTP port
    pattern: str = "spread"  # spread: each client resubmits when its request ends; burst: all at once, together
    client: str = "raw"  # raw: Connection below; httpx, httpx-pool: httpx.AsyncClient, as a Python user's client

    def body(self, tokens: int) -> bytes:
        body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
                "stream": self.mode == "stream"}
        if self.k:
            body.update(return_logprob=True, top_logprobs_num=self.k, **(FLAT_B64 if self.format == "flat_b64" else {}))
        return orjson.dumps(body)


def configs(args) -> list[Config]:
    return [Config(c, k, fmt, mode, interval, gateways, pattern, client) for gateways in args.gateway_workers
            for interval in args.output_intervals for c in args.concurrency
            for k in args.k for fmt in (args.formats if k else ["-"]) for mode in args.modes
            for pattern in args.patterns for client in args.clients
            if mode == "nonstream" or interval == args.output_intervals[0]]  # the interval is for nonstream


@dataclass
class Reply:
    start: float
    end: float
    tokens: int  # completion_tokens of its last event; -1: an error
    error: str = ""  # what the error was


def check(body: bytes, config: Config, tokens: int) -> str:
    """'' when one complete reply has the asked shape, else what is wrong (a format the gateway did not give)."""
    meta = orjson.loads(body)["meta_info"]
    if meta["completion_tokens"] != tokens:
        return f"completion_tokens {meta['completion_tokens']}"
    if config.k and config.mode == "nonstream":
        shape = (meta.get("output_top_logprobs_shape") if config.format == "flat_b64" else
                 [len(meta.get("output_top_logprobs") or []), len((meta.get("output_top_logprobs") or [[]])[0])])
        if shape != [tokens, config.k]:
            return f"top logprobs shape {shape}"
    return ""


class Connection:
    """One keep-alive HTTP/1.1 connection, as lean as a client can be: the clients share this machine's two
    cores with the services, and a full HTTP library (httpx: ~60 us per delivered token at k=128) would
    measure itself. Reads Content-Length bodies and chunked (SSE) ones."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body); for a chunked body, its last chunk that carries data."""
        return await self.request("POST", path, body)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 24)
        self.writer.write(b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (method.encode(), path.encode(), self.host.encode(),
                                                               len(body), body))
        status = int((await self.reader.readline()).split()[1])
        length, chunked = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                chunked = True
        if not chunked:
            return status, await self.reader.readexactly(length)
        last = b""
        while size := int((await self.reader.readline()).strip(), 16):
            chunk = await self.reader.readexactly(size + 2)  # the chunk and its CRLF
            if COMPLETION_TOKENS.search(chunk):
                last = chunk
        await self.reader.readline()  # the CRLF after the last (empty) chunk
        return status, last

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


class HttpxConnection:
    """The same calls through an httpx.AsyncClient (the client's own, or one shared)."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body); for an event stream, its last 64 kB (the events that carry completion_tokens)."""
        async with self.client.stream("POST", path, content=body,
                                      headers={"content-type": "application/json"}) as reply:
            if not reply.headers.get("content-type", "").startswith("text/event-stream"):
                return reply.status_code, await reply.aread()
            tail = b""
            async for chunk in reply.aiter_bytes():
                tail = (tail + chunk)[-65536:]
            return reply.status_code, tail

    def close(self) -> None:
        """httpx drops a broken connection itself; connections() closes the clients."""


class Failed(Exception):
    """A reply that is not a complete generation: its status, or its error event."""


async def generate(connection: "Connection | HttpxConnection", body: bytes, stream: bool) -> bytes:
    """The reply's body (streaming: its last event that carries completion_tokens)."""
    status, content = await connection.post("/generate", body)
    if status != 200 or (stream and b'"error"' in content):
        raise Failed(f"HTTP {status}: {content[:200]!r}")
    if stream:  # the chunk's last complete data event
        events = [e for e in content.split(b"data: ") if COMPLETION_TOKENS.search(e)]
        if not events:
            raise Failed("no event with completion_tokens")
        return events[-1].strip()
    return content


async def attempt(connection: "Connection | HttpxConnection", body: bytes, stream: bool, replies: list[Reply],
                  first: list[bytes], start: float) -> None:
    """One request, recorded in `replies` (and the first complete one in `first`)."""
    try:
        content = await generate(connection, body, stream)
    except (Failed, OSError, ValueError, IndexError, asyncio.IncompleteReadError, httpx.HTTPError) as exc:
        connection.close()
        replies.append(Reply(start, time.perf_counter(), -1, f"{type(exc).__name__}: {exc}"[:200]))
        return
    # One event, or one body whose meta_info follows text and output_ids: the first match is the one (a string
    # value cannot hold it: its quotes are escaped), found without scanning a 350 kB body to its end.
    found = COMPLETION_TOKENS.search(content)
    replies.append(Reply(start, time.perf_counter(), int(found[1]) if found else -1,
                         "" if found else "no completion_tokens"))
    if found and not first:
        first.append(content)


async def client_loop(connect: Callable[[], "Connection | HttpxConnection"], body: bytes, stream: bool,
                      delay: float, replies: list[Reply], first: list[bytes]) -> None:
    await asyncio.sleep(delay)  # clients start spread over one request's time, so completions spread too
    connection = connect()
    try:
        while True:
            await attempt(connection, body, stream, replies, first, time.perf_counter())
    finally:
        connection.close()


async def burst_rounds(connect: Callable[[], "Connection | HttpxConnection"], body: bytes, stream: bool,
                       concurrency: int, replies: list[Reply], first: list[bytes], rounds: list[float]) -> None:
    """Every client submits at once, and again once all of them have their reply (an RL rollout's batch);
    `rounds` gets the time each round ends."""
    connections = [connect() for _ in range(concurrency)]
    try:
        while True:
            start = time.perf_counter()
            await asyncio.gather(*(attempt(c, body, stream, replies, first, start) for c in connections))
            rounds.append(time.perf_counter())
    finally:
        for connection in connections:
            connection.close()


def snapshot(stack: Stack, pids: dict[str, list[int]]) -> tuple[float, dict[str, float], int]:
    cpu = {name: sum(map(cpu_seconds, each)) for name, each in pids.items()}
    return time.perf_counter(), cpu, stack.stats().steps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


async def rounds_done(rounds: list[float], count: int, task: asyncio.Task) -> None:
    """Until `count` burst rounds have ended; TimeoutError when a round takes ROUND_TIMEOUT_S, and what stopped
    the rounds if they stopped."""
    seen, deadline = len(rounds), time.monotonic() + ROUND_TIMEOUT_S
    while len(rounds) < count:
        if task.done():
            task.result()
            raise RuntimeError("the burst rounds ended early")
        if len(rounds) > seen:  # a round ended: the next one gets its own time
            seen, deadline = len(rounds), time.monotonic() + ROUND_TIMEOUT_S
        if time.monotonic() > deadline:
            raise TimeoutError(f"a burst round took more than {ROUND_TIMEOUT_S} s")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def connections(config: Config, url: str) -> AsyncIterator[Callable[[], "Connection | HttpxConnection"]]:
    """What a client opens its connection with: a raw one, an httpx client of its own, or the shared httpx pool.

    A shared pool costs its process O(connections) per request event (httpcore scans every pooled connection to
    assign each request): at C=512 that is several ms of client CPU per request, so httpx-pool measures the pool
    as much as the server."""
    if config.client == "raw":
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield lambda: Connection(host, int(port))
        return
    if config.client == "httpx":  # one TLS context for all: each client building its own takes ~50 ms of CPU
        tls = ssl.create_default_context()
        async with AsyncExitStack() as owned:
            yield lambda: HttpxConnection(owned.push_async_exit(httpx.AsyncClient(base_url=url, timeout=None,
                                                                                  verify=tls)))
        return
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        yield lambda: HttpxConnection(client)


async def measure(stack: Stack, pids: dict[str, list[int]], config: Config, args) -> dict:
    """spread: a window of --duration s after --warmup s; burst: --burst-rounds rounds after a first one."""
    body, stream = config.body(args.tokens), config.mode == "stream"
    replies: list[Reply] = []
    first: list[bytes] = []
    rounds: list[float] = []
    async with connections(config, stack.http_url) as connect:
        if config.pattern == "burst":
            task = asyncio.create_task(burst_rounds(connect, body, stream, config.concurrency, replies, first,
                                                    rounds))
            tasks = [task]
            await rounds_done(rounds, 1, task)  # the first round warms up
            t0, cpu0, steps0 = snapshot(stack, pids)
            await rounds_done(rounds, 1 + args.burst_rounds, task)
            t1, cpu1, steps1 = snapshot(stack, pids)
        else:
            spread = min(args.warmup, args.tokens * args.step_ms / 1e3)
            tasks = [asyncio.create_task(client_loop(connect, body, stream, i * spread / config.concurrency, replies,
                                                     first)) for i in range(config.concurrency)]
            await asyncio.sleep(args.warmup)
            t0, cpu0, steps0 = snapshot(stack, pids)
            await asyncio.sleep(args.duration)
            t1, cpu1, steps1 = snapshot(stack, pids)
        for task in tasks:  # requests still in flight are cut (the gateway aborts them)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = t1 - t0
    done = [r for r in replies if t0 <= r.end <= t1]
    ok = [r for r in done if r.tokens >= 0]
    delivered = sum(r.tokens for r in ok) / wall
    offered = config.concurrency * 1e3 / args.step_ms if args.step_ms else float("inf")
    latencies = [r.end - r.start for r in ok]
    return {
        **config.__dict__, "offered_tok_s": offered, "delivered_tok_s": delivered,
        "fraction": delivered / offered, "requests": len(ok), "errors": len(done) - len(ok),
        "error_kinds": sorted({r.error for r in done if r.tokens < 0}),
        "check": check(first[0], config, args.tokens) if first else "no complete reply",
        "reply_bytes": len(first[0]) if first else 0,  # of a whole response; streaming: of its last event
        "cpu_s": {name: cpu1[name] - cpu0[name] for name in pids}, "wall_s": wall,
        "us_per_token": {name: (cpu1[name] - cpu0[name]) * 1e6 / max(1.0, delivered * wall) for name in pids},
        "step_ms_measured": wall * 1e3 / max(1, steps1 - steps0),
        "latency_p50_s": statistics.median(latencies) if latencies else float("nan"),
        "latency_p99_s": percentile(latencies, 0.99),
    }


def wait_idle(stack: Stack, timeout: float = 120.0) -> None:
    """Until the scheduler holds no request (cut requests are aborted or run out)."""
    deadline = time.monotonic() + timeout
    while (stats := stack.stats()).running or stats.waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler did not drain: {stats}")
        time.sleep(0.2)


def table(rows: list[dict], args) -> Table:
    columns = ["C", "k", "format", "mode", "interval", "gateways", "pattern", "client", "offered tok/s",
               "delivered tok/s", "of offer",
               *(f"{s} us/tok" for s in (*SERVICES, "client")), "step ms", "p50 s", "p99 s", "errors"]
    out = Table(f"Capacity: {args.tokens}-token requests, synthetic step {args.step_ms:g} ms", columns,
                "us/tok: CPU microseconds per delivered token of each process (client: this benchmark's HTTP "
                "clients, on the same cores). step ms: the scheduler's measured step time in the window.")
    for r in rows:
        interval = r.get("interval", 50) if r["mode"] == "nonstream" else 1
        head = [r["concurrency"], r["k"], r["format"], r["mode"], interval, r.get("gateways", 1),
                r.get("pattern", "spread"), r.get("client", "raw")]
        us = r["us_per_token"]
        out.add(*head, f"{r['offered_tok_s']:,.0f}", f"{r['delivered_tok_s']:,.0f}", f"{r['fraction']:.0%}",
                *(f"{us[s]:.1f}" for s in (*SERVICES, "client")), f"{r['step_ms_measured']:.1f}",
                f"{r['latency_p50_s']:.2f}", f"{r['latency_p99_s']:.2f}",
                f"{r['errors']}" + (f" (check: {r['check']})" if r["check"] else "")
                + (f" ({'; '.join(r['error_kinds'])})" if r.get("error_kinds") else ""))
    return out


def plot(rows: list[dict]) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return None
    lines: dict[str, list[dict]] = {}
    for r in rows:
        interval = [f"every {r.get('interval', 50)}"] if r["mode"] == "nonstream" else []
        name = " ".join([f"k={r['k']}", *([r["format"]] if r["k"] else []), r["mode"], *interval])
        lines.setdefault(name, []).append(r)
    fig, (rate, cost) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in lines.items():
        points.sort(key=lambda p: p["offered_tok_s"])
        xs = [p["offered_tok_s"] for p in points]
        rate.plot(xs, [p["delivered_tok_s"] for p in points], marker="o", label=name)
        cost.plot(xs, [p["us_per_token"]["gateway"] for p in points], marker="o", label=name)
    offers = [r["offered_tok_s"] for r in rows]
    rate.plot([min(offers), max(offers)], [min(offers), max(offers)], "k--", label="delivered = offered")
    rate.set(title="delivered vs offered", xlabel="offered tokens/s (C x 1000 / step ms)", ylabel="tokens/s",
             xscale="log", yscale="log")
    cost.set(title="gateway CPU per delivered token", xlabel="offered tokens/s", ylabel="us / token", xscale="log")
    for ax in (rate, cost):
        ax.grid(True, which="both", alpha=0.3)
    rate.legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return PLOT


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = text.split(",")
        if not set(values) <= set(allowed):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}")
        return values
    return parse


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=ints, default=[32, 128, 512], help="closed-loop clients, e.g. 32,128")
    parser.add_argument("--k", type=ints, default=[0, 128], help="top_logprobs_num values; 0: no logprobs")
    parser.add_argument("--formats", type=names(FORMATS), default=list(FORMATS))
    parser.add_argument("--modes", type=names(MODES), default=list(MODES))
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per configuration")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the window")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the synthetic scheduler's step time")
    parser.add_argument("--tokens", type=int, default=256, help="max_new_tokens of every request")
    parser.add_argument("--output-intervals", type=ints, default=[50, 1],
                        help="the scheduler's --output-interval values to compare (non-streaming requests only)")
    parser.add_argument("--gateway-workers", type=ints, default=[1],
                        help="gateway processes sharing the HTTP port (SO_REUSEPORT), e.g. 1,2")
    parser.add_argument("--gateway-args", default="", help="more gateway flags, e.g. '--http h11 --loop asyncio'")
    parser.add_argument("--patterns", type=names(PATTERNS), default=["spread"],
                        help="spread: each client resubmits when its request ends; burst: all clients submit "
                        "together, each round once every reply is in (an RL rollout's batch)")
    parser.add_argument("--burst-rounds", type=int, default=3, help="measured rounds of a burst configuration, "
                        "after a first one")
    parser.add_argument("--clients", type=names(CLIENTS), default=["raw"],
                        help="raw: a minimal HTTP/1.1 client; httpx: an httpx.AsyncClient per client; httpx-pool: "
                        "one httpx.AsyncClient shared by the clients")
    parser.add_argument("--name", default="capacity", help="results as bench/out/NAME.{md,json}")
    parser.add_argument("--model", default=None, help="checkpoint whose config and tokenizer to use (default model)")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from bench/out/capacity.json")
    return parser, parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    """A row per configuration of `args`, each measured on a stack of its own interval, C and gateways."""
    model_dir = resolve_model(args.model)
    todo = configs(args)
    progress = Progress(len(todo), "capacity")
    log_dir = OUT_DIR / "capacity-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for interval, concurrency, gateways in dict.fromkeys((c.interval, c.concurrency, c.gateways) for c in todo):
        scheduler_args = ("--engine", "synthetic", "--step-ms", str(args.step_ms),
                          "--max-running-requests", str(concurrency), "--output-interval", str(interval))
        with running(model_dir, log_dir, scheduler_args=scheduler_args, gateway_workers=gateways,
                     gateway_args=args.gateway_args.split()) as stack:
            stack.wait_ready()
            stack.wait_warm()
            pids = {kind: [stack.procs[name].proc.pid for name, service in stack.services.items()
                           if service.kind == kind] for kind in SERVICES} | {"client": [os.getpid()]}
            for config in (c for c in todo if (c.interval, c.concurrency, c.gateways) == (interval, concurrency,
                                                                                          gateways)):
                rows.append(asyncio.run(measure(stack, pids, config, args)))
                wait_idle(stack)
                r = rows[-1]
                progress.step(f"{config}: {r['delivered_tok_s']:,.0f} of {r['offered_tok_s']:,.0f} tok/s, "
                              f"gateway {r['us_per_token']['gateway']:.1f} us/tok, errors {r['errors']}"
                              + (f", check: {r['check']}" if r["check"] else ""))
    return rows


def report(parser: argparse.ArgumentParser, args: argparse.Namespace, rows: list[dict], command: str = "",
           more_tables: tuple[Table, ...] = (), more_notes: str = "", more_data: dict | None = None) -> None:
    """Write bench/out/NAME.{md,json}: the capacity table, and what a caller (`command`) measured beside it."""
    command = command or "python -m bench.capacity" + "".join(
        f" --{name.replace('_', '-')} "
        f"{','.join(map(str, value)) if isinstance(value, list) else shlex.quote(str(value))}"
        for name, value in vars(args).items() if value != parser.get_default(name) and name != "name")
    notes = (f"Synthetic scheduler (`--engine synthetic --step-ms {args.step_ms:g}`, --max-running-requests C) "
             f"and the real detokenizer and gateway (gateways: processes sharing the HTTP port), on "
             f"{os.cpu_count()} cores shared with the "
             f"clients. Each of C closed-loop clients sends POST /generate ({len(PROMPT_IDS)}-token prompt, "
             f"max_new_tokens {args.tokens}, ignore_eos) for {args.warmup:g} s of warm-up and {args.duration:g} s "
             "measured. Offered: C x 1000 / step ms. Delivered counts the requests that completed in the window, "
             "some of whose tokens came before it: it can pass the offer by a few percent. interval: output "
             "tokens per message of a non-streaming request (the scheduler's --output-interval); streaming "
             "requests ship every token."
             + (f" burst: the C clients submit together and again once every reply is in, measured over "
                f"{args.burst_rounds} rounds after a first (the window is those rounds)." if "burst" in args.patterns
                else "")
             + (" httpx: an httpx.AsyncClient per client." if "httpx" in args.clients else "")
             + (" httpx-pool: one httpx.AsyncClient shared by the clients, a pooled connection each."
                if "httpx-pool" in args.clients else "")
             + more_notes)
    print(write_results(args.name, command, [table(rows, args), *more_tables],
                        {"step_ms": args.step_ms, "tokens": args.tokens, "duration_s": args.duration,
                         "warmup_s": args.warmup, "rows": rows, **(more_data or {})}, notes))
    if args.name == "capacity" and (path := plot(rows)) is not None:
        print(path)


def main(argv: list[str] | None = None) -> None:
    parser, args = parse(argv)
    if args.replot:
        print(plot(orjson.loads((OUT_DIR / "capacity.json").read_bytes())["results"]["rows"]))
        return
    report(parser, args, run(args))


if __name__ == "__main__":
    main()
