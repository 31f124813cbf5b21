"""The floor under bench.capacity's burst rows: the same clients, in the same rounds, against a server that does
nothing but HTTP. A bare ASGI app on uvicorn (httptools and uvloop, the gateway's parser and loop) reads each
request, waits the generation's time (tokens x step) and answers a body as large as flatwire's reply. What it
delivers is the most a server on Python's HTTP stack delivers to that client on this host; the distance from it to
a flatwire row is flatwire's own work at the round's two ends (parsing and submitting the burst, rendering and
sending the replies).

bench.capacity_bursts runs it beside the flatwire rows; the app is `bench.burst_floor:app`, configured by the
environment (FLOOR_DELAY_S, FLOOR_BODY_BYTES, FLOOR_TOKENS) of the uvicorn process that serves it.
"""

import argparse
import asyncio
import os
import statistics

from bench.capacity import Config, Reply, burst_rounds, connections, rounds_done
from bench.common import Table
from bench.e2e import cpu_seconds
from bench.http_framework import uvicorn_app

DELAY_S = float(os.environ.get("FLOOR_DELAY_S", "0"))
TOKENS = int(os.environ.get("FLOOR_TOKENS", "0"))
_HEAD = b'{"meta_info":{"completion_tokens":%d},"pad":"' % TOKENS
BODY = _HEAD + b"A" * max(0, int(os.environ.get("FLOOR_BODY_BYTES", "0")) - len(_HEAD) - 2) + b'"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def app(scope, receive, send) -> None:
    """Reads the request, waits DELAY_S, answers BODY (a JSON object that says it completed TOKENS tokens)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(DELAY_S)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


def measure(row: dict, args: argparse.Namespace) -> dict:
    """The floor of a bench.capacity burst row: its client and C, its reply's size, --burst-rounds rounds after a
    first, each request answered after --tokens x --step-ms."""
    env = {"FLOOR_DELAY_S": str(args.tokens * args.step_ms / 1e3), "FLOOR_TOKENS": str(args.tokens),
           "FLOOR_BODY_BYTES": str(row["reply_bytes"])}
    with uvicorn_app("bench.burst_floor:app", env) as (pid, port):
        return asyncio.run(_rounds(row, args, pid, f"http://127.0.0.1:{port}"))


async def _rounds(row: dict, args: argparse.Namespace, pid: int, url: str) -> dict:
    config = Config(row["concurrency"], row["k"], row["format"], "nonstream", pattern="burst", client=row["client"])
    replies: list[Reply] = []
    rounds: list[float] = []
    async with connections(config, url) as connect:
        task = asyncio.create_task(burst_rounds(connect, b"{}", False, config.concurrency, replies, [], rounds))
        try:
            await rounds_done(rounds, 1, task)  # the first round warms up
            server0, client0 = cpu_seconds(pid), cpu_seconds(os.getpid())
            await rounds_done(rounds, 1 + args.burst_rounds, task)
            server1, client1 = cpu_seconds(pid), cpu_seconds(os.getpid())
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    rounds = rounds[:1 + args.burst_rounds]
    times = [end - start for start, end in zip(rounds, rounds[1:])]
    window = [r for r in replies if rounds[0] < r.end <= rounds[-1]]
    tokens = sum(r.tokens for r in window if r.tokens >= 0)
    delivered = tokens / (rounds[-1] - rounds[0])
    return {"client": config.client, "concurrency": config.concurrency, "reply_bytes": row["reply_bytes"],
            "delivered_tok_s": delivered, "fraction": delivered / row["offered_tok_s"],
            "flatwire_fraction": row["fraction"], "round_s": statistics.median(times),
            "errors": sum(r.tokens < 0 for r in window),
            "us_per_token": {"server": (server1 - server0) * 1e6 / max(1, tokens),
                             "client": (client1 - client0) * 1e6 / max(1, tokens)}}


def table(floors: list[dict], args: argparse.Namespace) -> Table:
    out = Table(f"Burst floor: a bare ASGI app on uvicorn answering after {args.tokens} x {args.step_ms:g} ms",
                ["C", "client", "reply bytes", "delivered tok/s", "of offer", "flatwire, same client", "round s",
                 "server us/tok", "client us/tok", "errors"],
                "The same clients and rounds as the burst rows above; the app reads each request, waits the "
                "generation's time and answers a body of the flatwire reply's size. flatwire, same client: that "
                "burst row's share of the offer.")
    for f in floors:
        out.add(f["concurrency"], f["client"], f"{f['reply_bytes']:,}", f"{f['delivered_tok_s']:,.0f}",
                f"{f['fraction']:.0%}", f"{f['flatwire_fraction']:.0%}", f"{f['round_s']:.3f}",
                f"{f['us_per_token']['server']:.1f}", f"{f['us_per_token']['client']:.1f}", f["errors"])
    return out
