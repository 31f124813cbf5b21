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


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """httptools, which keeps a request head's bytes (one header value whole, however long) until the head ends,
    with h11's kind of bound on them: counted as they arrive, not per parsed header."""

    _in_head = True  # the bytes arriving belong to a request head (until it completes; again after the response)
    _head_bytes = 0

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():  # all of it was head: the head has not ended
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.send_400_response(f"Request head larger than {MAX_HEAD_BYTES} bytes.")

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        super().on_response_complete()


PROTOCOLS = {HttpParser.HTTPTOOLS: BoundedHttpToolsProtocol, HttpParser.H11: H11Protocol}
