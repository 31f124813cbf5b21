"""A gateway's submits to one scheduler, sent in batches as they are made: every SEND_AT of them at once, from the
submitter's own task, and what is left at the end of the event loop's turn. A lone request waits for nothing but
that turn; a burst (an RL rollout's 512 requests, parsed in one turn of the gateway's loop) leaves in batches of
SEND_AT while the rest of it is still being parsed, not once the whole burst is, and costs a few calls instead of
one each (a unary call costs both ends a few hundred us of gRPC's own CPU).

The batches of SEND_AT are started on a blocking gRPC channel (a gateway's; a client without one sends them as
asyncio calls too): its C core sends the call from the submitter's thread at once and answers on a thread of its
own. An asyncio call would first wait for its task's turn, queued behind every request of the burst that the loop
has still to parse. What is left at the end of a turn goes as an asyncio call: a blocking channel starts a thread
to answer its calls whenever it had none in flight, which costs more than the call when submits trickle in. Each
request is encoded by its submitter, so a SubmitBatch is the concatenation of one-request SubmitBatchRequests
(protobuf appends repeated fields that way).

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
from collections.abc import Awaitable, Callable, Coroutine
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
    def __init__(self, send_batch: Callable[[bytes, float | None], Awaitable[Any]],
                 encode: Callable[[Request], bytes],
                 submit: Callable[[Request, float | None], Awaitable[Any]],
                 orphaned: Callable[[Request], None] = lambda request: None,
                 start_batch: Callable[[bytes, float | None], BatchCall] | None = None,
                 can_start: Callable[[], bool] = lambda: True):
        """`send_batch(message, timeout)`: one SubmitBatch call of an encoded SubmitBatchRequest on the asyncio
        channel (its reply has the `results` in order); `encode(request)`: a one-request SubmitBatchRequest,
        encoded; `submit(request, timeout)`: one unary Submit; `orphaned(request)`: accepted after its submitter
        had gone; `start_batch(message, timeout)`: start the same call on the blocking channel (without one, the
        batches of SEND_AT go as asyncio calls too, once the loop gets to their tasks); `can_start()`: whether the
        blocking channel is connected now (while it is not, a call on it would fail at once)."""
        self._start_batch = start_batch
        self._can_start = can_start
        self._send_batch = send_batch
        self._encode = encode
        self._submit = submit
        self._orphaned = orphaned
        self._unary = False  # the scheduler has no SubmitBatch
        self._queued: list[_Queued[Request]] = []
        self._flush_due = False  # a send of what is queued is scheduled for the end of the loop's turn
        self._tasks: set[asyncio.Task] = set()
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
        loop = asyncio.get_running_loop()
        entry = _Queued(request, encoded, timeout, loop.create_future())
        self._queued.append(entry)
        if len(self._queued) >= SEND_AT and self._start_batch is not None and self._can_start():
            self._start(self._take(), self._start_batch, loop)
        elif not self._flush_due:
            self._flush_due = True
            loop.call_soon(self._flush)
        await entry.answer

    def _take(self) -> list[_Queued[Request]]:
        """What is queued and still wanted (a cancelled submit is never sent), at most MAX_BATCH of it."""
        batch = [entry for entry in self._queued[:MAX_BATCH] if not entry.answer.done()]
        del self._queued[:MAX_BATCH]
        return batch

    def _flush(self) -> None:
        self._flush_due = False
        while self._queued:
            if batch := self._take():
                self._spawn(self._send(batch))

    def _call(self, batch: list[_Queued[Request]]) -> tuple[bytes, float | None]:
        """The SubmitBatch message of `batch`, and its deadline: the shortest of its submits'."""
        self.calls += 1
        timeouts = [entry.timeout for entry in batch if entry.timeout is not None]
        return b"".join(entry.encoded for entry in batch), min(timeouts, default=None)

    def _start(self, batch: list[_Queued[Request]], start_batch: Callable[[bytes, float | None], BatchCall],
               loop: asyncio.AbstractEventLoop) -> None:
        try:
            call = start_batch(*self._call(batch))
        except Exception as exc:  # the channel is closed (shutting down): nothing was sent
            self._fail(batch, _error(grpc.StatusCode.UNAVAILABLE, f"submit not sent: {exc!r}"))
            return

        def landed(call: BatchCall) -> None:  # on gRPC's thread
            try:
                loop.call_soon_threadsafe(self._landed, batch, call)
            except RuntimeError:  # the loop has closed: no one waits for the answer
                pass

        call.add_done_callback(landed)

    def _landed(self, batch: list[_Queued[Request]], call: BatchCall) -> None:
        """A blocking call's outcome, taken on the loop as _send takes an asyncio call's."""
        try:
            reply = call.result()
        except grpc.RpcError as exc:
            self._answered(batch, exc, None)
        except Exception as exc:  # cancelled (its channel was closed mid-call): no submit is left waiting
            self._fail(batch, _error(grpc.StatusCode.UNAVAILABLE, f"submit not answered: {exc!r}"))
        else:
            self._answered(batch, None, reply)

    async def _send(self, batch: list[_Queued[Request]]) -> None:
        try:
            reply = await self._send_batch(*self._call(batch))
        except grpc.aio.AioRpcError as exc:
            self._answered(batch, exc, None)
            return
        except BaseException as exc:  # a bug, or cancelled at shutdown: no submit is left waiting
            self._fail(batch, _error(grpc.StatusCode.UNAVAILABLE, f"submit not sent: {exc!r}"))
            raise
        self._answered(batch, None, reply)

    def _answered(self, batch: list[_Queued[Request]], error: grpc.RpcError | None, reply: Any) -> None:
        """A call's outcome: its error, or its reply (the `results` in order)."""
        if error is not None:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                self._unary = True
                for entry in batch:
                    self._spawn(self._alone(entry))
                return
            self._fail(batch, error)
            return
        results: list[SubmitResultLike] = reply.results
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

    def _fail(self, batch: list[_Queued[Request]], error: grpc.RpcError) -> None:
        """Every submit of `batch` fails with `error` (a failed call's, blocking or asyncio), each its own."""
        for entry in batch:
            if not entry.answer.done():
                entry.answer.set_exception(
                    _error(error.code(), error.details() or "", like=error))  # type: ignore[attr-defined]

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
