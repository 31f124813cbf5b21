"""uvicorn's HTTP/1.1 protocols the gateway runs on (--http), each bounding a request head's size."""

from enum import StrEnum

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HttpParser(StrEnum):
    """uvicorn's HTTP/1.1 protocols (its --http): httptools parses in C (about a fifth less gateway CPU per
    request than h11, bench.capacity), h11 in pure Python."""

    HTTPTOOLS = "httptools"
    H11 = "h11"


MAX_HEAD_BYTES = 64 * 1024  # a request line and headers, h11's bound (16 KiB) with room for long tokens


class _HeadTooLarge(Exception):
    """Raised in httptools' callback: its parser fails, and uvicorn answers 400 and closes."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """httptools, whose parser keeps every header line it is sent, with h11's bound on a request head's size."""

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge


PROTOCOLS = {HttpParser.HTTPTOOLS: BoundedHttpToolsProtocol, HttpParser.H11: H11Protocol}
