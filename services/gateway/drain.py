"""The gateway's drain on SIGTERM (and SIGINT): a rolling restart drops no request.

On the first signal the gateway stops taking requests and finishes those it has: every
new HTTP request, /health included (so a readiness probe takes the pod out of its
Service), is answered 503 with `Connection: close` (the client reconnects, to another
replica); the public gRPC server refuses new calls (UNAVAILABLE) and lets the running
ones end; the pipeline keeps delivering outputs meanwhile. The process exits once no
request is left. After --drain-timeout-s (keep it below the pod's
terminationGracePeriodSeconds, after which Kubernetes kills it), or at a second signal,
the requests still running fail instead (HTTP 503, a stream's error event, gRPC
UNAVAILABLE: the client may retry them elsewhere) and are aborted in their schedulers.
"""

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import grpc
import uvicorn

from services.gateway.engine_client import EngineClient
from services.gateway.http.errors import error_response

log = logging.getLogger("flatwire.gateway")
POLL_S = 0.05
ANSWER_FAILED_S = 1.0  # for the requests failed when the drain runs out of time to send their answers


class Draining:
    """ASGI wrapper, outermost: counts the HTTP requests in flight and refuses new ones once draining."""

    def __init__(self, app):
        self.app = app
        self.draining = False
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        if self.draining:
            response = error_response(503, "this gateway is shutting down: send the request to another replica",
                                      headers={"Connection": "close", "Retry-After": "1"})
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class HttpServer(uvicorn.Server):
    """uvicorn without its own signal handlers: a signal starts the drain (serve_until_drained) instead of
    uvicorn's shutdown, which would stop listening at once (no 503s for the readiness probe to see)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_until_drained(http: HttpServer, app: Draining, grpc_server: grpc.aio.Server,
                              engine: EngineClient, drain_timeout_s: float,
                              sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see the module docstring) and stop serving HTTP. `sockets`:
    listening sockets to serve on (else uvicorn binds its own)."""
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    serving = asyncio.create_task(http.serve(sockets=sockets))
    signalled = asyncio.create_task(signals.get())
    await asyncio.wait([serving, signalled], return_when=asyncio.FIRST_COMPLETED)
    if serving.done():  # uvicorn ended on its own (it could not listen): no drain
        signalled.cancel()
        await serving
        return

    app.draining = True
    log.info("%s: draining (up to %gs): %d HTTP requests in flight, refusing new ones",
             signal.Signals(signalled.result()).name, drain_timeout_s, app.in_flight)
    # New calls are refused at once; the running ones get past the drain's end, to be failed with a reason.
    grpc_stopped = asyncio.create_task(grpc_server.stop(grace=drain_timeout_s + ANSWER_FAILED_S))

    async def settled(timeout_s: float, until_signal: bool) -> bool:
        """Whether every HTTP request and gRPC call ended within timeout_s (and before another signal)."""
        deadline = loop.time() + timeout_s
        while app.in_flight or not grpc_stopped.done():
            if loop.time() >= deadline or (until_signal and not signals.empty()):
                return False
            await asyncio.sleep(POLL_S)
        return True

    if await settled(drain_timeout_s, until_signal=True):
        log.info("drained: no request in flight")
    else:
        # Failed, not cut off: clients get a 503 (a stream its error event, gRPC UNAVAILABLE) to retry elsewhere.
        log.warning("drain over with %d HTTP requests (and gRPC calls) in flight: failing them", app.in_flight)
        engine.fail_all("the gateway stopped before this request ended")
        await settled(ANSWER_FAILED_S, until_signal=False)
    await grpc_server.stop(grace=0)  # the most restrictive grace wins: ends what is left of the first stop
    await grpc_stopped
    http.should_exit = True  # nothing in flight is left to wait for: uvicorn closes its connections and returns
    await serving
