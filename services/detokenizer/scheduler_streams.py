"""The detokenizer's side of its schedulers: one StreamSteps consumer per replica.

Each configured address may be a DNS name resolving to several replicas; names are
re-resolved periodically and each replica gets its own task, which reconnects with
exponential backoff when its stream breaks. A new subscription starts with the
scheduler's replay (see services/scheduler/output/journal.py); when the replica answers
with another instance id than before, it restarted and `on_restarted` is told first.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
from flatwire_wire.scheduler import AbortRequest, SchedulerClient
from flatwire_wire.steps import StepMessage

from services.common.discovery import host_of, resolve
from services.common.follow import follow_stream
from services.common.rpc import internal_channel
from services.detokenizer.config import DetokenizerConfig

log = logging.getLogger("flatwire.detokenizer")
ABORT_TIMEOUT_S = 10.0


class SchedulerStreams:
    def __init__(self, config: DetokenizerConfig, on_step: Callable[[StepMessage, str], Awaitable[None]],
                 on_failure: Callable[[StepMessage, str], None], on_lost: Callable[[str], None],
                 on_restarted: Callable[[str], None]):
        self.config = config
        self._on_step = on_step
        self._on_failure = on_failure
        self._on_lost = on_lost
        self._on_restarted = on_restarted
        self._instances: dict[str, str] = {}  # replica -> instance id last subscribed to
        self._tasks: dict[str, asyncio.Task] = {}
        self._clients: dict[str, SchedulerClient] = {}
        self._connected: set[str] = set()
        self._unresolved: set[str] = set(config.schedulers)
        self._pending_aborts: set[asyncio.Task] = set()

    def all_connected(self) -> bool:
        return not self._unresolved and bool(self._tasks) and self._connected == set(self._tasks)

    def subscriptions(self) -> dict[str, bool]:
        """Each followed replica -> whether its step stream is subscribed (no output of it can be missed)."""
        return {address: address in self._connected for address in self._tasks}

    async def run(self) -> None:
        try:
            while True:
                await self._refresh()
                await asyncio.sleep(self.config.resolve_interval_s)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def abort(self, scheduler: str, request: AbortRequest) -> None:
        """Fire and forget: the step loop must not wait on a round trip."""
        if client := self._clients.get(scheduler):
            task = asyncio.create_task(self._abort(scheduler, client, request))
            self._pending_aborts.add(task)
            task.add_done_callback(self._pending_aborts.discard)

    async def _abort(self, scheduler: str, client: SchedulerClient, request: AbortRequest) -> None:
        try:
            await client.abort(request, timeout=ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it finished meanwhile
                log.warning("abort of %s on %s failed: %s %s", request.rid, scheduler, exc.code(), exc.details())

    async def _refresh(self) -> None:
        seen: dict[str, str] = {}  # address -> the configured host it was resolved from
        self._unresolved = set()
        for entry in self.config.schedulers:
            addresses = await resolve(entry)
            if not addresses:
                self._unresolved.add(entry)
            seen.update(dict.fromkeys(addresses, host_of(entry)))
        for address in seen.keys() - self._tasks.keys():
            self._tasks[address] = asyncio.create_task(self._follow(address, seen[address]))
        for address in self._tasks.keys() - seen:
            log.info("scheduler %s no longer resolves; unsubscribing", address)
            self._tasks.pop(address).cancel()

    async def _follow(self, address: str, name: str) -> None:
        channel = internal_channel(address, self.config, name)
        client = SchedulerClient(channel)
        self._clients[address] = client

        @asynccontextmanager
        async def subscribe():
            call = client.stream_steps()
            try:
                # A unary round trip on the same connection, answered after the stream was opened,
                # means the scheduler has registered this subscriber: from now on no request it
                # accepts can be missed.
                info = await client.model_info(timeout=10)
                if self._instances.setdefault(address, info.instance_id) != info.instance_id:
                    self._instances[address] = info.instance_id
                    self._on_restarted(address)
                self._connected.add(address)
                log.info("subscribed to scheduler %s", address)
                yield call
            finally:
                self._connected.discard(address)
                self._on_lost(address)
                call.cancel()

        try:
            await follow_stream(f"scheduler {address}", subscribe, lambda step: self._on_step(step, address),
                                lambda step: self._on_failure(step, address), self.config.reconnect_max_s)
        finally:
            self._clients.pop(address, None)
            await channel.close()
