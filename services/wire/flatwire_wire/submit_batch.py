"""A gateway's submits to one scheduler, batched by need: a submit goes out at once when no SubmitBatch call is
in flight, and those that arrive meanwhile go together in the next call. A lone request waits for nothing; a
burst (an RL rollout's 512 requests at once) costs a few calls instead of one each (a unary call costs both ends
a few hundred us of gRPC's own CPU).

Each submit ends as a Submit of it alone would have: accepted, or a grpc.aio.AioRpcError with the code, details
and trailing field metadata the scheduler gave that request; a failed call fails every request in it with the
call's error. A submit cancelled before its batch leaves is not sent; one cancelled while its batch is in flight
and then accepted is handed to `orphaned` (its scheduler runs it for nobody until it is aborted). A scheduler
without SubmitBatch (an older one, mid-upgrade) is sent unary Submits from then on.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from flatwire_wire.rpc import FIELD_METADATA, STATUS_CODES

log = logging.getLogger(__name__)
MAX_BATCH = 256  # requests per call: bounds one message and what one failed call fails

Request = TypeVar("Request")


class SubmitResultLike(Protocol):
    code: int
    details: str
    field: str


@dataclass
class _Queued(Generic[Request]):
    request: Request
    timeout: float | None
    answer: asyncio.Future


def _error(code: grpc.StatusCode, details: str, field: str = "", like: grpc.aio.AioRpcError | None = None
           ) -> grpc.aio.AioRpcError:
    """An AioRpcError of its own for one request (each raiser gets its own traceback)."""
    trailing = like.trailing_metadata() if like is not None else grpc.aio.Metadata(
        *(((FIELD_METADATA, field),) if field else ()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details,
                                like.debug_error_string() if like is not None else None)


class SubmitBatcher(Generic[Request]):
    def __init__(self, submit_batch: Callable[[list[Request], float | None], Awaitable[list[SubmitResultLike]]],
                 submit: Callable[[Request, float | None], Awaitable[Any]],
                 orphaned: Callable[[Request], None] = lambda request: None):
        """`submit_batch(requests, timeout)`: one SubmitBatch call, its results in order; `submit(request,
        timeout)`: one unary Submit; `orphaned(request)`: accepted after its submitter had gone."""
        self._submit_batch = submit_batch
        self._submit = submit
        self._orphaned = orphaned
        self._unary = False  # the scheduler has no SubmitBatch
        self._queued: list[_Queued[Request]] = []
        self._sender: asyncio.Task | None = None
        self.calls = 0  # SubmitBatch calls made (tests, benches)

    async def submit(self, request: Request, timeout: float | None) -> None:
        if self._unary:
            await self._submit(request, timeout)
            return
        entry = _Queued(request, timeout, asyncio.get_running_loop().create_future())
        self._queued.append(entry)
        if self._sender is None:
            self._sender = asyncio.create_task(self._send())
        await entry.answer

    async def _send(self) -> None:
        batch: list[_Queued[Request]] = []
        try:
            while self._queued:
                batch = [entry for entry in self._queued[:MAX_BATCH] if not entry.answer.done()]  # cancelled: unsent
                del self._queued[:MAX_BATCH]
                if batch:
                    await self._send_batch(batch)
                batch = []
        except BaseException as exc:  # a bug or a cancelled sender: every waiting submit fails, none hangs
            for entry in batch + self._queued:
                if not entry.answer.done():
                    entry.answer.set_exception(_error(grpc.StatusCode.UNAVAILABLE, f"submit not sent: {exc!r}"))
            self._queued.clear()
            raise
        finally:
            self._sender = None

    async def _send_batch(self, batch: list[_Queued[Request]]) -> None:
        timeouts = [entry.timeout for entry in batch if entry.timeout is not None]
        self.calls += 1
        try:
            results = await self._submit_batch([entry.request for entry in batch], min(timeouts, default=None))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unary = True
                await asyncio.gather(*(self._alone(entry) for entry in batch))
                return
            for entry in batch:
                if not entry.answer.done():
                    entry.answer.set_exception(_error(exc.code(), exc.details() or "", like=exc))
            return
        if len(results) != len(batch):  # grpc sends a message it cannot serialize (a value out of range) empty
            log.warning("SubmitBatch answered %d results for %d requests: submitting each alone", len(results),
                        len(batch))
            await asyncio.gather(*(self._alone(entry) for entry in batch))
            return
        for entry, result in zip(batch, results):
            if result.code == 0:
                self._accepted(entry)
            elif not entry.answer.done():
                code = STATUS_CODES.get(result.code, grpc.StatusCode.UNKNOWN)
                entry.answer.set_exception(_error(code, result.details, result.field))

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
