"""Server-sent events as SGLang and OpenAI write them: `data: {json}\n\n` ... `data: [DONE]\n\n`.

A stream that fails mid-way (a server-side fault: RequestError) ends with an error
event, `data: {"error": {...}}`, and no `[DONE]`: the openai client raises on it, and
a client that waits for `[DONE]` cannot mistake the stream for a complete one.
"""

from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from services.gateway.engine_client import RequestError
from services.gateway.http.errors import error_body

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


def sse_response(events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]],
                 on_sent: Callable[[int], None]) -> StreamingResponse:
    """Streams `events`, then reports the bytes sent.

    Starlette cancels the stream when the client disconnects; `close` runs in every case
    (even when the stream never started) and aborts the generations still running.
    """

    async def counted():
        sent = 0
        try:
            async for data in events:
                sent += len(data)
                yield data
        except RequestError as exc:
            data = event(error_body(exc))
            sent += len(data)
            yield data
        finally:
            await events.aclose()
            on_sent(sent)

    return StreamingResponse(counted(), media_type="text/event-stream", background=BackgroundTask(close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
