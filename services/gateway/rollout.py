"""Rollout control as the gateway's APIs answer it: one outcome of a call made on every scheduler replica.

The HTTP routes (http/rollout.py, SGLang's shapes) and the public gRPC methods (grpc_api.py) both
forward to every replica (SchedulerPool.control, push_weights) and answer with this summary: a
success only when every replica succeeded, each replica's reply kept.
"""

import dataclasses
from typing import Literal

from flatwire_wire import control
from flatwire_wire.control import ControlReply, InitWeightsUpdateGroupRequest
from flatwire_wire.public import ControlResponse
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.schedulers import SchedulerPool


class InitWeightsUpdateGroupInput(BaseModel):
    """SGLang's InitWeightsUpdateGroupReqInput, checked the same way for both APIs (a bad address or port would
    have every replica wait out the rendezvous). Replica i (in address order) joins as rank rank_offset + i: a
    trainer sizes world_size as 1 + the replicas. backend: none, nccl on CUDA and gloo on CPU."""

    model_config = ConfigDict(extra="forbid")
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = control.DEFAULT_GROUP
    backend: Literal["nccl", "gloo"] | None = None

    def message(self) -> InitWeightsUpdateGroupRequest:
        return InitWeightsUpdateGroupRequest(
            master_address=self.master_address, master_port=self.master_port, rank_offset=self.rank_offset,
            world_size=self.world_size, group_name=self.group_name, backend=self.backend or "")


def control_response(replies: dict[str, ControlReply]) -> ControlResponse:
    if not replies:
        return ControlResponse(success=False, message="no scheduler replica is known")
    if len(replies) == 1:
        message = next(iter(replies.values())).message
    else:
        message = "; ".join(f"{address}: {reply.message}" for address, reply in sorted(replies.items()))
    return ControlResponse(success=all(reply.success for reply in replies.values()), message=message, replicas=replies)


async def init_weights_update_group(schedulers: SchedulerPool, request: InitWeightsUpdateGroupRequest
                                    ) -> ControlResponse:
    """Every replica joins the trainer's group, replica i (in address order) as rank rank_offset + i. A world
    too small for every replica is refused before any joins (the others would wait out the rendezvous)."""
    replicas = len(schedulers.replicas)
    if request.rank_offset + replicas > request.world_size:
        return ControlResponse(success=False, message=(
            f"world_size: {request.world_size} ranks cannot hold {replicas} scheduler replicas from rank_offset "
            f"{request.rank_offset}; make it at least {request.rank_offset + replicas}"))
    return control_response(await schedulers.control_ranked(lambda i, client: client.init_weights_update_group(
        dataclasses.replace(request, rank_offset=request.rank_offset + i))))
