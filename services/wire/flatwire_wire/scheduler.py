"""The scheduler's internal API (flatwire/internal/v1/scheduler.proto): what gateways submit, what the scheduler
reports, and the typed client of its service. scheduler.proto documents each field."""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from flatwire_wire.codec import twin
from flatwire_wire.control import (
    EMPTY,
    RL_CONTROL,
    AbortAllRequest,
    ContinueGenerationRequest,
    ControlReply,
    DestroyWeightsUpdateGroupRequest,
    Empty,
    FlushCacheRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    ReleaseMemoryOccupationRequest,
    ResumeMemoryOccupationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    WeightsChunk,
)
from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.lora import LoadLoraAdapterRequest, LoraAdapterInfo, LoraAdapterReply, UnloadLoraAdapterRequest
from flatwire_wire.pb import arrays_pb2, scheduler_pb2
from flatwire_wire.rpc import ServiceSpec, messages_of
from flatwire_wire.sampling import CONSTRAINTS
from flatwire_wire.steps import DetokenizeParams, FinishReason, StepMessage
from flatwire_wire.submit_batch import SubmitBatcher


@twin(scheduler_pb2.SamplingParams)
@dataclass
class SamplingParams:
    """A request's sampling options as the message carries them; the scheduler builds them into a checked
    SamplingOptions (sampling.py), where a field left None takes its default."""

    max_new_tokens: int | None = None
    temperature: float | None = None  # 0: greedy
    top_p: float | None = None
    top_k: int | None = None  # <= 0: no limit
    min_p: float | None = None
    seed: int | None = None  # None: not reproducible
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: at most one (the proto's oneof `constraint`).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, if any."""
        return next(((kind, text) for kind in CONSTRAINTS
                     if (text := getattr(self, kind)) is not None), None)


@twin(scheduler_pb2.LogprobParams)
@dataclass
class LogprobParams:
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = 0  # first prompt position with logprobs; -1: none (0, the proto's default: all)
    token_ids_logprob: list[int] = field(default_factory=list)
    logprobs_mode: LogprobsMode = LogprobsMode.UNSPECIFIED  # UNSPECIFIED: the scheduler's --logprobs-mode


@twin(scheduler_pb2.TokenizedRequest)
@dataclass
class TokenizedRequest:
    """A request for the scheduler: tokens, options, and `owner`, the gateway its outputs are routed to."""

    rid: str = ""
    owner: str = ""
    input_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprob: LogprobParams = field(default_factory=LogprobParams)
    detokenize: DetokenizeParams = field(default_factory=DetokenizeParams)
    stream_interval: int = 0  # output tokens per entry; 0: the scheduler's --output-interval
    return_routed_experts: bool = False  # MoE: the experts of each token, with the Finish
    routed_experts_start_len: int = 0  # from this sequence position on
    return_top_p_token_ids: bool = False  # top-p replay: each output token's nucleus, in StepOutput.top_p
    lora_name: str = ""  # the LoRA adapter it runs on; "": the base model
    cache_namespace: str = ""  # its prefix-cache namespace (cache_salt); "": the shared one


@twin(scheduler_pb2.SubmitBatchRequest)
@dataclass
class SubmitBatchRequest:
    requests: list[TokenizedRequest] = field(default_factory=list)


@twin(scheduler_pb2.SubmitResult)
@dataclass
class SubmitResult:
    """What Submit would have answered one request of a batch: code 0 (OK) or the status it would have failed
    with."""

    code: int = 0
    details: str = ""
    field: str = ""  # the request field at fault, if Submit would have named it (FIELD_METADATA)


@twin(scheduler_pb2.SubmitBatchReply)
@dataclass
class SubmitBatchReply:
    results: list[SubmitResult] = field(default_factory=list)


@twin(scheduler_pb2.AbortRequest)
@dataclass
class AbortRequest:
    rid: str
    reason: FinishReason = FinishReason.UNSPECIFIED  # UNSPECIFIED: ABORT; STOP_STRING, ERROR: the detokenizer's
    matched_stop: str = ""
    message: str = ""  # ERROR: why (a server-side fault, rendered as one)


@twin(scheduler_pb2.ModelInfo)
@dataclass
class ModelInfo:
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    max_top_logprobs: int
    device: str
    dtype: str
    max_running_requests: int
    instance_id: str  # new each time the scheduler process starts
    weight_version: str = ""
    max_total_tokens: int = 0  # the KV memory, in tokens
    page_size: int = 0
    prefix_cache: bool = False  # whether it keeps one (not --disable-radix-cache)
    logprobs_mode: LogprobsMode = LogprobsMode.RAW  # a request's that names none (--logprobs-mode)
    kv_layers: str = ""  # what the model's layers keep
    state_bytes_per_request: int = 0  # linear-attention state one request holds (0: no such layers)
    state_checkpoints: int = 0  # of that state, which the prefix cache may keep
    return_routed_experts: bool = False  # it records MoE routing (--enable-return-routed-experts)
    releases_memory: bool = False  # release_memory_occupation frees its model memory (not --engine synthetic)
    load_format: str = ""  # --load-format
    max_loras_per_batch: int = 0  # --enable-lora: adapters one step runs (0: LoRA off)
    lora_adapters: list[LoraAdapterInfo] = field(default_factory=list)  # loaded now
    tp_size: int = 1  # tensor-parallel ranks the model is cut over (--tp-size)


@twin(scheduler_pb2.SchedulerStats)
@dataclass
class SchedulerStats:
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_cached: int = 0
    page_size: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    retractions: int = 0
    paused: bool = False
    memory_released: list[str] = field(default_factory=list)
    waiting_tokens: int = 0  # the waiting requests' sequences (prompt and output so far), to prefill


# -- colocated trainers (internal calls only: the gateway's HTTP routes forward them) ------------------------------

@twin(scheduler_pb2.UpdateWeightsFromTensorRequest)
@dataclass
class UpdateWeightsFromTensorRequest:
    serialized_named_tensors: list[bytes] = field(default_factory=list)  # rank i reads entry i: torch's pickle
    load_format: str = ""  # "", "direct" or "flattened_bucket"
    abort_all_requests: bool = False
    weight_version: str | None = None  # set on success; None: the version stays


@twin(scheduler_pb2.BeginWeightUpdateRequest)
@dataclass
class BeginWeightUpdateRequest:
    pass


@twin(scheduler_pb2.EndWeightUpdateRequest)
@dataclass
class EndWeightUpdateRequest:
    pass


CHECK_WEIGHTS_ACTIONS = ("snapshot", "reset_tensors", "compare")  # SGLang's weights_checker actions


@twin(scheduler_pb2.CheckWeightsRequest)
@dataclass
class CheckWeightsRequest:
    action: str  # of CHECK_WEIGHTS_ACTIONS
    skip_tensor_list: list[str] = field(default_factory=list)  # compare: names left out


SCHEDULER = ServiceSpec(
    scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"], messages_of(scheduler_pb2, arrays_pb2),
    twins={"Submit": (TokenizedRequest, Empty), "SubmitBatch": (SubmitBatchRequest, SubmitBatchReply),
           "Abort": (AbortRequest, Empty), "StreamSteps": (Empty, StepMessage),
           "GetModelInfo": (Empty, ModelInfo), "GetStats": (Empty, SchedulerStats),
           "UpdateWeightsFromDisk": (UpdateWeightsFromDiskRequest, ControlReply),
           "PushWeights": (WeightsChunk, ControlReply), "PauseGeneration": (PauseGenerationRequest, ControlReply),
           "ContinueGeneration": (ContinueGenerationRequest, ControlReply),
           "AbortAll": (AbortAllRequest, ControlReply),
           "UpdateWeightVersion": (UpdateWeightVersionRequest, ControlReply),
           "FlushCache": (FlushCacheRequest, ControlReply),
           **{rpc: (request, ControlReply) for rpc, request in RL_CONTROL.items()},
           "UpdateWeightsFromTensor": (UpdateWeightsFromTensorRequest, ControlReply),
           "BeginWeightUpdate": (BeginWeightUpdateRequest, ControlReply),
           "EndWeightUpdate": (EndWeightUpdateRequest, ControlReply),
           "CheckWeights": (CheckWeightsRequest, ControlReply),
           "LoadLoraAdapter": (LoadLoraAdapterRequest, LoraAdapterReply),
           "UnloadLoraAdapter": (UnloadLoraAdapterRequest, LoraAdapterReply)})


class SchedulerServicer(Protocol):
    """What a scheduler implements (SCHEDULER.add_to(server, it)); `context` is gRPC's."""

    async def submit(self, request: TokenizedRequest, context: Any) -> Empty: ...
    async def submit_batch(self, request: SubmitBatchRequest, context: Any) -> SubmitBatchReply: ...
    async def abort(self, request: AbortRequest, context: Any) -> Empty: ...
    def stream_steps(self, request: Empty, context: Any) -> AsyncIterator[StepMessage]: ...
    async def get_model_info(self, request: Empty, context: Any) -> ModelInfo: ...
    async def get_stats(self, request: Empty, context: Any) -> SchedulerStats: ...
    async def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest, context: Any) -> ControlReply: ...
    async def push_weights(self, chunks: AsyncIterator[WeightsChunk], context: Any) -> ControlReply: ...
    async def pause_generation(self, request: PauseGenerationRequest, context: Any) -> ControlReply: ...
    async def continue_generation(self, request: ContinueGenerationRequest, context: Any) -> ControlReply: ...
    async def abort_all(self, request: AbortAllRequest, context: Any) -> ControlReply: ...
    async def update_weight_version(self, request: UpdateWeightVersionRequest, context: Any) -> ControlReply: ...
    async def flush_cache(self, request: FlushCacheRequest, context: Any) -> ControlReply: ...
    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest, context: Any) -> ControlReply: ...
    async def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest, context: Any
                                             ) -> ControlReply: ...
    async def destroy_weights_update_group(self, request: DestroyWeightsUpdateGroupRequest, context: Any
                                          ) -> ControlReply: ...
    async def release_memory_occupation(self, request: ReleaseMemoryOccupationRequest, context: Any
                                       ) -> ControlReply: ...
    async def resume_memory_occupation(self, request: ResumeMemoryOccupationRequest, context: Any) -> ControlReply: ...
    async def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest, context: Any
                                         ) -> ControlReply: ...
    async def begin_weight_update(self, request: BeginWeightUpdateRequest, context: Any) -> ControlReply: ...
    async def end_weight_update(self, request: EndWeightUpdateRequest, context: Any) -> ControlReply: ...
    async def check_weights(self, request: CheckWeightsRequest, context: Any) -> ControlReply: ...
    async def load_lora_adapter(self, request: LoadLoraAdapterRequest, context: Any) -> LoraAdapterReply: ...
    async def unload_lora_adapter(self, request: UnloadLoraAdapterRequest, context: Any) -> LoraAdapterReply: ...


class SchedulerClient:
    """A scheduler's service over an asyncio channel, in twins."""

    def __init__(self, channel: grpc.aio.Channel, submit_channel: grpc.Channel | None = None,
                 orphaned: Callable[[str], None] = lambda rid: None):
        """`submit_channel`: a blocking channel to the same scheduler, on which a burst's batches of submits start
        at once (see submit_batch.py); `orphaned(rid)`: a submit accepted after its caller was cancelled (the
        caller's to abort)."""
        self._calls = SCHEDULER.calls(channel)
        self._submit_channel_ready = False
        method = SCHEDULER.methods["SubmitBatch"]  # its calls take the message encoded (SubmitBatcher's)
        send = channel.unary_unary(method.path, response_deserializer=method.decode_response)
        start = (submit_channel.unary_unary(method.path, response_deserializer=method.decode_response).future
                 if submit_channel is not None else None)
        self._submits: SubmitBatcher[TokenizedRequest] = SubmitBatcher(
            lambda message, timeout: send(message, timeout=timeout),
            lambda request: method.encode_request(SubmitBatchRequest([request])),
            lambda request, timeout: self._calls["Submit"](request, timeout=timeout),
            lambda request: orphaned(request.rid),
            start_batch=start,  # (message, timeout): a blocking call's future takes its timeout second
            can_start=lambda: self._submit_channel_ready)
        # The blocking channel's state, kept by gRPC's thread, which connects it again whenever it has lost its
        # connection. Until it is connected, batches go as asyncio calls: a call on a channel that failed to
        # connect fails at once (the health checks keep the asyncio channel connected).
        if submit_channel is not None:
            submit_channel.subscribe(self._submit_channel_state, try_to_connect=True)

    def _submit_channel_state(self, state: grpc.ChannelConnectivity) -> None:
        self._submit_channel_ready = state is grpc.ChannelConnectivity.READY

    async def submit(self, request: TokenizedRequest, timeout: float | None = None) -> None:
        """Submit `request`, in a batch with those submitted about the same time (submit_batch.py); raises the
        grpc.aio.AioRpcError that a Submit of it alone would have raised."""
        await self._submits.submit(request, timeout)

    async def abort(self, request: AbortRequest, timeout: float | None = None) -> None:
        await self._calls["Abort"](request, timeout=timeout)

    def stream_steps(self) -> Any:
        """The step stream: a grpc.aio call whose iteration yields StepMessages."""
        return self._calls["StreamSteps"](EMPTY)

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return await self._calls["GetModelInfo"](EMPTY, timeout=timeout)

    async def stats(self, timeout: float | None = None) -> SchedulerStats:
        return await self._calls["GetStats"](EMPTY, timeout=timeout)

    async def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest) -> ControlReply:
        return await self._calls["UpdateWeightsFromDisk"](request)

    async def push_weights(self, chunks: AsyncIterator[WeightsChunk]) -> ControlReply:
        return await self._calls["PushWeights"](chunks)

    async def pause_generation(self, request: PauseGenerationRequest) -> ControlReply:
        return await self._calls["PauseGeneration"](request)

    async def continue_generation(self, request: ContinueGenerationRequest) -> ControlReply:
        return await self._calls["ContinueGeneration"](request)

    async def abort_all(self, request: AbortAllRequest) -> ControlReply:
        return await self._calls["AbortAll"](request)

    async def update_weight_version(self, request: UpdateWeightVersionRequest) -> ControlReply:
        return await self._calls["UpdateWeightVersion"](request)

    async def flush_cache(self, request: FlushCacheRequest) -> ControlReply:
        return await self._calls["FlushCache"](request)

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> ControlReply:
        return await self._calls["InitWeightsUpdateGroup"](request)

    async def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> ControlReply:
        return await self._calls["UpdateWeightsFromDistributed"](request)

    async def destroy_weights_update_group(self, request: DestroyWeightsUpdateGroupRequest) -> ControlReply:
        return await self._calls["DestroyWeightsUpdateGroup"](request)

    async def release_memory_occupation(self, request: ReleaseMemoryOccupationRequest) -> ControlReply:
        return await self._calls["ReleaseMemoryOccupation"](request)

    async def resume_memory_occupation(self, request: ResumeMemoryOccupationRequest) -> ControlReply:
        return await self._calls["ResumeMemoryOccupation"](request)

    async def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> ControlReply:
        return await self._calls["UpdateWeightsFromTensor"](request)

    async def begin_weight_update(self) -> ControlReply:
        return await self._calls["BeginWeightUpdate"](BeginWeightUpdateRequest())

    async def end_weight_update(self) -> ControlReply:
        return await self._calls["EndWeightUpdate"](EndWeightUpdateRequest())

    async def check_weights(self, request: CheckWeightsRequest) -> ControlReply:
        return await self._calls["CheckWeights"](request)

    async def load_lora_adapter(self, request: LoadLoraAdapterRequest) -> LoraAdapterReply:
        return await self._calls["LoadLoraAdapter"](request)

    async def unload_lora_adapter(self, request: UnloadLoraAdapterRequest) -> LoraAdapterReply:
        return await self._calls["UnloadLoraAdapter"](request)
