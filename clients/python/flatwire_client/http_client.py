"""flatwire's /generate over HTTP as packed protobuf (Accept: application/x-protobuf): the gRPC API's
messages, raw arrays and no JSON, for clients that cannot use gRPC. A stream is length-delimited messages.

Also SGLang's rollout-control routes (update_weights_from_disk, pause and continue, abort, weight_version),
which answer JSON: their body as a dict. Weights from memory go over gRPC (FlatwireClient.push_weights); a
trainer on the scheduler's machine may POST SGLang's /update_weights_from_tensor with its own serializer.
"""

import asyncio
import http.client
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

from flatwire_wire.public import GenerateResponse

from flatwire_client.requests import Options
from flatwire_client.results import ChunkStream, Generation, generation

MEDIA_TYPE = "application/x-protobuf"
T = TypeVar("T")


class HttpError(Exception):
    """A response other than 200: `status`, and the error's message from the body."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _read_varint(read) -> int | None:
    """A base-128 varint from `read(1)`; None at the end of the stream."""
    value = shift = 0
    while byte := read(1):
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
    if shift:
        raise http.client.IncompleteRead(b"", None)
    return None


class HttpGenerationStream(ChunkStream):
    """`for chunk in stream`, then `stream.result` (see ChunkStream). A stream that ends without a message
    carrying a finish_reason was cut (a server-side fault): reading it raises IncompleteRead. Leaving the loop
    early (break, an exception) or `cancel()` closes the connection: the gateway aborts the request, and the
    client's next call opens a new one."""

    def __init__(self, response: http.client.HTTPResponse, connection: http.client.HTTPConnection):
        super().__init__()
        self._response = response
        self._connection = connection

    def __iter__(self) -> Iterator[Generation]:
        read = self._response.read
        try:
            while (size := _read_varint(read)) is not None:
                data = read(size)
                if len(data) < size:
                    raise http.client.IncompleteRead(data, size - len(data))
                yield self._take(GenerateResponse.from_bytes(data))
        finally:
            if not self.ended:
                self.cancel()
        if not self.ended:
            raise http.client.IncompleteRead(b"", None)

    def cancel(self) -> None:
        """Stop the request: close its connection."""
        _drop(self._connection)


def _drop(connection: http.client.HTTPConnection) -> None:
    """Close the connection, waking a read of it blocked in another thread (a close alone would not)."""
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass
    connection.close()


class HttpClient:
    """Blocking client of one gateway's HTTP port; the same options as FlatwireClient."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0,
                 admin_api_key: str | None = None):
        """`admin_api_key`: what the rollout-control methods send (default: api_key)."""
        url = urlsplit(base_url)
        self._connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=timeout)
        self._headers = {"content-type": "application/json", "accept": MEDIA_TYPE}
        self._control_headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        if admin_api_key or api_key:
            self._control_headers["authorization"] = f"Bearer {admin_api_key or api_key}"

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._connection.close()

    def _post(self, text: str | None, input_ids: list[int] | None, stream: bool,
              options: dict) -> http.client.HTTPResponse:
        body = json.dumps(Options(**options).generate_body(text, input_ids, stream))
        self._connection.request("POST", "/generate", body=body, headers=self._headers)
        response = self._connection.getresponse()
        if response.status != 200:
            raw = response.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace")
            raise HttpError(response.status, message)
        return response

    def generate(self, text: str | None = None, input_ids: list[int] | None = None, **options) -> Generation:
        response = self._post(text, input_ids, False, options)
        return generation(GenerateResponse.from_bytes(response.read()))

    def stream(self, text: str | None = None, input_ids: list[int] | None = None,
               **options) -> HttpGenerationStream:
        return HttpGenerationStream(self._post(text, input_ids, True, options), self._connection)

    # -- rollout control (admin but abort by rid): SGLang's routes, their JSON as a dict --

    def _control(self, path: str, body: dict, headers: dict | None = None) -> dict:
        """The route's JSON body ({} when it has none); a refusal in SGLang's {success: false} shape is returned
        as it is, any other error raised as HttpError."""
        self._connection.request("POST", path, body=json.dumps(body), headers=headers or self._control_headers)
        response = self._connection.getresponse()
        raw = response.read()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = None
        if response.status == 200 or (isinstance(data, dict) and "success" in data):
            return data or {}
        message = data["error"]["message"] if isinstance(data, dict) and "error" in data else raw.decode(
            errors="replace")
        raise HttpError(response.status, message)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False, weight_version: str | None = None) -> dict:
        return self._control("/update_weights_from_disk", {
            "model_path": str(model_path), "load_format": load_format, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version})

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._control("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._control("/continue_generation", {})

    def abort_all(self) -> dict:
        return self._control("/abort_request", {"abort_all": True})

    def abort(self, rid: str) -> dict:
        """Stop one request (its meta_info.id); sent with the API key, not the admin key."""
        headers = {"content-type": "application/json", "accept": "application/json"}
        if "authorization" in self._headers:
            headers["authorization"] = self._headers["authorization"]
        return self._control("/abort_request", {"rid": rid}, headers)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict:
        return self._control("/update_weight_version", {"new_version": new_version,
                                                        "abort_all_requests": abort_all_requests})


class AsyncHttpClient:
    """asyncio twin of HttpClient: each call runs a blocking HttpClient of its own in a worker thread, so
    concurrent calls do not share a connection."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0,
                 admin_api_key: str | None = None):
        self._args = (base_url, api_key, timeout, admin_api_key)

    async def _call(self, call: Callable[[HttpClient], T]) -> T:
        def run() -> T:
            with HttpClient(*self._args) as client:
                return call(client)
        return await asyncio.to_thread(run)

    async def update_weights_from_disk(self, model_path: str, **options: Any) -> dict:
        return await self._call(lambda client: client.update_weights_from_disk(model_path, **options))

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._call(lambda client: client.pause_generation(mode))

    async def continue_generation(self) -> dict:
        return await self._call(lambda client: client.continue_generation())

    async def abort_all(self) -> dict:
        return await self._call(lambda client: client.abort_all())

    async def abort(self, rid: str) -> dict:
        return await self._call(lambda client: client.abort(rid))

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict:
        return await self._call(lambda client: client.update_weight_version(new_version, abort_all_requests))

    async def generate(self, text: str | None = None, input_ids: list[int] | None = None, **options) -> Generation:
        return await self._call(lambda client: client.generate(text, input_ids, **options))

    def stream(self, text: str | None = None, input_ids: list[int] | None = None,
               **options) -> "AsyncHttpGenerationStream":
        return AsyncHttpGenerationStream(HttpClient(*self._args), text, input_ids, options)


class AsyncHttpGenerationStream(ChunkStream):
    """HttpGenerationStream's asyncio twin: `async for chunk in stream` (a worker thread reads them), then
    `stream.result`. Leaving the loop early closes the connection once asyncio closes the loop's generator (at
    once with `cancel()`): the gateway aborts the request and the thread ends."""

    def __init__(self, client: HttpClient, text: str | None, input_ids: list[int] | None, options: dict):
        super().__init__()
        self._client = client
        self._request = (text, input_ids, options)
        self._cancelled = False

    async def __aiter__(self) -> AsyncIterator[Generation]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Generation | Exception | object] = asyncio.Queue()
        done = object()
        text, input_ids, options = self._request

        def pump() -> None:
            try:
                with self._client as client:
                    for chunk in client.stream(text, input_ids, **options):
                        if self._cancelled:  # before the connection was there to close
                            break
                        loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except Exception as exc:  # handed to the reader, raised there
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:  # whatever ended the stream, the reader stops waiting
                loop.call_soon_threadsafe(queue.put_nowait, done)

        threading.Thread(target=pump, daemon=True).start()
        try:
            while (item := await queue.get()) is not done:
                if isinstance(item, Exception):
                    raise item
                assert isinstance(item, Generation)
                self.chunks.append(item)
                yield item
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the request (nothing once the stream has ended): close the stream's own connection."""
        self._cancelled = True
        _drop(self._client._connection)
