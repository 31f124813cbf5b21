"""Running a route's generations on the engine: submit, merge, collect, stop on disconnect.

Every generation is an EngineClient.generate iterator of Replies; closing it before its last aborts the
request in the scheduler. Each helper here closes what it opened, whether it ends
normally, fails, or is cancelled because the HTTP client went away.
"""

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable
from typing import TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from services.gateway.engine_client import EngineClient
from services.gateway.metrics import GatewayMetrics, TokenTimer
from services.gateway.protocol.intake import GenerateInput
from services.gateway.reply import Reply

T = TypeVar("T")


class Generations:
    """A route's requests, submitted together; each one's first reply already taken.

    Taking the first reply before answering turns the engine client's refusal (a RequestError)
    into an HTTP error instead of a broken stream.
    """

    def __init__(self, inputs: list[GenerateInput], iterators: list[AsyncGenerator[Reply, None]],
                 firsts: list[Reply],
                 timers: list[TokenTimer]):
        self.inputs = inputs
        self._iterators = iterators
        self._firsts = firsts
        self._timers = timers

    @classmethod
    async def start(cls, engine: EngineClient, inputs: list[GenerateInput], metrics: GatewayMetrics, endpoint: str,
                    started: float, routing_key: str | None = None) -> "Generations":
        """Submit every input and take each one's first reply (the scheduler pool bounds the Submits in flight).
        `routing_key`: the client's session key (routing.py), for every input.

        If one fails, the others are cancelled (those not yet submitted never are), every
        read's outcome is retrieved, the submitted ones are aborted, and the first failure
        in input order is raised. Admission control takes the inputs whole or refuses them all
        (RequestError "resource_exhausted").
        """
        for inp in inputs:
            inp.routing_key = routing_key
        with engine.admit(len(inputs)) as admission:  # until every generation has started or never will
            iterators = [engine.generate(inp, admission) for inp in inputs]
            if len(iterators) == 1:  # the common case: read in the caller's task, no task of its own
                try:
                    firsts = [await anext(iterators[0])]
                except BaseException:
                    await _close(iterators)
                    raise
                return cls._started(inputs, iterators, firsts, metrics, endpoint, started)
            reads = [asyncio.ensure_future(anext(it)) for it in iterators]
            try:
                await asyncio.wait(reads, return_when=asyncio.FIRST_EXCEPTION)
            except BaseException:  # cancelled: the client went away while waiting for the first tokens
                for read in reads:
                    read.cancel()
                await _close(iterators, reads)
                raise
            if not all(read.done() for read in reads):  # one failed: the rest are not wanted
                for read in reads:
                    read.cancel()
            failures = [exc for read in reads
                        if read.done() and not read.cancelled() and (exc := read.exception()) is not None]
            if failures:
                await _close(iterators, reads)  # waits for the cancelled reads, retrieving their outcomes
                raise failures[0]
            firsts = [read.result() for read in reads]
        return cls._started(inputs, iterators, firsts, metrics, endpoint, started)

    @classmethod
    def _started(cls, inputs: list[GenerateInput], iterators: list[AsyncGenerator[Reply, None]], firsts: list[Reply],
                 metrics: GatewayMetrics, endpoint: str, started: float) -> "Generations":
        metrics.prompt_tokens.inc(sum(len(inp.input_ids) for inp in inputs))
        timers = [TokenTimer(metrics, endpoint, started) for _ in inputs]
        now = time.perf_counter()
        for timer, first in zip(timers, firsts):
            timer.tokens(len(first.new.token_ids), now)
        return cls(inputs, iterators, firsts, timers)

    def merged(self) -> AsyncIterator[tuple[int, Reply]]:
        """(index, reply) pairs of all generations as they arrive, until each has its last."""
        # The common case, and a stream's every event: read in the caller's task, no task per reply.
        return self._one() if len(self._iterators) == 1 else self._many()

    async def _many(self) -> AsyncIterator[tuple[int, Reply]]:
        pending: dict[asyncio.Future, int] = {}
        try:
            for i, first in enumerate(self._firsts):
                yield i, first
                if not first.finished:
                    pending[asyncio.ensure_future(anext(self._iterators[i]))] = i
                else:
                    await _end(self._iterators[i])
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=pending.__getitem__):
                    i = pending.pop(future)
                    reply = future.result()
                    self._timers[i].tokens(len(reply.new.token_ids), time.perf_counter())
                    yield i, reply
                    if not reply.finished:
                        pending[asyncio.ensure_future(anext(self._iterators[i]))] = i
                    else:
                        await _end(self._iterators[i])
        finally:
            for future in pending:
                future.cancel()
            await _close(self._iterators, list(pending))

    async def _one(self) -> AsyncIterator[tuple[int, Reply]]:
        iterator, timer = self._iterators[0], self._timers[0]
        try:
            yield 0, self._firsts[0]
            async for reply in iterator:  # after a first reply that was the last, this only ends the generation
                timer.tokens(len(reply.new.token_ids), time.perf_counter())
                yield 0, reply
        finally:
            await _close(self._iterators)

    async def results(self) -> list[Reply]:
        """Every generation's last reply (its whole output, and how it ended), in input order."""
        results: dict[int, Reply] = {}
        async for i, reply in self.merged():
            if reply.finished:
                results[i] = reply
        return [results[i] for i in range(len(self._iterators))]

    async def close(self) -> None:
        await _close(self._iterators)

    @staticmethod
    async def collect(starting: Awaitable["Generations"]) -> list[Reply]:
        """Every last reply (see results) of the generations that `starting` (a start()) starts; closes them either
        way. Awaited whole under unless_disconnected, a request watches its client with one task, not one for its
        start and another for its results."""
        gens = await starting
        try:
            return await gens.results()
        finally:
            await gens.close()


_closing: set[asyncio.Task] = set()  # strong references to close tasks in flight


async def _end(iterator: AsyncGenerator[Reply, None]) -> None:
    """End a generation that has given its last reply: its cleanup runs at once, in the caller's task (closing it
    later takes a task of its own)."""
    await anext(iterator, None)


async def _close(iterators: list[AsyncGenerator[Reply, None]], pending: Iterable[asyncio.Future] = ()) -> None:
    """Close the pipeline iterators (aborting unfinished requests), after the pending reads on them end.

    The pending reads' outcomes (results, exceptions, cancellations) are all retrieved
    here. The closing runs as its own task behind a shield: the caller is often being
    cancelled (Starlette cancels a stream at every await once its client is gone), and
    a cancellation landing inside an iterator's cleanup would skip the abort.
    """

    pending = list(pending)
    if not pending and all(it.ag_frame is None for it in iterators):  # type: ignore[attr-defined]
        return  # each ran to its end or was closed already (an async generator object's frame is gone)

    async def close_all() -> None:
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(it.aclose() for it in iterators), return_exceptions=True)

    task = asyncio.ensure_future(close_all())
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    await asyncio.shield(task)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already, so only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; ClientDisconnect if the client disconnects first (the app answers it as every client
    that left). `work` runs in the caller's task, which a disconnect cancels (as asyncio.timeout does): a
    request pays for one watcher task, not one per awaitable."""
    caller = asyncio.current_task()
    assert caller is not None
    armed, gone = True, False

    def client_gone(watcher: asyncio.Future) -> None:
        nonlocal gone
        if armed and not watcher.cancelled():  # a watcher that failed (its receive raised) counts as gone
            watcher.exception()
            gone = True
            caller.cancel()

    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(client_gone)
    try:
        result = await work
    except asyncio.CancelledError:
        if gone and caller.uncancel() == 0:  # the disconnect's cancellation, and no one else's
            raise ClientDisconnect from None
        raise
    finally:
        armed = False  # a callback already scheduled must not cancel the caller after this
        watcher.cancel()
    if gone:  # `work` caught the disconnect's cancellation and finished: take it back, as if it never came
        caller.uncancel()
    return result
