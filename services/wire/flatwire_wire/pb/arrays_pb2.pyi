from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LogprobsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROBS_MODE_UNSPECIFIED: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_RAW: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_PROCESSED: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_SGLANG: _ClassVar[LogprobsMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
LOGPROBS_MODE_UNSPECIFIED: LogprobsMode
LOGPROBS_MODE_RAW: LogprobsMode
LOGPROBS_MODE_PROCESSED: LogprobsMode
LOGPROBS_MODE_SGLANG: LogprobsMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class LogprobBlockView(_message.Message):
    __slots__ = ("rows", "null_prefix", "token_logprobs", "topk", "topk_values", "topk_ids", "id_counts", "ids_logprobs")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NULL_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_VALUES_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    ID_COUNTS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    null_prefix: _containers.RepeatedScalarFieldContainer[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    topk: _containers.RepeatedScalarFieldContainer[int]
    topk_values: _containers.RepeatedScalarFieldContainer[float]
    topk_ids: _containers.RepeatedScalarFieldContainer[int]
    id_counts: _containers.RepeatedScalarFieldContainer[int]
    ids_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[_Iterable[int]] = ..., null_prefix: _Optional[_Iterable[int]] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., topk: _Optional[_Iterable[int]] = ..., topk_values: _Optional[_Iterable[float]] = ..., topk_ids: _Optional[_Iterable[int]] = ..., id_counts: _Optional[_Iterable[int]] = ..., ids_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogprobBlock(_message.Message):
    __slots__ = ("rows", "null_prefix", "token_logprobs", "topk", "topk_values", "topk_ids", "id_counts", "ids_logprobs")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NULL_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_VALUES_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    ID_COUNTS_FIELD_NUMBER: _ClassVar[int]
    IDS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    null_prefix: _containers.RepeatedScalarFieldContainer[int]
    token_logprobs: bytes
    topk: _containers.RepeatedScalarFieldContainer[int]
    topk_values: bytes
    topk_ids: bytes
    id_counts: _containers.RepeatedScalarFieldContainer[int]
    ids_logprobs: bytes
    def __init__(self, rows: _Optional[_Iterable[int]] = ..., null_prefix: _Optional[_Iterable[int]] = ..., token_logprobs: _Optional[bytes] = ..., topk: _Optional[_Iterable[int]] = ..., topk_values: _Optional[bytes] = ..., topk_ids: _Optional[bytes] = ..., id_counts: _Optional[_Iterable[int]] = ..., ids_logprobs: _Optional[bytes] = ...) -> None: ...

class NucleusBlock(_message.Message):
    __slots__ = ("tokens", "sizes", "token_ids")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sizes: bytes
    token_ids: bytes
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., sizes: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...
