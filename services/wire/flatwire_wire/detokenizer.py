"""The detokenizer's internal API (flatwire/internal/v1/detokenizer.proto): each gateway (owner) subscribes to the
outputs of its own requests, StepMessages with their text deltas."""

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from flatwire_wire.codec import twin
from flatwire_wire.pb import arrays_pb2, detokenizer_pb2, scheduler_pb2
from flatwire_wire.rpc import ServiceSpec, messages_of
from flatwire_wire.steps import StepMessage


@twin(detokenizer_pb2.StreamOutputsRequest)
@dataclass
class StreamOutputsRequest:
    owner: str  # the subscribing gateway's id


DETOKENIZER = ServiceSpec(
    detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"],
    messages_of(detokenizer_pb2, scheduler_pb2, arrays_pb2),
    twins={"StreamOutputs": (StreamOutputsRequest, StepMessage)})


class DetokenizerServicer(Protocol):
    def stream_outputs(self, request: StreamOutputsRequest, context: Any) -> AsyncIterator[StepMessage]: ...


class DetokenizerClient:
    def __init__(self, channel: grpc.aio.Channel):
        self._calls = DETOKENIZER.calls(channel)

    def stream_outputs(self, owner: str) -> Any:
        """The owner's outputs: a grpc.aio call whose iteration yields StepMessages."""
        return self._calls["StreamOutputs"](StreamOutputsRequest(owner=owner))
