"""flatwire's public gRPC API (flatwire.v1.Generation), sync and asyncio: raw little-endian arrays into numpy."""

from collections.abc import AsyncIterator, Iterator

import grpc

from flatwire_client.pb import generate_pb2, scheduler_pb2
from flatwire_client.requests import Options
from flatwire_client.results import ChunkStream, Generation, generation

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE, MODEL_INFO = f"/{SERVICE}/Generate", f"/{SERVICE}/GetModelInfo"


def _channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The gateway's --api-key, as `authorization: Bearer` metadata."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _methods(channel):
    """The Generate and GetModelInfo callables of a channel (blocking or grpc.aio: the same calls)."""
    return (channel.unary_stream(GENERATE, request_serializer=generate_pb2.GenerateRequest.SerializeToString,
                                 response_deserializer=generate_pb2.GenerateResponsePacked.FromString),
            channel.unary_unary(MODEL_INFO, request_serializer=scheduler_pb2.ModelInfoRequest.SerializeToString,
                                response_deserializer=scheduler_pb2.ModelInfo.FromString))


class GenerationStream(ChunkStream):
    """`for chunk in stream`, then `stream.result` (see ChunkStream)."""

    def __init__(self, responses, input_ids: list[int] | None):
        super().__init__(input_ids)
        self._responses = responses

    def __iter__(self) -> Iterator[Generation]:
        for response in self._responses:
            yield self._take(response)


class FlatwireClient:
    """Blocking client. Options of generate() and stream(): the fields of requests.Options."""

    def __init__(self, address: str, max_message_mb: int = 1024, api_key: str | None = None):
        self._metadata = _metadata(api_key)
        self._channel = grpc.insecure_channel(address, options=_channel_options(max_message_mb))
        self._generate, self._model_info = _methods(self._channel)

    def __enter__(self) -> "FlatwireClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def model_info(self) -> scheduler_pb2.ModelInfo:
        return self._model_info(scheduler_pb2.ModelInfoRequest(), metadata=self._metadata)

    def generate(self, text: str | None = None, input_ids: list[int] | None = None, timeout: float | None = None,
                 **options) -> Generation:
        request = Options(**options).grpc_request(text, input_ids, stream=False)
        *_, last = self._generate(request, timeout=timeout, metadata=self._metadata)
        return generation(last, input_ids)

    def stream(self, text: str | None = None, input_ids: list[int] | None = None, timeout: float | None = None,
               **options) -> GenerationStream:
        request = Options(**options).grpc_request(text, input_ids, stream=True)
        return GenerationStream(self._generate(request, timeout=timeout, metadata=self._metadata), input_ids)


class AsyncGenerationStream(ChunkStream):
    """GenerationStream's asyncio twin: `async for chunk in stream`, then `stream.result`."""

    def __init__(self, responses, input_ids: list[int] | None):
        super().__init__(input_ids)
        self._responses = responses

    async def __aiter__(self) -> AsyncIterator[Generation]:
        async for response in self._responses:
            yield self._take(response)


class AsyncFlatwireClient:
    """asyncio client (grpc.aio); the same options as FlatwireClient."""

    def __init__(self, address: str, max_message_mb: int = 1024, api_key: str | None = None):
        self._metadata = _metadata(api_key)
        self._channel = grpc.aio.insecure_channel(address, options=_channel_options(max_message_mb))
        self._generate, self._model_info = _methods(self._channel)

    async def __aenter__(self) -> "AsyncFlatwireClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def model_info(self) -> scheduler_pb2.ModelInfo:
        return await self._model_info(scheduler_pb2.ModelInfoRequest(), metadata=self._metadata)

    async def generate(self, text: str | None = None, input_ids: list[int] | None = None,
                       timeout: float | None = None, **options) -> Generation:
        request = Options(**options).grpc_request(text, input_ids, stream=False)
        responses = [response async for response in self._generate(request, timeout=timeout,
                                                                         metadata=self._metadata)]
        return generation(responses[-1], input_ids)  # without stream: one response

    def stream(self, text: str | None = None, input_ids: list[int] | None = None, timeout: float | None = None,
               **options) -> AsyncGenerationStream:
        request = Options(**options).grpc_request(text, input_ids, stream=True)
        return AsyncGenerationStream(self._generate(request, timeout=timeout, metadata=self._metadata), input_ids)
