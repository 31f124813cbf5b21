"""HTTP limits no route has to think about: how large a body may be, how long a client may take.

- RequestLimits, a plain ASGI middleware: a body larger than --max-request-mb is refused with
  413 naming `body`: at once when Content-Length says so (nothing is read), else as soon as
  the bytes read pass the limit, so a 300 MB body is never buffered. A body that has not
  fully arrived --http-body-timeout-s after its headers gets 408. Both close the connection
  (the client may still be sending). After a large body or response, freed memory goes back to
  the OS (services/common/memory.py).
- with_timeouts: uvicorn's HTTP protocol (http/parsers.py: httptools or h11, --http) plus two timers:
  a connection that has not sent a complete request head --http-header-timeout-s after it opened (or after
  its previous response) is closed. The head's size is bounded (h11: 16 KiB; httptools: parsers.py), and
  uvicorn bounds the idle time between requests (timeout_keep_alive, 5 s), but not how long a request head
  or body may take to arrive: a half-sent request would hold its connection forever. And a
  connection whose client has taken none of its response for --http-write-timeout-s while the
  transport's buffer was full (asyncio paused writing) is cut, its buffered response dropped
  and a stream still running aborted: a client that never reads cannot pin its response in
  the gateway's memory, while one that reads slowly is never cut.
- parse_body_off_loop: a large body is decoded and validated in a worker thread.
"""

import asyncio
import fcntl
import struct
import termios
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from services.common.memory import BIG_REQUEST_BYTES, trim_soon
from services.gateway.http.errors import error_response
from services.gateway.http.parsers import PROTOCOLS, HttpParser
from services.gateway.protocol.parse import ModelLimits, parse_body

M = TypeVar("M", bound=BaseModel)
PARSE_OFF_LOOP_BYTES = 256 * 1024  # a body this large is decoded and validated in a worker thread
BIG_RESPONSE_BYTES = 16 << 20  # a response this large is followed by a trim (1 MB ones are everyday traffic)


async def parse_body_off_loop(model: type[M], body: bytes, limits: ModelLimits) -> M:
    """parse_body, in a worker thread when the body is large: decoding and validating 32 MB of JSON
    (millions of input_ids) takes the CPU for a second, which the event loop's other requests and
    /health must not wait for."""
    if len(body) < PARSE_OFF_LOOP_BYTES:
        return parse_body(model, body, limits)
    return await asyncio.to_thread(parse_body, model, body, limits)


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestLimits:
    def __init__(self, app, max_body_bytes: int, body_timeout_s: float):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await self._refuse(scope, receive, send, _Refused(413, self._too_large(f"{length} bytes")))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        received = sent = 0
        body_done = False
        response_started = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # the body is in: what is left to receive is the disconnect, whenever it comes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _Refused(408, f"body: the request body did not arrive within {self.body_timeout_s:g} s "
                                    f"(http_body_timeout_s)") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _Refused(413, self._too_large(f"more than {self.max_body_bytes} bytes"))
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def tracked_send(message):
            nonlocal response_started, sent
            response_started = True
            sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except _Refused as exc:
            if response_started:  # cannot happen (routes read the body before answering); end the connection
                raise
            await self._refuse(scope, receive, send, exc)
        finally:
            if received >= BIG_REQUEST_BYTES or sent >= BIG_RESPONSE_BYTES:
                trim_soon()  # its body, decoded JSON, tokens or rendered response are freed by now

    def _too_large(self, size: str) -> str:
        return (f"body: the request body is {size}; this server's maximum (max_request_mb) is "
                f"{self.max_body_bytes} bytes")

    @staticmethod
    async def _refuse(scope, receive, send, exc: _Refused) -> None:
        # Connection: close, since the rest of the body may still be coming: uvicorn closes after the response.
        response = error_response(exc.status, exc.message, "body", headers={"Connection": "close"})
        await response(scope, receive, send)


if TYPE_CHECKING:  # the mixin goes before one of them, whose attributes it uses
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Protocol
else:
    _Protocol = object


class TimeoutsMixin(_Protocol):
    """Before one of uvicorn's HTTP protocols: closes connections whose request head does not arrive in time,
    and cuts those whose client stops reading (both protocols keep the same cycle, transport and flow control)."""

    header_timeout_s = 10.0  # set per server by with_timeouts
    write_timeout_s = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def pause_writing(self) -> None:
        """The transport's buffer is full: from now on the client must take some of it every write timeout."""
        super().pause_writing()
        if self._write_timer is None:
            self._arm_write_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _arm_write_timer(self) -> None:
        self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timeout, self._untaken())

    def _untaken(self) -> int:
        """Response bytes the client has not taken yet: the transport's buffer, and the kernel's send queue (sent,
        not acknowledged: Linux SIOCOUTQ, which moves while the transport's buffer waits for room in it)."""
        size = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        try:
            size += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (AttributeError, OSError):  # no socket (closed), or no such ioctl here: the buffer alone
            pass
        return size

    def _write_timeout(self, untaken: int) -> None:
        """Still paused: cut unless the client took some of its response since the timer was armed."""
        self._write_timer = None
        if self.transport.is_closing():
            return
        if self._untaken() < untaken:  # it reads, slowly: give it another period
            self._arm_write_timer()
        else:
            self.transport.abort()  # drops what is buffered; the app sees the client gone

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next, pipelined, request
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        for timer in (self._header_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout, self.cycle)

    def _header_timeout(self, cycle) -> None:
        """Close unless a request head arrived since the timer was armed, or a request is still being served."""
        self._header_timer = None
        waiting_for_head = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()


def with_timeouts(parser: HttpParser, header_timeout_s: float, write_timeout_s: float) -> type:
    """The protocol class to give uvicorn.Config(http=...)."""
    base = PROTOCOLS[parser]
    return type(f"Timeouts{base.__name__}", (TimeoutsMixin, base),
                {"header_timeout_s": header_timeout_s, "write_timeout_s": write_timeout_s})
