from . import arrays_pb2 as _arrays_pb2
from . import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
        value: _scheduler_pb2.ControlReply
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_scheduler_pb2.ControlReply, _Mapping]] = ...) -> None: ...
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    replicas: _containers.MessageMap[str, _scheduler_pb2.ControlReply]
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., replicas: _Optional[_Mapping[str, _scheduler_pb2.ControlReply]] = ...) -> None: ...

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
    __slots__ = ("text", "input_ids", "sampling", "return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob", "stop", "skip_special_tokens", "no_stop_trim", "stream")
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
    text: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _scheduler_pb2.SamplingParams
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    token_ids_logprob: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    no_stop_trim: bool
    stream: bool
    def __init__(self, text: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_scheduler_pb2.SamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., top_logprobs_num: _Optional[int] = ..., logprob_start_len: _Optional[int] = ..., token_ids_logprob: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., no_stop_trim: _Optional[bool] = ..., stream: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("rid", "token_ids", "text", "output", "prompt", "finish_reason", "matched_token", "matched_stop", "prompt_tokens", "completion_tokens", "weight_version", "weight_versions")
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
    def __init__(self, rid: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., output: _Optional[_Union[_arrays_pb2.LogprobBlockView, _Mapping]] = ..., prompt: _Optional[_Union[_arrays_pb2.LogprobBlockView, _Mapping]] = ..., finish_reason: _Optional[_Union[_arrays_pb2.FinishReason, str]] = ..., matched_token: _Optional[int] = ..., matched_stop: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., weight_version: _Optional[str] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ...) -> None: ...

class GenerateResponsePacked(_message.Message):
    __slots__ = ("rid", "token_ids", "text", "output", "prompt", "finish_reason", "matched_token", "matched_stop", "prompt_tokens", "completion_tokens", "weight_version", "weight_versions")
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
    def __init__(self, rid: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., text: _Optional[str] = ..., output: _Optional[_Union[_arrays_pb2.LogprobBlock, _Mapping]] = ..., prompt: _Optional[_Union[_arrays_pb2.LogprobBlock, _Mapping]] = ..., finish_reason: _Optional[_Union[_arrays_pb2.FinishReason, str]] = ..., matched_token: _Optional[int] = ..., matched_stop: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., weight_version: _Optional[str] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ...) -> None: ...
