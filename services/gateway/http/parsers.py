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
    """Raised in the parser's callback: httptools stops, and uvicorn answers 400 and closes."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """httptools, which keeps a request head's bytes (one header value whole, however long) until the head ends,
    with h11's kind of bound on them: counted as they arrive while the head goes on, and once it is complete
    (a head that arrives in one read is never seen unfinished)."""

    _in_head = True  # the bytes arriving belong to a request head (until it completes; again after the response)
    _head_bytes = 0
    _refused_head = False

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():  # all of it was head: the head has not ended
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.send_400_response(self._too_large())

    def on_headers_complete(self) -> None:
        self._in_head = False
        # The request line's URL and each header line (": " and CRLF around name and value), as they came.
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > MAX_HEAD_BYTES:
            self._refused_head = True
            raise _HeadTooLarge
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(self._too_large() if self._refused_head else msg)

    @staticmethod
    def _too_large() -> str:
        return f"Request head larger than {MAX_HEAD_BYTES} bytes."

    def on_response_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        super().on_response_complete()


PROTOCOLS = {HttpParser.HTTPTOOLS: BoundedHttpToolsProtocol, HttpParser.H11: H11Protocol}
