"""Following a server stream for as long as the process runs.

The detokenizer follows each scheduler's steps and the gateway each detokenizer's
outputs the same way: subscribe, handle every message, and when the stream ends or
breaks, subscribe again after a backoff. A handler that raises (a bug) fails what
that one message concerned (`on_failure`) and the stream goes on: one bad message
must not end a consumer, and with it every request behind it, for good. An outage is logged
once when it starts and once when the stream is back, not at every retry; a server not up yet when the
consumer starts (compose and `flatwire up` start every service at once) is waited for, not warned about.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import grpc

log = logging.getLogger(__name__)
FIRST_BACKOFF_S = 0.1
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
M = TypeVar("M")


async def follow_stream(name: str, subscribe: Callable[[], AbstractAsyncContextManager[AsyncIterator[M]]],
                        handle: Callable[[M], Awaitable[None]], on_failure: Callable[[M], None],
                        max_backoff_s: float) -> None:
    """Forever: `async with subscribe() as messages`, `await handle(message)` for each; reconnect on an end.

    `subscribe` opens the stream and confirms the subscription (raising grpc.aio.AioRpcError when it
    cannot); its exit runs however the stream ended, so it keeps the consumer's connected state."""
    backoff = FIRST_BACKOFF_S
    down_since: float | None = None  # when the stream last broke, while it stays down
    ever_up = False
    refused = False  # the last attempts were refused (said once until a stream is up)
    loop = asyncio.get_running_loop()
    while True:
        try:
            async with subscribe() as messages:
                backoff, refused = FIRST_BACKOFF_S, False
                if not ever_up:
                    log.info("%s stream is up", name)
                elif down_since is not None:
                    log.info("%s stream is back after %.1fs", name, loop.time() - down_since)
                ever_up, down_since = True, None
                async for message in messages:
                    try:
                        await handle(message)
                    except Exception:
                        log.exception("%s: handling a message failed; failing what it concerned", name)
                        on_failure(message)
                log.warning("%s ended its stream", name)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in REFUSALS:  # not a server that is starting or gone: a misconfiguration, said as one
                if not refused:
                    log.error("%s refuses this service (%s: %s): is the internal secret (or the TLS CA) the same on "
                              "every service? Retrying", name, exc.code().name, exc.details())
                refused = True
            elif not ever_up and down_since is None:
                log.info("%s is not up yet (%s); waiting for it", name, exc.code())
            elif down_since is None:
                log.warning("%s stream: %s %s; retrying until it is back", name, exc.code(), exc.details())
            else:
                log.debug("%s stream: %s %s", name, exc.code(), exc.details())
        if down_since is None:
            down_since = loop.time()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, max_backoff_s)
