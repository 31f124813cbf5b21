"""The gateway's side of the detokenizers: which there are, and this gateway's output stream from each.

The configured names are re-resolved on every health round of the scheduler pool (a name may stand for
several detokenizers: one beside each scheduler in Kubernetes); each address gets one StreamOutputs
subscription as this gateway's owner id, on which the StepMessages of its requests arrive (`on_step`).
Reconnection retries fast (loopback or a cluster network: an attempt is cheap), since requests wait for it
only up to the hop timeout. A stream cut by the same detokenizer process lost what was in transit
(`on_cut`); one that comes back from a new process is replayed everything, so nothing is failed then.

Whether a detokenizer follows a scheduler replica is its own gRPC health answer
(discovery.subscription_health_name): the pool asks `following` before putting a replica in rotation.
"""

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import grpc
from flatwire_wire.detokenizer import DetokenizerClient
from flatwire_wire.steps import StepMessage
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.discovery import INSTANCE_METADATA, host_of, resolve, subscription_health_name
from services.common.follow import follow_stream
from services.common.rpc import internal_channel
from services.gateway.config import GatewayConfig

log = logging.getLogger("flatwire.gateway")
RECONNECT_MAX_S = 0.5


class DetokenizerStreams:
    def __init__(self, config: GatewayConfig, owner: str, on_step: Callable[[StepMessage], None],
                 on_step_failed: Callable[[StepMessage], None], on_cut: Callable[[str], None],
                 on_change: Callable[[], None]):
        """on_step(message): a message for this gateway's requests; on_step_failed(message): handling it raised;
        on_cut(address): a stream from the same process broke, its messages in transit lost; on_change(): a
        stream came up or went down."""
        self.config = config
        self.owner = owner
        self._on_step = on_step
        self._on_step_failed = on_step_failed
        self._on_cut = on_cut
        self._on_change = on_change
        self._resolved: dict[str, list[str]] = {}  # configured entry -> its addresses
        self._names: dict[str, str] = {}  # address -> the configured host it was resolved from
        self._channels: dict[str, grpc.aio.Channel] = {}  # address -> the channel of its health checks
        self._health: dict[str, health_pb2_grpc.HealthStub] = {}
        self._streams: dict[str, asyncio.Task] = {}  # address -> its output stream's consumer
        self._instances: dict[str, str | None] = {}  # address -> the process last followed
        self._connected: set[str] = set()

    @property
    def addresses(self) -> list[str]:
        """The detokenizers the configured names resolve to."""
        return list(self._health)

    def connected(self, address: str) -> bool:
        """This gateway's output stream from `address` is up."""
        return address in self._connected

    def report(self) -> dict[str, bool]:
        return {address: address in self._connected for address in self._health}

    async def refresh(self) -> None:
        """Follow the detokenizers the configured names resolve to. A name that resolves to nothing keeps the
        addresses it had: a DNS hiccup must not cut output streams (what is in transit on them would be lost)."""
        for entry in self.config.detokenizers:
            self._resolved[entry] = await resolve(entry) or self._resolved.get(entry, [])
        current = {address: host_of(entry) for entry, addresses in self._resolved.items() for address in addresses}
        for address in current.keys() - self._health.keys():
            self._names[address] = current[address]
            channel = internal_channel(address, self.config, current[address])
            self._channels[address] = channel
            self._health[address] = health_pb2_grpc.HealthStub(channel)
            self._streams[address] = asyncio.create_task(self._follow(address))
        gone = self._health.keys() - current.keys()
        for address in gone:
            log.info("detokenizer %s no longer resolves", address)
            del self._health[address]
            self._streams.pop(address).cancel()
            self._instances.pop(address, None)
        await asyncio.gather(*(self._channels.pop(address).close() for address in gone))

    async def following(self, scheduler: str, timeout: float) -> tuple[list[str], list[str]]:
        """(The detokenizers that answer, now, that they follow the step stream of replica `scheduler`; those that
        gave no answer within `timeout`: busy or stopped, they may follow it yet.)"""
        name = subscription_health_name(scheduler)
        checked = list(self._health.items())  # as of now: the names may be re-resolved meanwhile
        follows = await asyncio.gather(*(_serving(stub, name, timeout) for _, stub in checked))
        return ([address for (address, _), yes in zip(checked, follows) if yes],
                [address for (address, _), yes in zip(checked, follows) if yes is None])

    async def stop(self) -> None:
        streams = list(self._streams.values())
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()

    async def _follow(self, address: str) -> None:
        """Consume this gateway's outputs from one detokenizer, resubscribing when the stream ends."""

        @asynccontextmanager
        async def subscribe():
            channel = internal_channel(address, self.config, self._names.get(address))
            try:
                call = DetokenizerClient(channel).stream_outputs(self.owner)
                metadata = await call.initial_metadata()
                if call.done():  # failed before the detokenizer answered (gRPC hands out empty metadata then)
                    await call.read()  # raises the call's error: the stream was never up
                instance = dict(metadata).get(INSTANCE_METADATA)
                if instance is not None and self._instances.get(address) == instance:
                    self._on_cut(address)  # the same process after a cut: what was in transit is lost
                self._instances[address] = instance
                self._connected.add(address)
                self._on_change()
                yield call
            finally:
                if address in self._connected:
                    self._connected.discard(address)
                    self._on_change()
                await channel.close()

        async def handle(step: StepMessage) -> None:
            self._on_step(step)

        await follow_stream(f"detokenizer {address}", subscribe, handle, self._on_step_failed, RECONNECT_MAX_S)


async def _serving(health: health_pb2_grpc.HealthStub, service: str, timeout: float) -> bool | None:
    """SERVING -> True; NOT_SERVING, unknown service or a refusal -> False; no answer in time -> None."""
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return None if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
    except grpc.aio.UsageError:  # its name stopped resolving, channel closed
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
