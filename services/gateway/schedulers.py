"""The gateway's view of its scheduler replicas: balancing, path health, failover.

Each configured address may be a DNS name that resolves to several replicas (as
compose `--scale` and Kubernetes headless services publish them); names are
re-resolved on every health round, so replicas that come and go are followed
(detokenizer names too, in the same round: detokenizers.py).

A replica is in rotation only while its whole path works: it answers, and some
detokenizer that this gateway is connected to follows its step stream (outputs of
a request sent anywhere else would never arrive). Requests go to the replica in
rotation that routing.py picks: where the request's session or prompt prefix went before (that
replica's prefix cache holds it), else the least loaded. When the path breaks (a refused
connection, a detokenizer that answers that it does not follow it), the replica leaves rotation
at once; when it is merely slow (a check, or a submit, that gets no answer in time: a busy host,
a short stall), only after --health-failure-threshold such checks in a row, and while every
replica is out for slowness a new request waits up to --hop-timeout-s for one to come back
rather than failing at once. Its in-flight requests are failed only once the path has stayed
broken for --hop-timeout-s (within that, a restarted detokenizer replays what they
missed), or at once when the replica answers with a new instance id (it restarted,
and their state is gone). Requests the gateway gives up on are aborted in their
scheduler, retried until it confirms.

Rollout control (weight updates, pause, abort_all) goes to every replica, in rotation or not
(each holds weights), and is answered per replica.
"""

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from flatwire_wire.control import ControlReply, WeightsChunk
from flatwire_wire.scheduler import AbortRequest, ModelInfo, SchedulerClient, SchedulerStats, TokenizedRequest

from services.common.discovery import host_of, resolve
from services.common.rpc import internal_blocking_channel, internal_channel
from services.gateway.config import GatewayConfig
from services.gateway.detokenizers import DetokenizerStreams
from services.gateway.routing import Router

log = logging.getLogger("flatwire.gateway")
EXPIRE_INTERVAL_S = 0.25
ABORT_TIMEOUT_S = 2.0
ABORT_RETRY_MAX_S = 2.0
ABORT_GIVE_UP_S = 600.0
PUSH_QUEUE_CHUNKS = 4  # PushWeights chunks waiting for a replica that reads slower than the client sends


def unanswered_prefix(address: str) -> str:
    """How the reply of a replica that did not answer a control call begins (a fault, not a refusal)."""
    return f"scheduler {address} did not answer: "


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    submit_channel: grpc.Channel  # blocking: submits leave from the request's task (flatwire_wire.submit_batch)
    client: SchedulerClient
    healthy: bool = False  # in rotation
    problem: str | None = "not checked yet"  # why its path is broken; None while it works
    slow: bool = False  # out of rotation only for answering late: it may come back any moment
    late_answers: int = 0  # checks (and submits) in a row that got no answer in time
    whole_at: float = field(default_factory=time.monotonic)  # when its path was last found working
    # Since when its path is broken: when a check found it so (a hop down is rechecked at once), or, for one
    # that answers late, its last answer.
    broken_since: float = field(default_factory=time.monotonic)
    instance_id: str = ""
    max_running_requests: int = 0  # its running slots (ModelInfo), for admission control
    outstanding: set[str] = field(default_factory=set)
    followers: set[str] = field(default_factory=set)  # detokenizers last seen following its step stream
    weight_version: str = ""  # of its weights, from its last ModelInfo or control reply ("": not known yet)
    stats: SchedulerStats | None = None  # from its last health round (KV memory, prefix cache)

    @property
    def load(self) -> int:
        return len(self.outstanding)

    async def close(self) -> None:
        self.submit_channel.close()
        await self.channel.close()


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class SchedulerPool:
    def __init__(self, config: GatewayConfig, detokenizers: DetokenizerStreams,
                 on_replica_lost: Callable[[str, str], None]):
        """`detokenizers`: whether a replica's steps reach this gateway; on_replica_lost(address, why): fail the
        requests on it."""
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self.router = Router(config.routing_policy)
        self.detokenizers = detokenizers
        self._on_replica_lost = on_replica_lost
        # Submit and Abort RPCs in flight at once, over all replicas: a burst of thousands (a big batch)
        # would overflow a scheduler's backlog of calls no handler has taken yet, and gRPC cancels the
        # calls beyond it. A call's deadline starts once it is sent.
        self._rpc_slots = asyncio.Semaphore(config.max_concurrent_submits)
        self._tasks: list[asyncio.Task] = []
        self._recheck = asyncio.Event()
        self._back_in_rotation = asyncio.Event()  # set (and cleared) when a replica enters rotation
        self._aborts: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self._refresh()
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._expire_loop())]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._aborts]:
            task.cancel()
        for replica in self.replicas.values():
            await replica.close()

    def recheck(self) -> None:
        """Check every replica's path now rather than at the next round (a hop just came back)."""
        self._recheck.set()

    def followers(self, address: str) -> set[str]:
        """The detokenizers that follow this replica (all of them, before a check has said)."""
        replica = self.replicas.get(address)
        return (replica.followers if replica else set()) or set(self.detokenizers.addresses)

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    def capacity(self) -> int:
        """Running slots of the replicas in rotation (what admission control scales with)."""
        return sum(r.max_running_requests for r in self.replicas.values() if r.healthy)

    def weight_version(self) -> str:
        """The served weights' version: what the replicas report (the most of them, while an update is under way
        or after one failed on some)."""
        versions = Counter(r.weight_version for r in self.replicas.values() if r.weight_version)
        return versions.most_common(1)[0][0] if versions else ""

    def report(self) -> dict[str, dict]:
        return {a: {"in_rotation": r.healthy, "problem": r.problem, "outstanding": len(r.outstanding)}
                for a, r in self.replicas.items()}

    async def model_info(self) -> ModelInfo:
        """From the first replica that answers (waits for one, saying so once: the gateway serves after it)."""
        said = False
        while True:
            errors = []
            for replica in list(self.replicas.values()):
                try:
                    return await replica.client.model_info(timeout=5)
                except grpc.aio.AioRpcError as exc:
                    errors.append(f"{replica.address}: {exc.code().name}")
            if not said:
                log.info("waiting for a scheduler to answer before serving (%s)", "; ".join(errors) or
                         f"{', '.join(self.config.schedulers)} resolves to no address yet")
                said = True
            await asyncio.sleep(0.2)
            await self._refresh()

    async def submit(self, request: TokenizedRequest, routing_key: str | None = None) -> str:
        """Submit to the replica in rotation that the router picks (once an RPC slot is free); returns its
        address. `routing_key`: the client's session key, if any."""
        async with self._rpc_slots:
            return await self._submit(request, routing_key)

    async def _submit(self, request: TokenizedRequest, routing_key: str | None) -> str:
        tried: set[str] = set()
        full: grpc.aio.AioRpcError | None = None  # a replica's refusal: its waiting list is full, or memory released
        wait_until = time.monotonic() + self.config.hop_timeout_s
        while True:
            candidates = [r for r in self.replicas.values() if r.healthy and r.address not in tried]
            if not candidates and full is not None:
                raise full  # every replica that answered refused: 429 when full, 503 when released; not a failure
            if not candidates and not tried and await self._slow_one_back(wait_until):
                continue
            if not candidates:
                problems = "; ".join(f"{r.address}: {r.problem}" for r in self.replicas.values() if r.problem)
                raise _unavailable(f"no scheduler can serve requests now ({problems or 'none'})")
            replica = self.router.choose(candidates, request.input_ids, routing_key)
            replica.outstanding.add(request.rid)
            try:
                await replica.client.submit(request, timeout=self.config.hop_timeout_s)
                replica.late_answers = 0
                return replica.address
            except grpc.aio.AioRpcError as exc:
                replica.outstanding.discard(request.rid)
                if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION):
                    full = exc  # full, or its memory released: not broken, and another replica may take it
                    tried.add(replica.address)
                    continue
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Slow, not broken; the request may have arrived: not sent again elsewhere, stopped there.
                    why = f"scheduler {replica.address} did not answer a submit in {self.config.hop_timeout_s:g}s"
                    self._answered_late(replica, why)
                    self.abort(replica.address, request.rid)
                    raise _unavailable(why) from None
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._take_out(replica, f"scheduler {replica.address} failed a submit: {exc.code().name}")
                tried.add(replica.address)

    async def _slow_one_back(self, deadline: float) -> bool:
        """While some replica is out of rotation for answering late, wait (until `deadline`) for one to come back;
        whether one did."""
        while any(r.slow for r in self.replicas.values()) and not self.any_healthy():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.recheck()
            try:
                await asyncio.wait_for(self._back_in_rotation.wait(), left)
            except TimeoutError:
                return False
        return self.any_healthy()

    def release(self, address: str, rid: str) -> None:
        if replica := self.replicas.get(address):
            replica.outstanding.discard(rid)

    def abort(self, address: str, rid: str) -> None:
        """Stop the request in its scheduler, in the background, retrying until the scheduler confirms
        (or no longer has it) or gives no answer for ABORT_GIVE_UP_S."""
        task = asyncio.create_task(self._abort(address, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, address: str, rid: str) -> None:
        deadline, backoff = time.monotonic() + ABORT_GIVE_UP_S, 0.1
        while (replica := self.replicas.get(address)) is not None and time.monotonic() < deadline:
            try:
                async with self._rpc_slots:
                    await replica.client.abort(AbortRequest(rid=rid), timeout=ABORT_TIMEOUT_S)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # it finished meanwhile, or the scheduler restarted
                    return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, ABORT_RETRY_MAX_S)
        log.warning("gave up aborting %s on scheduler %s", rid, address)

    # -- rollout control --------------------------------------------------------------------------------

    async def control(self, call: Callable[[SchedulerClient], Awaitable[ControlReply]]) -> dict[str, ControlReply]:
        """`call` on every replica at once; per address, its reply (a failed one when it did not answer)."""
        return await self.control_ranked(lambda _, client: call(client))

    async def control_ranked(self, call: Callable[[int, SchedulerClient], Awaitable[ControlReply]]
                             ) -> dict[str, ControlReply]:
        """control(), `call` also given each replica's index in address order (a trainer's group gives each its
        own rank)."""
        replicas = sorted(self.replicas.values(), key=lambda replica: replica.address)
        replies = await asyncio.gather(*(self._control(replica, functools.partial(call, i))
                                         for i, replica in enumerate(replicas)))
        return {replica.address: reply for replica, reply in zip(replicas, replies)}

    async def stats_now(self) -> dict[str, SchedulerStats | None]:
        """Every replica's stats, asked now (the health rounds' may be a round old), by address; None for one that did
        not answer within --health-timeout-s."""
        replicas = sorted(self.replicas.values(), key=lambda replica: replica.address)

        async def ask(replica: Replica) -> SchedulerStats | None:
            try:
                return await replica.client.stats(timeout=self.config.health_timeout_s)
            except grpc.aio.AioRpcError:
                return None

        answers = await asyncio.gather(*(ask(replica) for replica in replicas))
        return {replica.address: stats for replica, stats in zip(replicas, answers)}

    async def push_weights(self, chunks: AsyncIterator[WeightsChunk]) -> dict[str, ControlReply]:
        """One PushWeights stream to every replica, each chunk forwarded to all as it arrives: a few chunks in
        memory, the pace of the slowest replica. A replica that answers early (it refused) stops taking chunks;
        a client that goes away cancels every replica's call, which then applies nothing."""
        replicas = list(self.replicas.values())
        queues: list[asyncio.Queue] = [asyncio.Queue(PUSH_QUEUE_CHUNKS) for _ in replicas]

        async def chunks_of(queue: asyncio.Queue) -> AsyncIterator[WeightsChunk]:
            while (chunk := await queue.get()) is not None:
                yield chunk

        def push(queue: asyncio.Queue) -> Callable[[SchedulerClient], Awaitable[ControlReply]]:
            return lambda client: client.push_weights(chunks_of(queue))

        calls = [asyncio.ensure_future(self._control(replica, push(queue))) for replica, queue in zip(replicas, queues)]

        async def forward(item: WeightsChunk | None) -> None:
            async def one(queue: asyncio.Queue, call: asyncio.Future) -> None:
                put = asyncio.ensure_future(queue.put(item))
                await asyncio.wait({put, call}, return_when=asyncio.FIRST_COMPLETED)
                put.cancel()  # the call ended first: nobody reads this queue any more
            await asyncio.gather(*(one(queue, call) for queue, call in zip(queues, calls)))

        try:
            async for chunk in chunks:
                await forward(chunk)
            await forward(None)
            replies = await asyncio.gather(*calls)
        finally:
            for call in calls:
                call.cancel()
        return {replica.address: reply for replica, reply in zip(replicas, replies)}

    async def _control(self, replica: Replica, call: Callable[[SchedulerClient], Awaitable[ControlReply]]
                       ) -> ControlReply:
        # A long bound: an update waits for the running requests to finish first.
        try:
            reply = await asyncio.wait_for(call(replica.client), self.config.control_timeout_s)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            why = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                   else f"no answer in {self.config.control_timeout_s:g} s (--control-timeout-s)")
            return ControlReply(success=False, weight_version=replica.weight_version,
                                message=f"{unanswered_prefix(replica.address)}{why}")
        replica.weight_version = reply.weight_version
        return reply

    # -- membership and health --------------------------------------------------------------------------

    async def _refresh(self) -> None:
        await self.detokenizers.refresh()
        seen: set[str] = set()
        for entry in self.config.schedulers:
            for address in await resolve(entry):
                seen.add(address)
                if address not in self.replicas:
                    channel = internal_channel(address, self.config, host_of(entry))
                    submit_channel = internal_blocking_channel(address, self.config, host_of(entry))
                    client = SchedulerClient(channel, submit_channel,
                                             orphaned=lambda rid, at=address: self.abort(at, rid))
                    self.replicas[address] = Replica(address, channel, submit_channel, client)
        for address in set(self.replicas) - seen:
            replica = self.replicas.pop(address)
            self._lose(replica, f"scheduler {address} no longer resolves")
            await replica.close()
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))

    async def _check(self, replica: Replica) -> None:
        timeout = self.config.health_timeout_s
        try:
            info = await replica.client.model_info(timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            why = f"scheduler {replica.address} is not answering ({exc.code().name})"
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return self._answered_late(replica, why)
            return self._take_out(replica, why)
        replica.max_running_requests = info.max_running_requests
        replica.weight_version = info.weight_version
        try:
            replica.stats = await replica.client.stats(timeout=timeout)
        except grpc.aio.AioRpcError:
            replica.stats = None
        if info.instance_id != replica.instance_id:
            if replica.instance_id:
                self._lose(replica, f"scheduler {replica.address} restarted: the requests it was running are lost")
            replica.instance_id = info.instance_id
        followed, late = await self.detokenizers.following(replica.address, timeout)
        replica.followers = set(followed) or replica.followers  # kept while none answers: still the likely ones
        if not any(self.detokenizers.connected(a) for a in followed) and late:
            return self._answered_late(replica, f"detokenizer {', '.join(late)} did not answer whether it follows "
                                                f"scheduler {replica.address}")
        if not any(self.detokenizers.connected(a) for a in followed):
            unreachable = [a for a in self.detokenizers.addresses if not self.detokenizers.connected(a)]
            if followed:
                why = f"detokenizer {', '.join(followed)} follows it but is not connected to this gateway"
            elif unreachable:
                why = f"no detokenizer follows its step stream (unreachable: detokenizer {', '.join(unreachable)})"
            else:
                why = "no detokenizer follows its step stream"
            return self._take_out(replica, f"scheduler {replica.address}: {why}")
        replica.problem, replica.whole_at, replica.late_answers = None, time.monotonic(), 0
        if not replica.healthy:
            log.info("scheduler %s in rotation", replica.address)
            replica.healthy, replica.slow = True, False
            self._back_in_rotation.set()
            self._back_in_rotation.clear()

    def _answered_late(self, replica: Replica, why: str) -> None:
        """A check or submit that got no answer in time: out of rotation after --health-failure-threshold in a row
        (one slow answer on a busy host is not an outage)."""
        replica.late_answers += 1
        if replica.late_answers >= self.config.health_failure_threshold:
            self._take_out(replica, f"{why}, {replica.late_answers} times in a row", slow=True)

    def _take_out(self, replica: Replica, why: str, slow: bool = False) -> None:
        """Out of rotation; its requests wait for the path to come back until the hop timeout."""
        if replica.healthy:
            log.warning("out of rotation: %s", why)
        if replica.problem is None:
            replica.broken_since = replica.whole_at if slow else time.monotonic()
        replica.healthy, replica.problem, replica.slow = False, why, slow

    def _lose(self, replica: Replica, why: str) -> None:
        """Fail the replica's in-flight requests now."""
        self._take_out(replica, why)
        if replica.outstanding:
            self._on_replica_lost(replica.address, why)
            replica.outstanding.clear()

    async def _health_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._recheck.wait(), timeout=self.config.health_interval_s)
            except TimeoutError:
                pass
            self._recheck.clear()
            await self._refresh()

    async def _expire_loop(self) -> None:
        """Fail the requests of replicas whose path has stayed broken past the hop timeout."""
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            now = time.monotonic()
            for replica in list(self.replicas.values()):
                broken_for = now - replica.broken_since
                if replica.problem and replica.outstanding and broken_for > self.config.hop_timeout_s:
                    self._lose(replica, f"{replica.problem} (for {broken_for:.1f}s)")
