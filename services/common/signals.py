"""How a service learns it should stop, and how it ends once it has."""

import asyncio
import logging
import os
import signal
import sys
from typing import NoReturn


async def stop_requested() -> None:
    """Returns on SIGINT or SIGTERM: Ctrl-C, `flatwire up` stopping its children, or a container stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def exit_now(code: int | str | None = 0) -> NoReturn:
    """End a service that has stopped without the interpreter's teardown: freeing torch's modules and a model's
    tensors one object at a time takes a scheduler about a second after its last log line, which every stop and
    restart waited for. Its log and standard streams are flushed first; `code` as sys.exit takes it."""
    logging.shutdown()
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1 if code else 0)
