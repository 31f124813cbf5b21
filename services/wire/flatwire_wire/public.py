"""flatwire's public gRPC API (flatwire/v1/generate.proto), served by the gateway and called by the client package:
its twins and its ServiceSpec. None of these messages is shared with the internal hops but the control ones
(control.py), so nothing internal reaches a client."""

from dataclasses import dataclass, field

import numpy as np

from flatwire_wire.codec import twin
from flatwire_wire.control import (
    RL_CONTROL,
    AbortAllRequest,
    ContinueGenerationRequest,
    ControlReply,
    Empty,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
    WeightsChunk,
)
from flatwire_wire.logprobs import I32, LogprobBlock, LogprobsMode, RequestLogprobs, decode_block, write_block
from flatwire_wire.nucleus import Nuclei
from flatwire_wire.pb import arrays_pb2, generate_pb2
from flatwire_wire.rpc import ServiceSpec, messages_of
from flatwire_wire.steps import FinishReason


@twin(generate_pb2.SamplingParams)
@dataclass
class SamplingParams:
    """The public sampling options; generate.proto documents each (and the defaults of unset ones)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: str | None = None  # json_schema, regex, ebnf: the oneof `constraint`, at most one
    regex: str | None = None
    ebnf: str | None = None


@twin(generate_pb2.GenerateRequest)
@dataclass
class GenerateRequest:
    text: str = ""  # exactly one of text and input_ids
    input_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int | None = None  # None: -1 (no prompt logprobs)
    token_ids_logprob: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool | None = None  # None: true
    no_stop_trim: bool = False
    stream: bool = False
    logprobs_mode: LogprobsMode = LogprobsMode.UNSPECIFIED  # of the output logprobs; UNSPECIFIED: the server's
    return_routed_experts: bool = False  # MoE: the experts each token was routed to, on the last chunk
    routed_experts_start_len: int = 0  # the first position whose routing is returned
    return_top_p_token_ids: bool = False  # top-p replay: each token's nucleus (GenerateResponse.top_p)


@twin(generate_pb2.WeightVersionSpan)
@dataclass
class WeightVersionSpan:
    """Output positions [start, end) were produced by the weights labelled `version`."""

    version: str
    start: int
    end: int


@twin(generate_pb2.GenerateResponsePacked)
@dataclass
class GenerateResponse:
    """One response (a stream's chunk, or the whole result) in its bytes form (GenerateResponsePacked, which is
    wire-identical to the typed GenerateResponse other languages read)."""

    rid: str = ""
    token_ids: bytes = b""  # <i4: this chunk's tokens
    text: str = ""
    output: LogprobBlock | None = None  # one request: a row per token of this chunk
    prompt: LogprobBlock | None = None  # one request: the prompt's rows, in the first chunk
    finish_reason: FinishReason = FinishReason.UNSPECIFIED  # set on the last chunk
    matched_token: int = 0
    matched_stop: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    weight_version: str = ""
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    cached_tokens: int = 0  # of prompt_tokens, those the prefix cache held; set on the last chunk
    routed_experts: bytes = b""  # <i4 [tokens, layers, top_k], with return_routed_experts, on the last chunk
    routed_experts_shape: list[int] = field(default_factory=list)
    prompt_token_ids: bytes = b""  # <i4: the tokens `prompt` is for (its null prefix's, then a row's each)
    top_p_token_ids: bytes = b""  # <i4, with return_top_p_token_ids: this chunk's tokens' nuclei, flat (nucleus.py)
    top_p_token_offsets: bytes = b""  # <i4: the chunk's tokens + 1 offsets into top_p_token_ids, from 0

    @classmethod
    def from_bytes(cls, data: bytes) -> "GenerateResponse":
        """A response from its bytes (the gRPC API's, or /generate's as application/x-protobuf). Written out field
        by field, as to_bytes: per streamed chunk the codec's generic path costs more than the rest of a response
        (the twin check keeps the fields in step with generate.proto)."""
        m = generate_pb2.GenerateResponsePacked.FromString(data)
        return cls(rid=m.rid, token_ids=m.token_ids, text=m.text,
                   output=decode_block(m.output) if m.HasField("output") else None,
                   prompt=decode_block(m.prompt) if m.HasField("prompt") else None,
                   finish_reason=FinishReason(m.finish_reason), matched_token=m.matched_token,
                   matched_stop=m.matched_stop, prompt_tokens=m.prompt_tokens, completion_tokens=m.completion_tokens,
                   weight_version=m.weight_version,
                   weight_versions=[WeightVersionSpan(s.version, s.start, s.end) for s in m.weight_versions],
                   cached_tokens=m.cached_tokens, routed_experts=m.routed_experts,
                   routed_experts_shape=list(m.routed_experts_shape), prompt_token_ids=m.prompt_token_ids,
                   top_p_token_ids=m.top_p_token_ids, top_p_token_offsets=m.top_p_token_offsets)

    def to_bytes(self) -> bytes:
        message = generate_pb2.GenerateResponsePacked(
            rid=self.rid, token_ids=self.token_ids, text=self.text, finish_reason=self.finish_reason,
            matched_token=self.matched_token, matched_stop=self.matched_stop, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, weight_version=self.weight_version,
            cached_tokens=self.cached_tokens, routed_experts=self.routed_experts,
            routed_experts_shape=self.routed_experts_shape, prompt_token_ids=self.prompt_token_ids,
            top_p_token_ids=self.top_p_token_ids, top_p_token_offsets=self.top_p_token_offsets,
            weight_versions=[generate_pb2.WeightVersionSpan(version=s.version, start=s.start, end=s.end)
                             for s in self.weight_versions])
        if self.output is not None:
            write_block(message.output, self.output)
        if self.prompt is not None:
            write_block(message.prompt, self.prompt)
        return message.SerializeToString()

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.token_ids, I32)

    def top_p(self) -> Nuclei | None:
        """The nucleus of each token of this chunk; None when the request did not ask for them."""
        if not self.top_p_token_offsets:
            return None
        return Nuclei(np.frombuffer(self.top_p_token_offsets, I32), np.frombuffer(self.top_p_token_ids, I32))

    def output_logprobs(self) -> RequestLogprobs | None:
        return self.output.request_logprobs(0, self.tokens) if self.output is not None and len(self.output) else None

    def prompt_logprobs(self) -> RequestLogprobs | None:
        """The prompt's rows, with the tokens they are for."""
        if self.prompt is None or not len(self.prompt):
            return None
        null_prefix = self.prompt.null_prefix[0] if self.prompt.null_prefix else 0
        tokens = np.frombuffer(self.prompt_token_ids, I32)
        logprobs = self.prompt.request_logprobs(0, tokens[null_prefix:])
        logprobs.null_token_ids = tokens[:null_prefix]
        return logprobs


@twin(generate_pb2.ModelInfo)
@dataclass
class ModelInfo:
    model: str = ""
    vocab_size: int = 0
    max_context: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    max_top_logprobs: int = 0
    device: str = ""
    dtype: str = ""
    weight_version: str = ""


@twin(generate_pb2.AbortGenerationRequest)
@dataclass
class AbortGenerationRequest:
    rid: str


@twin(generate_pb2.ControlResponse)
@dataclass
class ControlResponse:
    """A call made on every scheduler replica: success when each one succeeded, each one's reply by address."""

    success: bool
    message: str = ""
    replicas: dict[str, ControlReply] = field(default_factory=dict)


def decode_response(data: bytes) -> GenerateResponse:
    """A GenerateResponse from its bytes (the gRPC API's, or /generate's as application/x-protobuf), field by field
    as encode_response writes them."""
    m = generate_pb2.GenerateResponsePacked.FromString(data)
    return GenerateResponse(
        rid=m.rid, token_ids=m.token_ids, text=m.text, output=decode_block(m.output) if m.HasField("output") else None,
        prompt=decode_block(m.prompt) if m.HasField("prompt") else None, finish_reason=FinishReason(m.finish_reason),
        matched_token=m.matched_token, matched_stop=m.matched_stop, prompt_tokens=m.prompt_tokens,
        completion_tokens=m.completion_tokens, weight_version=m.weight_version,
        weight_versions=[WeightVersionSpan(s.version, s.start, s.end) for s in m.weight_versions])


GENERATION = ServiceSpec(
    generate_pb2.DESCRIPTOR.services_by_name["Generation"], messages_of(generate_pb2, arrays_pb2),
    twins={"Generate": (GenerateRequest, GenerateResponse), "GetModelInfo": (Empty, ModelInfo),
           "Abort": (AbortGenerationRequest, ControlResponse),
           "UpdateWeightsFromDisk": (UpdateWeightsFromDiskRequest, ControlResponse),
           "PushWeights": (WeightsChunk, ControlResponse), "PauseGeneration": (PauseGenerationRequest, ControlResponse),
           "ContinueGeneration": (ContinueGenerationRequest, ControlResponse),
           "AbortAll": (AbortAllRequest, ControlResponse),
           "UpdateWeightVersion": (UpdateWeightVersionRequest, ControlResponse),
           "FlushCache": (Empty, ControlResponse),
           **{rpc: (request, ControlResponse) for rpc, request in RL_CONTROL.items()}},
    response_protos={"Generate": generate_pb2.GenerateResponsePacked})
