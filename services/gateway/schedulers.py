"""The gateway's view of its scheduler replicas: balancing, path health, failover.

Each configured address may be a DNS name that resolves to several replicas (as
compose `--scale` and Kubernetes headless services publish them); names are
re-resolved on every health round, so replicas that come and go are followed.

A replica is in rotation only while its whole path works: it answers, and some
detokenizer that this gateway is connected to follows its step stream (outputs of
a request sent anywhere else would never arrive). Requests go to the replica in
rotation with the least outstanding work. When the path breaks, the replica leaves
rotation at once; its in-flight requests are failed only once the path has stayed
broken for --hop-timeout-s (within that, a restarted detokenizer replays what they
missed), or at once when the replica answers with a new instance id (it restarted,
and their state is gone). Requests the gateway gives up on are aborted in their
scheduler, retried until it confirms.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.discovery import resolve, subscription_health_name
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.common.rpc import create_channel
from services.gateway.config import GatewayConfig

log = logging.getLogger("flatwire.gateway")
EXPIRE_INTERVAL_S = 0.25
ABORT_TIMEOUT_S = 2.0
ABORT_RETRY_MAX_S = 2.0
ABORT_GIVE_UP_S = 600.0


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    healthy: bool = False  # in rotation
    problem: str | None = "not checked yet"  # why its path is broken; None while it works
    whole_at: float = field(default_factory=time.monotonic)  # when its path was last found working
    instance_id: str = ""
    max_running_requests: int = 0  # its running slots (ModelInfo), for admission control
    outstanding: set[str] = field(default_factory=set)
    followers: set[str] = field(default_factory=set)  # detokenizers last seen following its step stream


class SchedulerPool:
    def __init__(self, config: GatewayConfig, on_replica_lost: Callable[[str, str], None],
                 delivering: Callable[[str], bool]):
        """on_replica_lost(address, why): fail the requests on it. delivering(detokenizer): whether this
        gateway's output stream from that detokenizer is connected."""
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self._on_replica_lost = on_replica_lost
        self._delivering = delivering
        # Submit and Abort RPCs in flight at once, over all replicas: a burst of thousands (a big batch)
        # would overflow a scheduler's backlog of calls no handler has taken yet, and gRPC cancels the
        # calls beyond it. A call's deadline starts once it is sent.
        self._rpc_slots = asyncio.Semaphore(config.max_concurrent_submits)
        self._tasks: list[asyncio.Task] = []
        self._recheck = asyncio.Event()
        self._aborts: set[asyncio.Task] = set()
        self._detokenizer_channels = {a: create_channel(a, config.max_message_mb, config.keepalive_s,
                                                        internal_secret=config.internal_secret)
                                      for a in config.detokenizers}
        self._detokenizers = {a: health_pb2_grpc.HealthStub(c) for a, c in self._detokenizer_channels.items()}

    async def start(self) -> None:
        await self._refresh()
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._expire_loop())]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._aborts]:
            task.cancel()
        for channel in [r.channel for r in self.replicas.values()] + list(self._detokenizer_channels.values()):
            await channel.close()

    def recheck(self) -> None:
        """Check every replica's path now rather than at the next round (a hop just came back)."""
        self._recheck.set()

    def followers(self, address: str) -> set[str]:
        """The detokenizers that follow this replica (all of them, before a check has said)."""
        replica = self.replicas.get(address)
        return (replica.followers if replica else set()) or set(self._detokenizers)

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    def capacity(self) -> int:
        """Running slots of the replicas in rotation (what admission control scales with)."""
        return sum(r.max_running_requests for r in self.replicas.values() if r.healthy)

    def report(self) -> dict[str, dict]:
        return {a: {"in_rotation": r.healthy, "problem": r.problem, "outstanding": len(r.outstanding)}
                for a, r in self.replicas.items()}

    async def model_info(self) -> scheduler_pb2.ModelInfo:
        """From the first replica that answers (waits for one)."""
        while True:
            for replica in list(self.replicas.values()):
                try:
                    return await replica.stub.GetModelInfo(scheduler_pb2.ModelInfoRequest(), timeout=5)
                except grpc.aio.AioRpcError:
                    continue
            await asyncio.sleep(0.2)
            await self._refresh()

    async def submit(self, request: scheduler_pb2.TokenizedRequest) -> str:
        """Submit to the least-loaded replica in rotation (once an RPC slot is free); returns its address."""
        async with self._rpc_slots:
            return await self._submit(request)

    async def _submit(self, request: scheduler_pb2.TokenizedRequest) -> str:
        tried: set[str] = set()
        full: grpc.aio.AioRpcError | None = None  # a replica's refusal: its waiting list is full
        while True:
            candidates = [r for r in self.replicas.values() if r.healthy and r.address not in tried]
            if not candidates and full is not None:
                raise full  # every replica that answered is full: RESOURCE_EXHAUSTED (429), not a failure
            if not candidates:
                problems = "; ".join(f"{r.address}: {r.problem}" for r in self.replicas.values() if r.problem)
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details=f"no scheduler can serve requests now ({problems or 'none'})")
            replica = min(candidates, key=lambda r: len(r.outstanding))
            replica.outstanding.add(request.rid)
            try:
                await replica.stub.Submit(request, timeout=self.config.hop_timeout_s)
                return replica.address
            except grpc.aio.AioRpcError as exc:
                replica.outstanding.discard(request.rid)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy, not broken: try another replica
                    full = exc
                    tried.add(replica.address)
                    continue
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                self._take_out(replica, f"scheduler {replica.address} failed a submit: {exc.code().name}")
                tried.add(replica.address)

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
                    await replica.stub.Abort(scheduler_pb2.AbortRequest(rid=rid), timeout=ABORT_TIMEOUT_S)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # it finished meanwhile, or the scheduler restarted
                    return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, ABORT_RETRY_MAX_S)
        log.warning("gave up aborting %s on scheduler %s", rid, address)

    # -- membership and health --------------------------------------------------------------------------

    async def _refresh(self) -> None:
        seen: set[str] = set()
        for entry in self.config.schedulers:
            for address in await resolve(entry):
                seen.add(address)
                if address not in self.replicas:
                    channel = create_channel(address, self.config.max_message_mb, self.config.keepalive_s,
                                             internal_secret=self.config.internal_secret)
                    self.replicas[address] = Replica(address, channel, scheduler_pb2_grpc.SchedulerStub(channel))
        for address in set(self.replicas) - seen:
            replica = self.replicas.pop(address)
            self._lose(replica, f"scheduler {address} no longer resolves")
            await replica.channel.close()
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))

    async def _check(self, replica: Replica) -> None:
        timeout = self.config.health_timeout_s
        try:
            info = await replica.stub.GetModelInfo(scheduler_pb2.ModelInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return self._take_out(replica, f"scheduler {replica.address} is not answering ({exc.code().name})")
        replica.max_running_requests = info.max_running_requests
        if info.instance_id != replica.instance_id:
            if replica.instance_id:
                self._lose(replica, f"scheduler {replica.address} restarted: the requests it was running are lost")
            replica.instance_id = info.instance_id
        name = subscription_health_name(replica.address)
        follows = await asyncio.gather(*(_serving(stub, name, timeout) for stub in self._detokenizers.values()))
        followed = [a for a, f in zip(self._detokenizers, follows) if f]
        replica.followers = set(followed) or replica.followers  # kept while none answers: still the likely ones
        if not any(self._delivering(a) for a in followed):
            unreachable = [a for a in self._detokenizers if not self._delivering(a)]
            if followed:
                why = f"detokenizer {', '.join(followed)} follows it but is not connected to this gateway"
            elif unreachable:
                why = f"no detokenizer follows its step stream (unreachable: detokenizer {', '.join(unreachable)})"
            else:
                why = "no detokenizer follows its step stream"
            return self._take_out(replica, f"scheduler {replica.address}: {why}")
        replica.problem, replica.whole_at = None, time.monotonic()
        if not replica.healthy:
            log.info("scheduler %s in rotation", replica.address)
            replica.healthy = True

    def _take_out(self, replica: Replica, why: str) -> None:
        """Out of rotation; its requests wait for the path to come back until the hop timeout."""
        if replica.healthy:
            log.warning("out of rotation: %s", why)
        replica.healthy, replica.problem = False, why

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
                broken_for = now - replica.whole_at
                if replica.problem and replica.outstanding and broken_for > self.config.hop_timeout_s:
                    self._lose(replica, f"{replica.problem} (for {broken_for:.1f}s)")


async def _serving(health: health_pb2_grpc.HealthStub, service: str, timeout: float) -> bool:
    """SERVING -> True; NOT_SERVING, unknown service or no answer -> False."""
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
