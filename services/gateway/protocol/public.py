"""The public gRPC API's GenerateRequest (protos/flatwire/v1/generate.proto), checked by /generate's rules: the
same sampling and detokenizing fields (protocol/sampling.py) and the same checks, under this API's own names, so
that an error names the field the client set.

A twin's field at its proto default is absent here (proto3 cannot tell it from one left unset) and takes the
model's default, which is the proto's. Every field of the twins is a field of these models (extra fields are
refused by name), so a field added to generate.proto is refused until it is given a check, never ignored.
"""

import dataclasses
from typing import Annotated, Any

from flatwire_wire import public
from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.sampling import DEFAULT_SAMPLING, INT32_MAX, TOP_K_NO_LIMIT
from flatwire_wire.scheduler import LogprobParams
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from services.gateway.protocol.cost import LogprobFields
from services.gateway.protocol.intake import PromptRequest
from services.gateway.protocol.parse import (
    InvalidRequest,
    ModelLimits,
    check_token_ids,
    check_top_k,
    limits_of,
    parse_data,
)
from services.gateway.protocol.sampling import DetokenizeFields, SamplingParamsFields

LOGPROB_FIELDS = LogprobFields(top_k="top_logprobs_num", max_new_tokens="sampling.max_new_tokens",
                               token_ids="token_ids_logprob", prompt="the prompt from logprob_start_len")

TokenIds = Annotated[list[int], AfterValidator(check_token_ids)]


class PublicSampling(SamplingParamsFields):
    """generate.proto's SamplingParams."""

    @field_validator("top_k", mode="before")
    @classmethod
    def _no_limit(cls, value: Any) -> Any:
        """generate.proto's top_k <= 0 is no limit: /generate's -1."""
        return TOP_K_NO_LIMIT if isinstance(value, int) and value <= 0 else value


class PublicGenerateRequest(DetokenizeFields):
    """generate.proto's GenerateRequest: one prompt; its stop, skip_special_tokens and no_stop_trim at the top."""

    text: str | None = None
    input_ids: TokenIds | None = None
    sampling: PublicSampling = Field(default_factory=PublicSampling)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0)
    logprob_start_len: int = Field(-1, ge=-1)  # -1: no prompt logprobs
    token_ids_logprob: TokenIds = Field(default_factory=list)
    stream: bool = False
    logprobs_mode: LogprobsMode = LogprobsMode.UNSPECIFIED  # /generate's default (ModelLimits.sglang_logprobs)
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0, le=INT32_MAX)
    return_top_p_token_ids: bool = False

    @classmethod
    def of(cls, request: public.GenerateRequest, limits: ModelLimits) -> "PublicGenerateRequest":
        """The twin, validated (InvalidRequest names this API's field)."""
        return parse_data(cls, _given(request), limits)

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_k(cls, value: int, info: ValidationInfo) -> int:
        return check_top_k("top_logprobs_num", value, info)

    @model_validator(mode="after")
    def _one_prompt(self, info: ValidationInfo) -> "PublicGenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequest("text", "exactly one of text and input_ids must be given")
        if self.logprobs_mode is LogprobsMode.UNSPECIFIED:  # the API's default, as /generate's
            self.logprobs_mode = limits_of(info).sglang_logprobs
        return self

    @property
    def prompt_field(self) -> str:
        return "text" if self.text is not None else "input_ids"

    def logprob(self) -> LogprobParams:
        if not self.return_logprob:
            return LogprobParams(logprob_start_len=-1)
        return LogprobParams(return_logprob=True, top_logprobs_num=self.top_logprobs_num,
                             logprob_start_len=self.logprob_start_len, token_ids_logprob=self.token_ids_logprob,
                             logprobs_mode=self.logprobs_mode)

    def prompt(self) -> PromptRequest:
        """The request's prompt, for the intake; `sampling` is the scheduler's name too."""
        return PromptRequest(sampling=self.sampling, max_new_tokens=self.sampling.requested_max_new_tokens,
                             default_max_new_tokens=DEFAULT_SAMPLING.max_new_tokens,
                             detokenize=self.detokenize(self.sampling.min_new_tokens), logprob=self.logprob(),
                             fields={"input_ids": self.prompt_field, "logprob": ""}, stream=self.stream,
                             return_routed_experts=self.return_routed_experts,
                             routed_experts_start_len=self.routed_experts_start_len,
                             return_top_p_token_ids=self.return_top_p_token_ids)


def _given(message: Any) -> dict:
    """A twin's fields that differ from their defaults, a nested message as a dict of its own."""
    given = {}
    for spec in dataclasses.fields(message):
        value, default = getattr(message, spec.name), spec.default
        if dataclasses.is_dataclass(value):
            value, default = _given(value), {}
        elif spec.default_factory is not dataclasses.MISSING:
            default = spec.default_factory()
        if value != default:
            given[spec.name] = value
    return given
