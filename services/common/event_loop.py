"""Which event loop a service runs on (uvicorn's --loop names)."""

import asyncio
from collections.abc import Coroutine
from enum import StrEnum
from typing import Any

import uvloop


class EventLoop(StrEnum):
    """uvloop runs asyncio's loop on libuv: fewer microseconds per callback and per socket write, which a gateway
    pays per request and per streamed event (bench.capacity); asyncio is Python's own."""

    UVLOOP = "uvloop"
    ASYNCIO = "asyncio"


def run(main: Coroutine[Any, Any, None], loop: EventLoop) -> None:
    """asyncio.run(main) on the chosen loop."""
    if loop is EventLoop.UVLOOP:
        uvloop.run(main)
    else:
        asyncio.run(main)
