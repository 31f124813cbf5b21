from . import arrays_pb2 as _arrays_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_IN_PLACE: _ClassVar[PauseMode]
    PAUSE_MODE_RETRACT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]

class WeightsRelease(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHTS_RELEASE_UNSPECIFIED: _ClassVar[WeightsRelease]
    WEIGHTS_RELEASE_OFFLOAD: _ClassVar[WeightsRelease]
    WEIGHTS_RELEASE_DISCARD: _ClassVar[WeightsRelease]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_IN_PLACE: PauseMode
PAUSE_MODE_RETRACT: PauseMode
PAUSE_MODE_WAIT: PauseMode
WEIGHTS_RELEASE_UNSPECIFIED: WeightsRelease
WEIGHTS_RELEASE_OFFLOAD: WeightsRelease
WEIGHTS_RELEASE_DISCARD: WeightsRelease

class AbortGenerationRequest(_message.Message):
    __slots__ = ("rid",)
    RID_FIELD_NUMBER: _ClassVar[int]
    rid: str
    def __init__(self, rid: _Optional[str] = ...) -> None: ...

class ControlResponse(_message.Message):
    __slots__ = ("success", "message", "replicas")
    class ReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ReplicaReply
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ReplicaReply, _Mapping]] = ...) -> None: ...
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    replicas: _containers.MessageMap[str, ReplicaReply]
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., replicas: _Optional[_Mapping[str, ReplicaReply]] = ...) -> None: ...

class ReplicaReply(_message.Message):
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

class WeightVersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: str
    start: int
    end: int
    def __init__(self, version: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "input_ids", "sampling", "return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob", "stop", "skip_special_tokens", "no_stop_trim", "stream", "logprobs_mode", "return_routed_experts", "routed_experts_start_len", "return_top_p_token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_NUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_START_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_START_LEN_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOP_P_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    no_stop_trim: bool
    stream: bool
    logprobs_mode: _arrays_pb2.LogprobsMode
    return_routed_experts: bool
    routed_experts_start_len: int
    return_top_p_token_ids: bool
    def __init__(self, text: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., logprob_start_len: _Optional[int] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., no_stop_trim: _Optional[bool] = ..., stream: _Optional[bool] = ..., logprobs_mode: _Optional[_Union[_arrays_pb2.LogprobsMode, str]] = ..., return_routed_experts: _Optional[bool] = ..., routed_experts_start_len: _Optional[int] = ..., return_top_p_token_ids: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("rid", "token_ids", "text", "output", "prompt", "finish_reason", "matched_token", "matched_stop", "prompt_tokens", "completion_tokens", "weight_version", "weight_versions", "cached_tokens", "routed_experts", "routed_experts_shape", "prompt_token_ids", "top_p_token_ids", "top_p_token_offsets")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_TOKEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    output: _arrays_pb2.LogprobBlockView
    prompt: _arrays_pb2.LogprobBlockView
    finish_reason: _arrays_pb2.FinishReason
    matched_token: int
    matched_stop: str
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    weight_versions: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    cached_tokens: int
    routed_experts: _containers.RepeatedScalarFieldContainer[int]
    routed_experts_shape: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_p_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_p_token_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rid: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., output: _Optional[_Union[_arrays_pb2.LogprobBlockView, _Mapping]] = ..., prompt: _Optional[_Union[_arrays_pb2.LogprobBlockView, _Mapping]] = ..., finish_reason: _Optional[_Union[_arrays_pb2.FinishReason, str]] = ..., matched_token: _Optional[int] = ..., matched_stop: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., weight_version: _Optional[str] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., routed_experts: _Optional[_Iterable[int]] = ..., routed_experts_shape: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., top_p_token_ids: _Optional[_Iterable[int]] = ..., top_p_token_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponsePacked(_message.Message):
    __slots__ = ("rid", "token_ids", "text", "output", "prompt", "finish_reason", "matched_token", "matched_stop", "prompt_tokens", "completion_tokens", "weight_version", "weight_versions", "cached_tokens", "routed_experts", "routed_experts_shape", "prompt_token_ids", "top_p_token_ids", "top_p_token_offsets")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_TOKEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    token_ids: bytes
    text: str
    output: _arrays_pb2.LogprobBlock
    prompt: _arrays_pb2.LogprobBlock
    finish_reason: _arrays_pb2.FinishReason
    matched_token: int
    matched_stop: str
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    weight_versions: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    cached_tokens: int
    routed_experts: bytes
    routed_experts_shape: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: bytes
    top_p_token_ids: bytes
    top_p_token_offsets: bytes
    def __init__(self, rid: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., text: _Optional[str] = ..., output: _Optional[_Union[_arrays_pb2.LogprobBlock, _Mapping]] = ..., prompt: _Optional[_Union[_arrays_pb2.LogprobBlock, _Mapping]] = ..., finish_reason: _Optional[_Union[_arrays_pb2.FinishReason, str]] = ..., matched_token: _Optional[int] = ..., matched_stop: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., weight_version: _Optional[str] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., routed_experts: _Optional[bytes] = ..., routed_experts_shape: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[bytes] = ..., top_p_token_ids: _Optional[bytes] = ..., top_p_token_offsets: _Optional[bytes] = ...) -> None: ...

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

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context", "eos_token_ids", "max_top_logprobs", "device", "dtype", "weight_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_top_logprobs: int
    device: str
    dtype: str
    weight_version: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_top_logprobs: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

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
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightVersionRequest(_message.Message):
    __slots__ = ("new_version", "abort_all_requests")
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    new_version: str
    abort_all_requests: bool
    def __init__(self, new_version: _Optional[str] = ..., abort_all_requests: _Optional[bool] = ...) -> None: ...
