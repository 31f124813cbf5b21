"""LoRA adapter calls as the gateway answers them: each one made on every scheduler replica (every replica serves
every adapter, so that any may take a request on it) and summed up, as rollout control is (rollout.py).

The adapters served are the schedulers' to say (ModelInfo.lora_adapters): `adapters` asks a replica, so that every
gateway process, whichever loaded an adapter, lists the same ones.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from flatwire_wire.lora import LoraAdapterInfo, LoraAdapterReply
from flatwire_wire.scheduler import SchedulerClient

from services.gateway.engine_client import RequestError
from services.gateway.schedulers import SchedulerPool

MODEL_INFO_TIMEOUT_S = 5.0


@dataclass
class LoraOutcome:
    """A LoRA call on every replica: a success only when each succeeded; each replica's reply kept."""

    success: bool
    message: str
    not_found: bool  # every replica that failed found no such adapter (or path)
    loaded: list[LoraAdapterInfo]  # the first replica's adapters after the call
    replicas: dict[str, LoraAdapterReply]


async def on_every_replica(pool: SchedulerPool, call: Callable[[SchedulerClient], Awaitable[LoraAdapterReply]]
                           ) -> LoraOutcome:
    replicas = sorted(pool.replicas.values(), key=lambda replica: replica.address)
    timeout = pool.config.control_timeout_s

    async def one(client: SchedulerClient, address: str) -> LoraAdapterReply:
        try:
            return await asyncio.wait_for(call(client), timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            why = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                   else f"no answer in {timeout:g} s (--control-timeout-s)")
            return LoraAdapterReply(success=False, message=f"scheduler {address} did not answer: {why}")

    replies = dict(zip([r.address for r in replicas],
                       await asyncio.gather(*(one(r.client, r.address) for r in replicas))))
    if not replies:
        return LoraOutcome(False, "no scheduler replica is known", False, [], {})
    failed = [reply for reply in replies.values() if not reply.success]
    if len(replies) == 1:
        message = next(iter(replies.values())).message
    else:
        message = "; ".join(f"{address}: {reply.message}" for address, reply in replies.items())
    return LoraOutcome(not failed, message, bool(failed) and all(reply.not_found for reply in failed),
                       next(iter(replies.values())).loaded, replies)


async def adapters(pool: SchedulerPool) -> list[LoraAdapterInfo]:
    """The LoRA adapters the schedulers serve now: the first replica's answer (RequestError "unavailable" when
    none answers)."""
    errors = []
    for replica in sorted(pool.replicas.values(), key=lambda replica: (not replica.healthy, replica.address)):
        try:
            return (await replica.client.model_info(timeout=MODEL_INFO_TIMEOUT_S)).lora_adapters
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{replica.address}: {exc.code().name}")
    raise RequestError("unavailable", None, "no scheduler answered with its LoRA adapters: "
                                            f"{'; '.join(errors) or 'none is known'}")
