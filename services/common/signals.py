"""How a service learns it should stop."""

import asyncio
import signal


async def stop_requested() -> None:
    """Returns on SIGINT or SIGTERM: Ctrl-C, `flatwire up` stopping its children, or a container stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
