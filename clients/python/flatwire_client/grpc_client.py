"""flatwire's public gRPC API (flatwire.v1.Generation), sync and asyncio: raw little-endian arrays into numpy.

Rollout control (RL trainers) too: update weights from a checkpoint on the schedulers' disk or push them as
safetensors (a dict of tensors needs the `safetensors` package; a .safetensors file is sent as it is), pause
and continue, abort. Each returns the gateway's ControlResponse: success, message, and each scheduler
replica's reply.
"""

import os
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from flatwire_wire.control import (
    DEFAULT_GROUP,
    EMPTY,
    AbortAllRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    PauseMode,
    ReleaseMemoryOccupationRequest,
    ResumeMemoryOccupationRequest,
    TensorShape,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    WeightsChunk,
)
from flatwire_wire.public import GENERATION, AbortGenerationRequest, ControlResponse, ModelInfo

from flatwire_client.requests import Options
from flatwire_client.results import ChunkStream, Generation, generation

PAUSE_MODES = {"abort": PauseMode.ABORT, "in_place": PauseMode.IN_PLACE, "retract": PauseMode.RETRACT,
               "wait": PauseMode.WAIT}
PUSH_CHUNK_BYTES = 4 * 1024 * 1024  # within the gateway's --max-request-mb (32 by default)


def _channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The gateway's --api-key (or --admin-api-key), as `authorization: Bearer` metadata."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


@dataclass
class _Methods:
    """The public API's callables on a channel (blocking or grpc.aio: the same calls), in the wire layer's twins."""

    generate: Any
    model_info: Any
    abort: Any
    update_weights_from_disk: Any
    push_weights: Any
    pause_generation: Any
    continue_generation: Any
    abort_all: Any
    update_weight_version: Any
    init_weights_update_group: Any
    update_weights_from_distributed: Any
    destroy_weights_update_group: Any
    release_memory_occupation: Any
    resume_memory_occupation: Any
    flush_cache: Any


def _methods(channel) -> _Methods:
    calls = GENERATION.calls(channel)
    return _Methods(generate=calls["Generate"], model_info=calls["GetModelInfo"], abort=calls["Abort"],
                    update_weights_from_disk=calls["UpdateWeightsFromDisk"], push_weights=calls["PushWeights"],
                    pause_generation=calls["PauseGeneration"], continue_generation=calls["ContinueGeneration"],
                    abort_all=calls["AbortAll"], update_weight_version=calls["UpdateWeightVersion"],
                    init_weights_update_group=calls["InitWeightsUpdateGroup"],
                    update_weights_from_distributed=calls["UpdateWeightsFromDistributed"],
                    destroy_weights_update_group=calls["DestroyWeightsUpdateGroup"],
                    release_memory_occupation=calls["ReleaseMemoryOccupation"],
                    resume_memory_occupation=calls["ResumeMemoryOccupation"], flush_cache=calls["FlushCache"])


def _safetensors_bytes(tensors: Mapping[str, Any]) -> bytes:
    """A dict of torch tensors or numpy arrays as one safetensors file (needs the `safetensors` package)."""
    try:
        if any(hasattr(value, "detach") for value in tensors.values()):
            from safetensors.torch import save
            return save({name: value.detach().cpu().contiguous() for name, value in tensors.items()})
        from safetensors.numpy import save as save_numpy
        return save_numpy({name: np.ascontiguousarray(value) for name, value in tensors.items()})
    except ImportError:
        raise ImportError("push_weights with a dict of tensors needs the safetensors package (pip install "
                          "safetensors); or pass the path of a .safetensors file") from None


def _weight_chunks(weights: Mapping[str, Any] | str | os.PathLike, abort_all_requests: bool,
                   weight_version: str | None, chunk_bytes: int) -> Iterator[WeightsChunk]:
    """A safetensors file (read as it is sent) or a dict of tensors, as PushWeights chunks; options in the first."""
    if isinstance(weights, Mapping):
        data = memoryview(_safetensors_bytes(weights))
        parts: Iterator[bytes] = (bytes(data[at:at + chunk_bytes]) for at in range(0, len(data), chunk_bytes))
    else:
        def read(path: str | os.PathLike) -> Iterator[bytes]:
            with open(path, "rb") as file:
                while part := file.read(chunk_bytes):
                    yield part
        parts = read(weights)
    first = True
    for part in parts:
        yield WeightsChunk(safetensors=part, abort_all_requests=abort_all_requests and first,
                           weight_version=weight_version if first else None)
        first = False


def _from_disk(model_path: str, load_format: str | None, abort_all_requests: bool,
               weight_version: str | None) -> UpdateWeightsFromDiskRequest:
    return UpdateWeightsFromDiskRequest(model_path=str(model_path), load_format=load_format or "",
                                        abort_all_requests=abort_all_requests, weight_version=weight_version)


def _join_group(master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                backend: str | None) -> InitWeightsUpdateGroupRequest:
    return InitWeightsUpdateGroupRequest(master_address=master_address, master_port=master_port,
                                         rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                         backend=backend or "")


def _from_distributed(names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                      load_format: str | None, abort_all_requests: bool,
                      weight_version: str | None) -> UpdateWeightsFromDistributedRequest:
    return UpdateWeightsFromDistributedRequest(
        names=list(names), dtypes=[str(dtype).removeprefix("torch.") for dtype in dtypes],
        shapes=[TensorShape(dims=list(shape)) for shape in shapes], group_name=group_name,
        load_format=load_format or "", abort_all_requests=abort_all_requests, weight_version=weight_version)


class GenerationStream(ChunkStream):
    """`for chunk in stream`, then `stream.result` (see ChunkStream). Leaving the loop early (break, an
    exception) or `cancel()` cancels the call: the gateway aborts the request."""

    def __init__(self, responses):
        super().__init__()
        self._responses = responses

    def __iter__(self) -> Iterator[Generation]:
        try:
            for response in self._responses:
                yield self._take(response)
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the request (nothing once the stream has ended)."""
        self._responses.cancel()


def _tls_credentials(tls: bool | bytes) -> grpc.ChannelCredentials | None:
    """False: plaintext; True: TLS checked against the system's roots; bytes: against this CA (PEM)."""
    if not tls:
        return None
    return grpc.ssl_channel_credentials(tls if isinstance(tls, bytes) else None)


class FlatwireClient:
    """Blocking client. Options of generate() and stream(): the fields of requests.Options."""

    def __init__(self, address: str, max_message_mb: int = 1024, api_key: str | None = None,
                 admin_api_key: str | None = None, tls: bool | bytes = False):
        """`admin_api_key`: what the rollout-control methods send (default: api_key). `tls`: True for a gateway
        started with --ssl-certfile whose certificate the system trusts, or the PEM bytes of the CA that signed
        it."""
        self._metadata = _metadata(api_key)
        self._admin_metadata = _metadata(admin_api_key or api_key)
        options = _channel_options(max_message_mb)
        credentials = _tls_credentials(tls)
        self._channel = (grpc.secure_channel(address, credentials, options=options) if credentials
                         else grpc.insecure_channel(address, options=options))
        self._calls = _methods(self._channel)

    def __enter__(self) -> "FlatwireClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def model_info(self) -> ModelInfo:
        return self._calls.model_info(EMPTY, metadata=self._metadata)

    def generate(self, text: str | None = None, input_ids: list[int] | None = None, timeout: float | None = None,
                 **options) -> Generation:
        request = Options(**options).grpc_request(text, input_ids, stream=False)
        *_, last = self._calls.generate(request, timeout=timeout, metadata=self._metadata)
        return generation(last)

    def stream(self, text: str | None = None, input_ids: list[int] | None = None, timeout: float | None = None,
               **options) -> GenerationStream:
        request = Options(**options).grpc_request(text, input_ids, stream=True)
        return GenerationStream(self._calls.generate(request, timeout=timeout, metadata=self._metadata))

    def abort(self, rid: str, timeout: float | None = None) -> ControlResponse:
        """Stop this gateway's request `rid` (a response's rid): it ends with finish_reason "abort"."""
        return self._calls.abort(AbortGenerationRequest(rid=rid), timeout=timeout,
                                 metadata=self._metadata)

    # -- rollout control (admin) --

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False, weight_version: str | None = None,
                                 timeout: float | None = None) -> ControlResponse:
        return self._calls.update_weights_from_disk(
            _from_disk(model_path, load_format, abort_all_requests, weight_version), timeout=timeout,
            metadata=self._admin_metadata)

    def push_weights(self, weights: Mapping[str, Any] | str | os.PathLike, abort_all_requests: bool = False,
                     weight_version: str | None = None, chunk_bytes: int = PUSH_CHUNK_BYTES,
                     timeout: float | None = None) -> ControlResponse:
        """Named tensors (any subset of the model's; torch or numpy) or a .safetensors file, to every replica."""
        return self._calls.push_weights(_weight_chunks(weights, abort_all_requests, weight_version, chunk_bytes),
                                        timeout=timeout, metadata=self._admin_metadata)

    def pause_generation(self, mode: str = "abort", timeout: float | None = None) -> ControlResponse:
        """mode "abort" (SGLang's default), "in_place", "retract" or "wait" (vLLM's: once the running requests end)."""
        return self._calls.pause_generation(PauseGenerationRequest(mode=PAUSE_MODES[mode]),
                                            timeout=timeout, metadata=self._admin_metadata)

    def continue_generation(self, timeout: float | None = None) -> ControlResponse:
        return self._calls.continue_generation(ContinueGenerationRequest(), timeout=timeout,
                                               metadata=self._admin_metadata)

    def abort_all(self, timeout: float | None = None) -> ControlResponse:
        return self._calls.abort_all(AbortAllRequest(), timeout=timeout, metadata=self._admin_metadata)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True,
                              timeout: float | None = None) -> ControlResponse:
        return self._calls.update_weight_version(
            UpdateWeightVersionRequest(new_version=new_version, abort_all_requests=abort_all_requests),
            timeout=timeout, metadata=self._admin_metadata)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str | None = None,
                                  timeout: float | None = None) -> ControlResponse:
        """Every replica joins the trainer's torch.distributed group (replica i as rank rank_offset + i); returns
        once the trainer (rank 0) and every replica have joined."""
        return self._calls.init_weights_update_group(
            _join_group(master_address, master_port, rank_offset, world_size, group_name, backend), timeout=timeout,
            metadata=self._admin_metadata)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = DEFAULT_GROUP, load_format: str | None = None,
                                        abort_all_requests: bool = False, weight_version: str | None = None,
                                        timeout: float | None = None) -> ControlResponse:
        """Receive the tensors the trainer broadcasts next over the group (in `names` order) and swap them in."""
        return self._calls.update_weights_from_distributed(
            _from_distributed(names, dtypes, shapes, group_name, load_format, abort_all_requests, weight_version),
            timeout=timeout, metadata=self._admin_metadata)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP,
                                     timeout: float | None = None) -> ControlResponse:
        return self._calls.destroy_weights_update_group(DestroyWeightsUpdateGroupRequest(group_name=group_name),
                                                        timeout=timeout, metadata=self._admin_metadata)

    def release_memory_occupation(self, tags: list[str] | None = None,
                                  timeout: float | None = None) -> ControlResponse:
        """Free the memory of `tags` ("weights", "kv_cache"; None: both) on every replica."""
        return self._calls.release_memory_occupation(ReleaseMemoryOccupationRequest(tags=list(tags or [])),
                                                     timeout=timeout, metadata=self._admin_metadata)

    def resume_memory_occupation(self, tags: list[str] | None = None,
                                 timeout: float | None = None) -> ControlResponse:
        return self._calls.resume_memory_occupation(ResumeMemoryOccupationRequest(tags=list(tags or [])),
                                                    timeout=timeout, metadata=self._admin_metadata)

    def flush_cache(self, timeout: float | None = None) -> ControlResponse:
        """Empty the prefix cache (refused while requests run, as SGLang's /flush_cache)."""
        return self._calls.flush_cache(EMPTY, timeout=timeout, metadata=self._admin_metadata)


class AsyncGenerationStream(ChunkStream):
    """GenerationStream's asyncio twin: `async for chunk in stream`, then `stream.result`. Leaving the loop
    early cancels the call once asyncio closes the loop's generator (at once with `cancel()`)."""

    def __init__(self, responses):
        super().__init__()
        self._responses = responses

    async def __aiter__(self) -> AsyncIterator[Generation]:
        try:
            async for response in self._responses:
                yield self._take(response)
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the request (nothing once the stream has ended)."""
        self._responses.cancel()


class AsyncFlatwireClient:
    """asyncio client (grpc.aio); the same options as FlatwireClient."""

    def __init__(self, address: str, max_message_mb: int = 1024, api_key: str | None = None,
                 admin_api_key: str | None = None, tls: bool | bytes = False):
        self._metadata = _metadata(api_key)
        self._admin_metadata = _metadata(admin_api_key or api_key)
        options = _channel_options(max_message_mb)
        credentials = _tls_credentials(tls)
        self._channel = (grpc.aio.secure_channel(address, credentials, options=options) if credentials
                         else grpc.aio.insecure_channel(address, options=options))
        self._calls = _methods(self._channel)

    async def __aenter__(self) -> "AsyncFlatwireClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def model_info(self) -> ModelInfo:
        return await self._calls.model_info(EMPTY, metadata=self._metadata)

    async def generate(self, text: str | None = None, input_ids: list[int] | None = None,
                       timeout: float | None = None, **options) -> Generation:
        request = Options(**options).grpc_request(text, input_ids, stream=False)
        responses = [response async for response in self._calls.generate(request, timeout=timeout,
                                                                               metadata=self._metadata)]
        return generation(responses[-1])  # without stream: one response

    def stream(self, text: str | None = None, input_ids: list[int] | None = None, timeout: float | None = None,
               **options) -> AsyncGenerationStream:
        request = Options(**options).grpc_request(text, input_ids, stream=True)
        return AsyncGenerationStream(self._calls.generate(request, timeout=timeout, metadata=self._metadata))

    async def abort(self, rid: str, timeout: float | None = None) -> ControlResponse:
        return await self._calls.abort(AbortGenerationRequest(rid=rid), timeout=timeout,
                                       metadata=self._metadata)

    # -- rollout control (admin): FlatwireClient's, awaited --

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       abort_all_requests: bool = False, weight_version: str | None = None,
                                       timeout: float | None = None) -> ControlResponse:
        return await self._calls.update_weights_from_disk(
            _from_disk(model_path, load_format, abort_all_requests, weight_version), timeout=timeout,
            metadata=self._admin_metadata)

    async def push_weights(self, weights: Mapping[str, Any] | str | os.PathLike, abort_all_requests: bool = False,
                           weight_version: str | None = None, chunk_bytes: int = PUSH_CHUNK_BYTES,
                           timeout: float | None = None) -> ControlResponse:
        return await self._calls.push_weights(
            _weight_chunks(weights, abort_all_requests, weight_version, chunk_bytes), timeout=timeout,
            metadata=self._admin_metadata)

    async def pause_generation(self, mode: str = "abort", timeout: float | None = None) -> ControlResponse:
        return await self._calls.pause_generation(PauseGenerationRequest(mode=PAUSE_MODES[mode]),
                                                  timeout=timeout, metadata=self._admin_metadata)

    async def continue_generation(self, timeout: float | None = None) -> ControlResponse:
        return await self._calls.continue_generation(ContinueGenerationRequest(), timeout=timeout,
                                                     metadata=self._admin_metadata)

    async def abort_all(self, timeout: float | None = None) -> ControlResponse:
        return await self._calls.abort_all(AbortAllRequest(), timeout=timeout,
                                           metadata=self._admin_metadata)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True,
                                    timeout: float | None = None) -> ControlResponse:
        return await self._calls.update_weight_version(
            UpdateWeightVersionRequest(new_version=new_version, abort_all_requests=abort_all_requests),
            timeout=timeout, metadata=self._admin_metadata)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str | None = None,
                                  timeout: float | None = None) -> ControlResponse:
        """Every replica joins the trainer's torch.distributed group (replica i as rank rank_offset + i); returns
        once the trainer (rank 0) and every replica have joined."""
        return await self._calls.init_weights_update_group(
            _join_group(master_address, master_port, rank_offset, world_size, group_name, backend), timeout=timeout,
            metadata=self._admin_metadata)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = DEFAULT_GROUP, load_format: str | None = None,
                                        abort_all_requests: bool = False, weight_version: str | None = None,
                                        timeout: float | None = None) -> ControlResponse:
        """Receive the tensors the trainer broadcasts next over the group (in `names` order) and swap them in."""
        return await self._calls.update_weights_from_distributed(
            _from_distributed(names, dtypes, shapes, group_name, load_format, abort_all_requests, weight_version),
            timeout=timeout, metadata=self._admin_metadata)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP,
                                     timeout: float | None = None) -> ControlResponse:
        return await self._calls.destroy_weights_update_group(DestroyWeightsUpdateGroupRequest(group_name=group_name),
                                                        timeout=timeout, metadata=self._admin_metadata)

    async def release_memory_occupation(self, tags: list[str] | None = None,
                                  timeout: float | None = None) -> ControlResponse:
        """Free the memory of `tags` ("weights", "kv_cache"; None: both) on every replica."""
        return await self._calls.release_memory_occupation(ReleaseMemoryOccupationRequest(tags=list(tags or [])),
                                                     timeout=timeout, metadata=self._admin_metadata)

    async def resume_memory_occupation(self, tags: list[str] | None = None,
                                 timeout: float | None = None) -> ControlResponse:
        return await self._calls.resume_memory_occupation(ResumeMemoryOccupationRequest(tags=list(tags or [])),
                                                    timeout=timeout, metadata=self._admin_metadata)

    async def flush_cache(self, timeout: float | None = None) -> ControlResponse:
        return await self._calls.flush_cache(EMPTY, timeout=timeout, metadata=self._admin_metadata)
