"""A gateway's submits to one scheduler, sent in batches as they are made: every SEND_AT of them at once, from the
submitter's own task, and what is left at the end of the event loop's turn. A lone request waits for nothing but
that turn; a burst (an RL rollout's 512 requests, parsed in one turn of the gateway's loop) leaves in batches of
SEND_AT while the rest of it is still being parsed, not once the whole burst is, and costs a few calls instead of
one each (a unary call costs both ends a few hundred us of gRPC's own CPU).

A batch is started on a blocking gRPC channel: its C core sends the call from the submitter's thread at once, and
answers on its own thread. An asyncio call would first wait for its task's turn, queued behind every request of
the burst that the loop has still to parse. Each request is encoded by its submitter, so a SubmitBatch is the
concatenation of one-request SubmitBatchRequests (protobuf appends repeated fields that way).

Each submit ends as a Submit of it alone would have: accepted, or a grpc.aio.AioRpcError with the code, details
and trailing field metadata the scheduler gave that request; a failed call fails every request in it with the
call's error. A request gRPC cannot encode (a value out of its field's range) is sent alone as a unary Submit,
which the scheduler refuses with its own words. A submit cancelled before its batch leaves is not sent; one
cancelled while its batch is in flight and then accepted is handed to `orphaned` (its scheduler runs it for nobody
until it is aborted). A scheduler without SubmitBatch (an older one, mid-upgrade) is sent unary Submits from then
on.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from flatwire_wire.rpc import FIELD_METADATA, STATUS_CODES

log = logging.getLogger(__name__)
SEND_AT = 32  # queued submits that leave at once, without waiting for the loop's turn to end
MAX_BATCH = 256  # requests per call: bounds one message and what one failed call fails

Request = TypeVar("Request")


class SubmitResultLike(Protocol):
    code: int
    details: str
    field: str


class BatchCall(Protocol):
    """A started SubmitBatch: grpc.Future's part that the batcher uses (gRPC's thread calls the callback)."""

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...

    def exception(self) -> grpc.RpcError | None: ...

    def result(self) -> Any: ...


@dataclass
class _Queued(Generic[Request]):
    request: Request
    encoded: bytes  # a one-request SubmitBatchRequest
    timeout: float | None
    answer: asyncio.Future


def _error(code: grpc.StatusCode, details: str, field: str = "", like: grpc.RpcError | None = None
           ) -> grpc.aio.AioRpcError:
    """An AioRpcError of its own for one request (each raiser gets its own traceback); `like`: a failed call's
    error, blocking or asyncio, whose trailing metadata it carries."""
    if like is not None:
        trailing = grpc.aio.Metadata(*(like.trailing_metadata() or ()))  # type: ignore[attr-defined]
        debug = like.debug_error_string()  # type: ignore[attr-defined]
    else:
        trailing = grpc.aio.Metadata(*(((FIELD_METADATA, field),) if field else ()))
        debug = None
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details, debug)


class SubmitBatcher(Generic[Request]):
    def __init__(self, start_batch: Callable[[bytes, float | None], BatchCall],
                 encode: Callable[[Request], bytes],
                 submit: Callable[[Request, float | None], Awaitable[Any]],
                 orphaned: Callable[[Request], None] = lambda request: None):
        """`start_batch(message, timeout)`: start one SubmitBatch call of an encoded SubmitBatchRequest (its reply's
        `results` in order); `encode(request)`: a one-request SubmitBatchRequest, encoded; `submit(request,
        timeout)`: one unary Submit; `orphaned(request)`: accepted after its submitter had gone."""
        self._start_batch = start_batch
        self._encode = encode
        self._submit = submit
        self._orphaned = orphaned
        self._unary = False  # the scheduler has no SubmitBatch
        self._queued: list[_Queued[Request]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_due = False  # a send of what is queued is scheduled for the end of the loop's turn
        self._alone_tasks: set[asyncio.Task] = set()
        self.calls = 0  # SubmitBatch calls made (tests, benches)

    async def submit(self, request: Request, timeout: float | None) -> None:
        if self._unary:
            await self._submit(request, timeout)
            return
        try:
            encoded = self._encode(request)
        except (ValueError, TypeError):  # out of a field's range: the scheduler answers what a Submit of it would
            await self._submit(request, timeout)
            return
        self._loop = loop = asyncio.get_running_loop()
        entry = _Queued(request, encoded, timeout, loop.create_future())
        self._queued.append(entry)
        if len(self._queued) >= SEND_AT:
            self._send_queued()
        elif not self._flush_due:
            self._flush_due = True
            loop.call_soon(self._send_queued)
        await entry.answer

    def _send_queued(self) -> None:
        self._flush_due = False
        queued = [entry for entry in self._queued if not entry.answer.done()]  # cancelled: never sent
        self._queued.clear()
        for start in range(0, len(queued), MAX_BATCH):
            self._send(queued[start:start + MAX_BATCH])

    def _send(self, batch: list[_Queued[Request]]) -> None:
        timeouts = [entry.timeout for entry in batch if entry.timeout is not None]
        self.calls += 1
        try:
            call = self._start_batch(b"".join(entry.encoded for entry in batch), min(timeouts, default=None))
        except Exception as exc:  # the channel is closed (shutting down): nothing was sent
            self._fail(batch, _error(grpc.StatusCode.UNAVAILABLE, f"submit not sent: {exc!r}"))
            return
        loop = self._loop
        assert loop is not None

        def answered(call: BatchCall) -> None:  # on gRPC's thread
            try:
                loop.call_soon_threadsafe(self._answered, batch, call)
            except RuntimeError:  # the loop has closed: no one waits for the answer
                pass

        call.add_done_callback(answered)

    def _answered(self, batch: Sequence[_Queued[Request]], call: BatchCall) -> None:
        error = call.exception()
        if error is not None:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                self._unary = True
                for entry in batch:
                    task = asyncio.ensure_future(self._alone(entry))
                    self._alone_tasks.add(task)
                    task.add_done_callback(self._alone_tasks.discard)
                return
            self._fail(batch, _error(error.code(), error.details() or "", like=error))  # type: ignore[attr-defined]
            return
        results: list[SubmitResultLike] = call.result().results
        if len(results) != len(batch):  # a scheduler bug: no request is left waiting on it
            log.error("SubmitBatch answered %d results for %d requests", len(results), len(batch))
            self._fail(batch, _error(grpc.StatusCode.INTERNAL, "the scheduler's answer to a batch of submits did "
                                     "not match it"))
            return
        for entry, result in zip(batch, results):
            if result.code == 0:
                self._accepted(entry)
            elif not entry.answer.done():
                code = STATUS_CODES.get(result.code, grpc.StatusCode.UNKNOWN)
                entry.answer.set_exception(_error(code, result.details, result.field))

    def _fail(self, batch: Sequence[_Queued[Request]], like: grpc.aio.AioRpcError) -> None:
        for entry in batch:
            if not entry.answer.done():
                entry.answer.set_exception(_error(like.code(), like.details() or "", like=like))

    async def _alone(self, entry: _Queued[Request]) -> None:
        try:
            await self._submit(entry.request, entry.timeout)
        except grpc.aio.AioRpcError as exc:
            if not entry.answer.done():
                entry.answer.set_exception(exc)
            return
        self._accepted(entry)

    def _accepted(self, entry: _Queued[Request]) -> None:
        if entry.answer.done():  # its submitter was cancelled while the call was in flight
            self._orphaned(entry.request)
        else:
            entry.answer.set_result(None)
