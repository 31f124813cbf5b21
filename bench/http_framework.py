"""What one HTTP request costs the server's process on this host, layer by layer: a bare ASGI app on uvicorn
(httptools and uvloop, the gateway's defaults) answering a tiny body and a 350 kB one (a 256-token k=128 flat
base64 response's size), a Starlette route, a FastAPI route, and the gateway itself (GET /health; POST /generate
of one token from the synthetic scheduler). C keep-alive raw clients (bench.capacity.Connection) send together
and again once every reply is in, as the burst pattern does; the CPU per request is the server process's user
and system time (/proc) over the measured rounds.

bench.capacity_bursts needs each end of a round (the burst's parsing, its replies' sending) under about
0.26 ms of gateway CPU per request for 95% of the offer: this table says how much of that the HTTP stack takes
before flatwire's own work.

    python -m bench.http_framework          # bench/out/http_framework.md and .json
"""

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request, Response
from starlette.applications import Starlette
from starlette.routing import Route

from bench.capacity import Connection
from bench.common import OUT_DIR, Progress, Table, fmt_time, write_results
from bench.e2e import cpu_seconds
from harness.procs import free_port
from harness.stack import running
from services.common.model_store import resolve_model

SMALL = b'{"ok":true}'
LARGE = b'{"x":"' + b"A" * 350_000 + b'"}'
GENERATE_ONE = (b'{"text":"Hello","sampling_params":{"max_new_tokens":1},"return_logprob":true,"top_logprobs_num":128,'
                b'"return_flat_raw_output_top_logprobs":true,"return_flat_raw_top_logprobs_b64":true}')
REQUEST = b'{"text":"Hello","sampling_params":{"max_new_tokens":1}}'  # what the apps read and ignore


def _asgi(body: bytes):
    """An ASGI app that reads the request and answers `body`: no framework at all."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


async def _answer(request: Request) -> Response:
    await request.body()
    return Response(SMALL, media_type="application/json")


bare_small, bare_large = _asgi(SMALL), _asgi(LARGE)
starlette_route = Starlette(routes=[Route("/", _answer, methods=["POST"])])
fastapi_route = FastAPI()
fastapi_route.add_api_route("/", _answer, methods=["POST"])

APPS = {  # label -> this module's app
    "uvicorn, a bare ASGI app, 11 B answer": "bare_small",
    "uvicorn, a bare ASGI app, 350 kB answer": "bare_large",
    "uvicorn + a Starlette route": "starlette_route",
    "uvicorn + a FastAPI route": "fastapi_route",
}


@contextmanager
def uvicorn_app(app: str, env: dict[str, str] | None = None) -> Iterator[tuple[int, int]]:
    """(pid, port) of `uvicorn <app>` ("module:attribute") on the gateway's parser and loop, once it listens;
    `env`: more environment for its process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--port", str(port), "--http", "httptools",
                             "--loop", "uvloop", "--log-level", "warning", "--no-access-log"],
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"uvicorn {app} did not come up") from None
                time.sleep(0.2)
        yield proc.pid, port
    finally:
        proc.terminate()
        proc.wait()


async def _per_request(pid: int, port: int, method: str, path: str, body: bytes, clients: int,
                       rounds: int) -> float:
    """Server CPU seconds per request: `clients` connections send together, `rounds` times after two rounds of
    warm-up."""
    connections = [Connection("127.0.0.1", port) for _ in range(clients)]

    async def round_trip() -> None:
        replies = await asyncio.gather(*(c.request(method, path, body) for c in connections))
        if bad := [status for status, _ in replies if status != 200]:
            raise RuntimeError(f"{len(bad)} replies were not 200: {bad[:3]}")

    try:
        for _ in range(2):
            await round_trip()
        start = cpu_seconds(pid)
        for _ in range(rounds):
            await round_trip()
        return (cpu_seconds(pid) - start) / (clients * rounds)
    finally:
        for connection in connections:
            connection.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http_framework", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    progress = Progress(len(APPS) + 2, "http_framework")
    results: dict[str, float] = {}
    for label, app in APPS.items():
        with uvicorn_app(f"bench.http_framework:{app}") as (pid, port):
            results[label] = asyncio.run(_per_request(pid, port, "POST", "/", REQUEST, args.clients, args.rounds))
        progress.step(label)
    scheduler_args = ("--engine", "synthetic", "--step-ms", "10", "--max-running-requests", str(args.clients))
    logs = OUT_DIR / "http_framework-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with running(resolve_model(None), logs, scheduler_args=scheduler_args) as stack:
        stack.wait_ready()
        stack.wait_warm()
        pid, port = stack.procs["gateway"].proc.pid, int(stack.http_url.rsplit(":", 1)[1])
        for label, method, path, body in (("the gateway: GET /health", "GET", "/health", b""),
                                          ("the gateway: POST /generate, 1 token, k=128 flat b64", "POST",
                                           "/generate", GENERATE_ONE)):
            results[label] = asyncio.run(_per_request(pid, port, method, path, body, args.clients, args.rounds))
            progress.step(label)
    table = Table(f"Server CPU per request, {args.clients} clients x {args.rounds} rounds", ["server", "CPU"])
    for label, seconds in results.items():
        table.add(label, fmt_time(seconds))
    print(write_results("http_framework", "python -m bench.http_framework", [table], results))


if __name__ == "__main__":
    main()
