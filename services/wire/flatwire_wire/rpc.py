"""gRPC services whose methods take and return twins (codec.py), never protobuf.

A ServiceSpec pairs each method of a .proto service with the twins of its request and response (checked
against the descriptor at import: a method without twins fails at once). A twin converts through the codec,
or through its own `from_bytes` / `to_bytes` (StepMessage, a view of the parsed message). It gives a server
the handlers of an implementation whose methods are the rpc names in snake_case (`Submit` -> `submit(request,
context)`),
and a client the method's multi-callables, with the conversion in gRPC's own (de)serializers: whatever
calls them, on a blocking or an asyncio channel, sends and receives twins.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

from flatwire_wire.codec import decoder, encoder

# Trailing metadata of an INVALID_ARGUMENT between the services: the field it refuses, in the callee's names.
FIELD_METADATA = "flatwire-field"
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # a status code's number -> grpc.StatusCode


def messages_of(*modules: Any) -> dict[str, type[Message]]:
    """The message classes of generated *_pb2 modules, by full name."""
    return {descriptor.full_name: getattr(module, name) for module in modules
            for name, descriptor in module.DESCRIPTOR.message_types_by_name.items()}


def _decoder(twin: type, proto: type[Message]) -> Callable[[bytes], Any]:
    return twin.from_bytes if hasattr(twin, "from_bytes") else decoder(twin, proto)  # type: ignore[attr-defined]


def _encoder(twin: type, proto: type[Message]) -> Callable[[Any], bytes]:
    return twin.to_bytes if hasattr(twin, "to_bytes") else encoder(proto)  # type: ignore[attr-defined]


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass(frozen=True)
class Method:
    name: str
    path: str  # /package.Service/Name
    client_streaming: bool
    server_streaming: bool
    decode_request: Callable[[bytes], Any]
    encode_request: Callable[[Any], bytes]
    decode_response: Callable[[bytes], Any]
    encode_response: Callable[[Any], bytes]


class ServiceSpec:
    def __init__(self, descriptor: ServiceDescriptor, protos: dict[str, type[Message]],
                 twins: dict[str, tuple[type, type]], response_protos: dict[str, type[Message]] | None = None):
        """`protos`: the service's message classes by full name (messages_of); `twins`: per method, (request twin,
        response twin); `response_protos`: a method's response read and written as this wire-identical message
        instead (the bytes twin GenerateResponsePacked of GenerateResponse)."""
        self.name = descriptor.full_name
        missing = sorted(set(descriptor.methods_by_name) ^ set(twins))
        if missing:
            raise TypeError(f"{self.name}: methods without twins, or twins without a method: {missing}")
        self.methods: dict[str, Method] = {}
        for method in descriptor.methods:
            request_proto = protos[method.input_type.full_name]
            response_proto = (response_protos or {}).get(method.name) or protos[method.output_type.full_name]
            request_twin, response_twin = twins[method.name]
            self.methods[method.name] = Method(
                name=method.name, path=f"/{self.name}/{method.name}", client_streaming=method.client_streaming,
                server_streaming=method.server_streaming, decode_request=_decoder(request_twin, request_proto),
                encode_request=_encoder(request_twin, request_proto),
                decode_response=_decoder(response_twin, response_proto),
                encode_response=_encoder(response_twin, response_proto))

    def handler(self, implementation: Any) -> grpc.GenericRpcHandler:
        """The handlers of `implementation`'s methods, one per rpc (snake_case names)."""
        kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
        handlers = {
            name: kinds[method.client_streaming, method.server_streaming](
                getattr(implementation, snake_case(name)), request_deserializer=method.decode_request,
                response_serializer=method.encode_response)
            for name, method in self.methods.items()}
        return grpc.method_handlers_generic_handler(self.name, handlers)

    def add_to(self, server: grpc.aio.Server, implementation: Any) -> None:
        server.add_generic_rpc_handlers((self.handler(implementation),))

    def calls(self, channel: grpc.Channel | grpc.aio.Channel) -> dict[str, Any]:
        """The multi-callable of each rpc on `channel`, by rpc name."""
        kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                 (True, False): channel.stream_unary, (True, True): channel.stream_stream}
        return {name: kinds[method.client_streaming, method.server_streaming](
                    method.path, request_serializer=method.encode_request,
                    response_deserializer=method.decode_response)
                for name, method in self.methods.items()}
