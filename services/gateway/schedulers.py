"""The gateway's view of its scheduler replicas: balancing, health, failover.

Each configured address may be a DNS name that resolves to several replicas (as
compose `--scale` and Kubernetes headless services publish them); names are
re-resolved on every health round, so replicas that come and go are followed.
Requests go to the healthy replica with the least outstanding work. A replica that
fails its health check is taken out of rotation and its in-flight requests are
ended at once through `on_replica_lost`. A replica (new, or back) joins only once
it answers and every detokenizer reports following its step stream: outputs of a
request submitted earlier would be lost, and the request would never end.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.discovery import resolve, subscription_health_name
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.common.rpc import create_channel
from services.gateway.config import GatewayConfig

log = logging.getLogger("flatwire.gateway")


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    outstanding: set[str] = field(default_factory=set)


class SchedulerPool:
    def __init__(self, config: GatewayConfig, on_replica_lost: Callable[[str, str], None]):
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self._on_replica_lost = on_replica_lost
        self._health_task: asyncio.Task | None = None
        self._detokenizer_channels = [create_channel(a, config.max_message_mb) for a in config.detokenizers]
        self._detokenizers = [health_pb2_grpc.HealthStub(channel) for channel in self._detokenizer_channels]

    async def start(self) -> None:
        await self._refresh()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task:
            self._health_task.cancel()
        for channel in [r.channel for r in self.replicas.values()] + self._detokenizer_channels:
            await channel.close()

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    def stats(self) -> dict[str, dict]:
        return {a: {"healthy": r.healthy, "outstanding": len(r.outstanding)} for a, r in self.replicas.items()}

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
        """Submit to the least-loaded healthy replica; returns its address."""
        tried: set[str] = set()
        while True:
            candidates = [r for r in self.replicas.values() if r.healthy and r.address not in tried]
            if not candidates:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="no healthy scheduler")
            replica = min(candidates, key=lambda r: len(r.outstanding))
            replica.outstanding.add(request.rid)
            try:
                await replica.stub.Submit(request, timeout=30)
                return replica.address
            except grpc.aio.AioRpcError as exc:
                replica.outstanding.discard(request.rid)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._mark_down(replica, "unavailable on submit")
                tried.add(replica.address)

    def release(self, address: str, rid: str) -> None:
        if replica := self.replicas.get(address):
            replica.outstanding.discard(rid)

    async def abort(self, address: str, rid: str) -> None:
        replica = self.replicas.get(address)
        if replica is None or not replica.healthy:
            return
        try:
            await replica.stub.Abort(scheduler_pb2.AbortRequest(rid=rid), timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # it finished meanwhile
                log.warning("abort of %s on %s failed: %s", rid, address, exc.code())

    # -- membership and health --------------------------------------------------------------------------

    async def _refresh(self) -> None:
        seen: set[str] = set()
        for entry in self.config.schedulers:
            for address in await resolve(entry):
                seen.add(address)
                if address not in self.replicas:
                    channel = create_channel(address, self.config.max_message_mb)
                    self.replicas[address] = Replica(address, channel, scheduler_pb2_grpc.SchedulerStub(channel),
                                                     health_pb2_grpc.HealthStub(channel))
        for address in set(self.replicas) - seen:
            replica = self.replicas.pop(address)
            self._mark_down(replica, "no longer resolves")
            await replica.channel.close()
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))

    async def _check(self, replica: Replica) -> None:
        timeout = max(self.config.health_interval_s, 3.0)  # a busy replica is slow, not dead
        up, *followed = await asyncio.gather(
            _serving(replica.health, "", timeout),
            *(_serving(d, subscription_health_name(replica.address), timeout) for d in self._detokenizers))
        # followed: per detokenizer, True (carries this replica's outputs), False (does not), None (no answer).
        if not up:
            self._mark_down(replica, "health check failed")
        elif True in followed:
            if not replica.healthy:
                log.info("scheduler %s in rotation", replica.address)
                replica.healthy = True
        elif all(f is False for f in followed):
            self._mark_down(replica, "no detokenizer follows its step stream")

    def _mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("scheduler %s out of rotation: %s", replica.address, reason)
        replica.healthy = False
        if replica.outstanding:
            self._on_replica_lost(replica.address, reason)
            replica.outstanding.clear()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self._refresh()


async def _serving(health: health_pb2_grpc.HealthStub, service: str, timeout: float) -> bool | None:
    """SERVING -> True; NOT_SERVING or unknown service -> False; no answer -> None."""
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return False if exc.code() == grpc.StatusCode.NOT_FOUND else None
    return reply.status == health_pb2.HealthCheckResponse.SERVING
