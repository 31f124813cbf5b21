from . import arrays_pb2 as _arrays_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightsRelease(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHTS_RELEASE_UNSPECIFIED: _ClassVar[WeightsRelease]
    WEIGHTS_RELEASE_OFFLOAD: _ClassVar[WeightsRelease]
    WEIGHTS_RELEASE_DISCARD: _ClassVar[WeightsRelease]

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_IN_PLACE: _ClassVar[PauseMode]
    PAUSE_MODE_RETRACT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
WEIGHTS_RELEASE_UNSPECIFIED: WeightsRelease
WEIGHTS_RELEASE_OFFLOAD: WeightsRelease
WEIGHTS_RELEASE_DISCARD: WeightsRelease
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_IN_PLACE: PauseMode
PAUSE_MODE_RETRACT: PauseMode
PAUSE_MODE_WAIT: PauseMode

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "logit_bias", "json_schema", "regex", "ebnf")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    min_new_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    regex: str
    ebnf: str
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_new_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class LogprobParams(_message.Message):
    __slots__ = ("return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob", "logprobs_mode")
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    logprobs_mode: _arrays_pb2.LogprobsMode
    def __init__(self, return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., logprob_start_len: _Optional[int] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ..., logprobs_mode: _Optional[_Union[_arrays_pb2.LogprobsMode, str]] = ...) -> None: ...

class DetokenizeParams(_message.Message):
    __slots__ = ("skip_special_tokens", "spaces_between_special_tokens", "stop", "no_stop_trim", "min_new_tokens", "include_stop_str")
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_FIELD_NUMBER: _ClassVar[int]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    no_stop_trim: bool
    min_new_tokens: int
    include_stop_str: bool
    def __init__(self, skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., no_stop_trim: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., include_stop_str: _Optional[bool] = ...) -> None: ...

class TokenizedRequest(_message.Message):
    __slots__ = ("rid", "owner", "input_ids", "sampling", "logprob", "detokenize", "stream_interval", "return_routed_experts", "routed_experts_start_len", "return_top_p_token_ids", "lora_name", "cache_namespace")
    RID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_START_LEN_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOP_P_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    rid: str
    owner: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    logprob: LogprobParams
    detokenize: DetokenizeParams
    stream_interval: int
    return_routed_experts: bool
    routed_experts_start_len: int
    return_top_p_token_ids: bool
    lora_name: str
    cache_namespace: str
    def __init__(self, rid: _Optional[str] = ..., owner: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., logprob: _Optional[_Union[LogprobParams, _Mapping]] = ..., detokenize: _Optional[_Union[DetokenizeParams, _Mapping]] = ..., stream_interval: _Optional[int] = ..., return_routed_experts: _Optional[bool] = ..., routed_experts_start_len: _Optional[int] = ..., return_top_p_token_ids: _Optional[bool] = ..., lora_name: _Optional[str] = ..., cache_namespace: _Optional[str] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[TokenizedRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[TokenizedRequest, _Mapping]]] = ...) -> None: ...

class SubmitResult(_message.Message):
    __slots__ = ("code", "details", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    field: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class SubmitBatchReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SubmitResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SubmitResult, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid", "reason", "matched_stop", "message")
    RID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    rid: str
    reason: _arrays_pb2.FinishReason
    matched_stop: str
    message: str
    def __init__(self, rid: _Optional[str] = ..., reason: _Optional[_Union[_arrays_pb2.FinishReason, str]] = ..., matched_stop: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamStepsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestResume(_message.Message):
    __slots__ = ("start", "output_ids")
    START_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    start: RequestStart
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Union[RequestStart, _Mapping]] = ..., output_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestStart(_message.Message):
    __slots__ = ("rid", "owner", "detokenize", "prompt_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    owner: str
    detokenize: DetokenizeParams
    prompt_tokens: int
    def __init__(self, rid: _Optional[str] = ..., owner: _Optional[str] = ..., detokenize: _Optional[_Union[DetokenizeParams, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("rid", "reason", "matched_token", "matched_stop", "message", "output_tokens", "cached_tokens", "routed_experts", "routed_experts_shape", "step_failed")
    RID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    STEP_FAILED_FIELD_NUMBER: _ClassVar[int]
    rid: str
    reason: _arrays_pb2.FinishReason
    matched_token: int
    matched_stop: str
    message: str
    output_tokens: int
    cached_tokens: int
    routed_experts: bytes
    routed_experts_shape: _containers.RepeatedScalarFieldContainer[int]
    step_failed: bool
    def __init__(self, rid: _Optional[str] = ..., reason: _Optional[_Union[_arrays_pb2.FinishReason, str]] = ..., matched_token: _Optional[int] = ..., matched_stop: _Optional[str] = ..., message: _Optional[str] = ..., output_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., routed_experts: _Optional[bytes] = ..., routed_experts_shape: _Optional[_Iterable[int]] = ..., step_failed: _Optional[bool] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("step", "started", "rids", "token_ids", "output", "prompt_rids", "prompt", "finished", "texts", "positions", "resumed", "counts", "weight_version", "made_at_unix_us", "top_p")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RIDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MADE_AT_UNIX_US_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    step: int
    started: _containers.RepeatedCompositeFieldContainer[RequestStart]
    rids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    output: _arrays_pb2.LogprobBlock
    prompt_rids: _containers.RepeatedScalarFieldContainer[str]
    prompt: _arrays_pb2.LogprobBlock
    finished: _containers.RepeatedCompositeFieldContainer[Finish]
    texts: _containers.RepeatedScalarFieldContainer[str]
    positions: _containers.RepeatedScalarFieldContainer[int]
    resumed: _containers.RepeatedCompositeFieldContainer[RequestResume]
    counts: _containers.RepeatedScalarFieldContainer[int]
    weight_version: str
    made_at_unix_us: int
    top_p: _arrays_pb2.NucleusBlock
    def __init__(self, step: _Optional[int] = ..., started: _Optional[_Iterable[_Union[RequestStart, _Mapping]]] = ..., rids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., output: _Optional[_Union[_arrays_pb2.LogprobBlock, _Mapping]] = ..., prompt_rids: _Optional[_Iterable[str]] = ..., prompt: _Optional[_Union[_arrays_pb2.LogprobBlock, _Mapping]] = ..., finished: _Optional[_Iterable[_Union[Finish, _Mapping]]] = ..., texts: _Optional[_Iterable[str]] = ..., positions: _Optional[_Iterable[int]] = ..., resumed: _Optional[_Iterable[_Union[RequestResume, _Mapping]]] = ..., counts: _Optional[_Iterable[int]] = ..., weight_version: _Optional[str] = ..., made_at_unix_us: _Optional[int] = ..., top_p: _Optional[_Union[_arrays_pb2.NucleusBlock, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context", "eos_token_ids", "max_top_logprobs", "device", "dtype", "max_running_requests", "instance_id", "weight_version", "max_total_tokens", "page_size", "prefix_cache", "logprobs_mode", "kv_layers", "state_bytes_per_request", "state_checkpoints", "return_routed_experts", "releases_memory", "load_format", "max_loras_per_batch", "lora_adapters", "tp_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_MEMORY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_top_logprobs: int
    device: str
    dtype: str
    max_running_requests: int
    instance_id: str
    weight_version: str
    max_total_tokens: int
    page_size: int
    prefix_cache: bool
    logprobs_mode: _arrays_pb2.LogprobsMode
    kv_layers: str
    state_bytes_per_request: int
    state_checkpoints: int
    return_routed_experts: bool
    releases_memory: bool
    load_format: str
    max_loras_per_batch: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    tp_size: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_top_logprobs: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_running_requests: _Optional[int] = ..., instance_id: _Optional[str] = ..., weight_version: _Optional[str] = ..., max_total_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., logprobs_mode: _Optional[_Union[_arrays_pb2.LogprobsMode, str]] = ..., kv_layers: _Optional[str] = ..., state_bytes_per_request: _Optional[int] = ..., state_checkpoints: _Optional[int] = ..., return_routed_experts: _Optional[bool] = ..., releases_memory: _Optional[bool] = ..., load_format: _Optional[str] = ..., max_loras_per_batch: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., tp_size: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("running", "waiting", "kv_tokens_used", "steps", "finished", "aborted", "kv_pages_total", "kv_pages_used", "kv_pages_cached", "page_size", "prefill_tokens", "cached_prompt_tokens", "retractions", "paused", "memory_released", "waiting_tokens")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRACTIONS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RELEASED_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_tokens_used: int
    steps: int
    finished: int
    aborted: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_cached: int
    page_size: int
    prefill_tokens: int
    cached_prompt_tokens: int
    retractions: int
    paused: bool
    memory_released: _containers.RepeatedScalarFieldContainer[str]
    waiting_tokens: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., steps: _Optional[int] = ..., finished: _Optional[int] = ..., aborted: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., page_size: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., retractions: _Optional[int] = ..., paused: _Optional[bool] = ..., memory_released: _Optional[_Iterable[str]] = ..., waiting_tokens: _Optional[int] = ...) -> None: ...

class UpdateWeightsFromDiskRequest(_message.Message):
    __slots__ = ("model_path", "load_format", "abort_all_requests", "weight_version")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    load_format: str
    abort_all_requests: bool
    weight_version: str
    def __init__(self, model_path: _Optional[str] = ..., load_format: _Optional[str] = ..., abort_all_requests: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("safetensors", "abort_all_requests", "weight_version")
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    safetensors: bytes
    abort_all_requests: bool
    weight_version: str
    def __init__(self, safetensors: _Optional[bytes] = ..., abort_all_requests: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class InitWeightsUpdateGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsFromDistributedRequest(_message.Message):
    __slots__ = ("names", "dtypes", "shapes", "group_name", "load_format", "abort_all_requests", "weight_version")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    group_name: str
    load_format: str
    abort_all_requests: bool
    weight_version: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., dtypes: _Optional[_Iterable[str]] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., group_name: _Optional[str] = ..., load_format: _Optional[str] = ..., abort_all_requests: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class DestroyWeightsUpdateGroupRequest(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class ReleaseMemoryOccupationRequest(_message.Message):
    __slots__ = ("tags", "weights")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    weights: WeightsRelease
    def __init__(self, tags: _Optional[_Iterable[str]] = ..., weights: _Optional[_Union[WeightsRelease, str]] = ...) -> None: ...

class ResumeMemoryOccupationRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class ContinueGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortAllRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ("reset_running_requests",)
    RESET_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    reset_running_requests: bool
    def __init__(self, reset_running_requests: _Optional[bool] = ...) -> None: ...

class UpdateWeightVersionRequest(_message.Message):
    __slots__ = ("new_version", "abort_all_requests")
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    new_version: str
    abort_all_requests: bool
    def __init__(self, new_version: _Optional[str] = ..., abort_all_requests: _Optional[bool] = ...) -> None: ...

class UpdateWeightsFromTensorRequest(_message.Message):
    __slots__ = ("serialized_named_tensors", "load_format", "abort_all_requests", "weight_version")
    SERIALIZED_NAMED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    serialized_named_tensors: _containers.RepeatedScalarFieldContainer[bytes]
    load_format: str
    abort_all_requests: bool
    weight_version: str
    def __init__(self, serialized_named_tensors: _Optional[_Iterable[bytes]] = ..., load_format: _Optional[str] = ..., abort_all_requests: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class BeginWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckWeightsRequest(_message.Message):
    __slots__ = ("action", "skip_tensor_list")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SKIP_TENSOR_LIST_FIELD_NUMBER: _ClassVar[int]
    action: str
    skip_tensor_list: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, action: _Optional[str] = ..., skip_tensor_list: _Optional[_Iterable[str]] = ...) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("success", "message", "num_paused_requests", "weight_version", "aborted_requests")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAUSED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    num_paused_requests: int
    weight_version: str
    aborted_requests: int
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., num_paused_requests: _Optional[int] = ..., weight_version: _Optional[str] = ..., aborted_requests: _Optional[int] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "pinned", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    pinned: bool
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., pinned: _Optional[bool] = ..., rank: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "safetensors", "config_json", "pinned", "replace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    safetensors: bytes
    config_json: str
    pinned: bool
    replace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., safetensors: _Optional[bytes] = ..., config_json: _Optional[str] = ..., pinned: _Optional[bool] = ..., replace: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdapterReply(_message.Message):
    __slots__ = ("success", "message", "not_found", "loaded")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    not_found: bool
    loaded: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., not_found: _Optional[bool] = ..., loaded: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...
