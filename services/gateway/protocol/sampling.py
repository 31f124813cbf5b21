"""The sampling and detokenizing options that SGLang's `sampling_params`, the OpenAI routes and the public gRPC API
share: the same fields and checks under the same names. A sampling option's default and range are the server's
(flatwire_wire.sampling, which the scheduler applies too): each field reads them from there (Rule)."""

import json
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any

from flatwire_wire.sampling import CONSTRAINTS, DEFAULT_SAMPLING, FLOAT32_TINY, RANGES, Range, check_logit_bias
from flatwire_wire.scheduler import SamplingParams
from flatwire_wire.steps import DetokenizeParams
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationInfo,
    model_validator,
)
from pydantic_core import core_schema

from services.gateway.protocol.cost import check_stop
from services.gateway.protocol.parse import RequestModel, check_token_ids

StopValue = str | list[str] | None


@dataclass(frozen=True)
class Rule:
    """A field checked by its sampling option's rule (flatwire_wire.sampling.RANGES), which names the option when it
    refuses, or by `narrower` bounds, one API's own; its bounds are in the OpenAPI schema too."""

    option: str
    narrower: Range | None = None

    @property
    def bounds(self) -> Range:
        return self.narrower or RANGES[self.option]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(partial(self.bounds.check, self.option), handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        bounds = self.bounds
        low = bounds.low if bounds.off is None else min(bounds.low, bounds.off)
        return {**handler(schema), "exclusiveMinimum" if bounds.low_open else "minimum": low, "maximum": bounds.high}


def _check_stop_token_ids(value: list[int] | None, info: ValidationInfo) -> list[int] | None:
    return check_token_ids(value, info) if value else value


def _logit_bias_ids(value):
    """OpenAI's {"<token id>": bias} keyed by ids, as the scheduler takes it (the public gRPC API's map has them
    already: JSON keys are strings, its are int32)."""
    if not isinstance(value, dict):
        return value  # pydantic names the expected type
    for key in value:
        if not (type(key) is int or (isinstance(key, str) and key.isascii() and key.isdigit())):
            raise ValueError(f"keys must be token ids, not {key!r}")
    return {int(key): bias for key, bias in value.items()}


def _check_logit_bias(value: dict[int, float] | None, info: ValidationInfo) -> dict[int, float] | None:
    if value:
        check_token_ids(list(value), info)
        check_logit_bias(value)
    return value


def _schema_text(value):
    """A JSON schema given as an object, as the JSON text the scheduler takes."""
    return json.dumps(value) if isinstance(value, dict) else value


def _one_constraint(value: str | None, info: ValidationInfo) -> str | None:
    """SGLang's rule: at most one of json_schema, regex and ebnf; the later one named is refused."""
    if value is not None:
        earlier = CONSTRAINTS[:CONSTRAINTS.index(info.field_name)]
        if given := [name for name in earlier if info.data.get(name) is not None]:
            raise ValueError(f"cannot be combined with {given[0]}: at most one of json_schema, regex and ebnf")
    return value


MaxNewTokens = Annotated[int, Rule("max_new_tokens")]
MinNewTokens = Annotated[int, Rule("min_new_tokens")]
Seed = Annotated[int, Rule("seed")]
StopTokenIds = Annotated[list[int] | None, AfterValidator(_check_stop_token_ids)]
Stop = Annotated[StopValue, AfterValidator(check_stop)]  # at most max_stop_strings of max_stop_length
LogitBias = Annotated[dict[int, float] | None, BeforeValidator(_logit_bias_ids), AfterValidator(_check_logit_bias)]
Constraint = Annotated[str | None, AfterValidator(_one_constraint)]  # compiled (and refused) by the scheduler


def _neutral_text(value) -> str:
    return "null" if value is None else repr(value).replace("None", "null").replace("'", '"')


def unsupported(*neutral) -> AfterValidator:
    """A field flatwire cannot honour yet: accepted only at a value that asks for nothing (the neutral one,
    which clients such as lm-eval and SGLang's bench_serving send), otherwise refused with a 400 naming it."""
    allowed = " or ".join(_neutral_text(value) for value in neutral)

    def check(value):
        if value is not None and value not in neutral:
            raise ValueError(f"not supported by this server yet; only {allowed} is accepted")
        return value

    return AfterValidator(check)


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice j of a request seeded with `seed` (n > 1): distinct per choice, reproducible."""
    return None if seed is None else (seed + j) % 2**64


def stop_list(stop: StopValue) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


class SamplingFields(RequestModel):
    """What a token is chosen from (SGLang's names, defaults and checks), and the scheduler's SamplingParams built
    from them."""

    temperature: Annotated[float, Rule("temperature")] = DEFAULT_SAMPLING.temperature
    top_p: Annotated[float, Rule("top_p")] = DEFAULT_SAMPLING.top_p
    top_k: Annotated[int, Rule("top_k")] = DEFAULT_SAMPLING.top_k
    min_p: Annotated[float, Rule("min_p")] = DEFAULT_SAMPLING.min_p
    seed: Seed | None = DEFAULT_SAMPLING.seed
    stop_token_ids: StopTokenIds = None
    ignore_eos: bool = DEFAULT_SAMPLING.ignore_eos
    # Logit adjustments (what is sampled, not the logprobs returned): scheduler.proto's SamplingParams.
    frequency_penalty: Annotated[float, Rule("frequency_penalty")] = DEFAULT_SAMPLING.frequency_penalty
    presence_penalty: Annotated[float, Rule("presence_penalty")] = DEFAULT_SAMPLING.presence_penalty
    repetition_penalty: Annotated[float, Rule("repetition_penalty")] = DEFAULT_SAMPLING.repetition_penalty
    min_new_tokens: MinNewTokens = DEFAULT_SAMPLING.min_new_tokens
    logit_bias: LogitBias = None
    # Structured output (SGLang's; the OpenAI routes' response_format too): the scheduler's grammar.py.
    json_schema: Annotated[Constraint, BeforeValidator(_schema_text)] = None  # JSON text (or an object)
    regex: Constraint = None
    ebnf: Constraint = None

    def sampling(self, max_new_tokens: int, choice: int = 0) -> SamplingParams:
        """The scheduler's sampling options; `choice` j > 0 (the j-th of n samples) gets its own seed, so that
        the n choices of a seeded request are distinct and each reproducible."""
        return SamplingParams(
            # A top_p below float32's range would round to 0 (refused); the smallest float32 keeps its meaning,
            # the most likely token alone.
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=max(self.top_p, FLOAT32_TINY),
            top_k=max(self.top_k, 0), min_p=self.min_p, seed=choice_seed(self.seed, choice),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, min_new_tokens=self.min_new_tokens,
            logit_bias=self.logit_bias or {}, **self.constraint())

    def constraint(self) -> dict[str, str]:
        """SamplingParams.constraint's field: the one of json_schema, regex and ebnf given, if any."""
        return {name: value for name in CONSTRAINTS if (value := getattr(self, name)) is not None}


class DetokenizeFields(RequestModel):
    """How the output becomes text and where a stop string ends it (SGLang's names, defaults and checks): in
    SGLang's sampling_params, an OpenAI request's top level, and the public gRPC request's top level."""

    stop: Stop = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    def detokenize(self, min_new_tokens: int) -> DetokenizeParams:
        """The detokenizer's options; stop strings match only once the output has `min_new_tokens` (a sampling
        field) tokens."""
        return DetokenizeParams(
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            stop=stop_list(self.stop), no_stop_trim=self.no_stop_trim, min_new_tokens=min_new_tokens)


class SamplingParamsFields(SamplingFields):
    """SamplingFields with max_new_tokens: what a SamplingParams message holds (the public API's, the
    scheduler's), and the core of SGLang's sampling_params."""

    max_new_tokens: MaxNewTokens = DEFAULT_SAMPLING.max_new_tokens  # cut to what the context leaves when not given

    @property
    def requested_max_new_tokens(self) -> int | None:
        """max_new_tokens as the client sent it; None when it sent none (the default, which a long prompt cuts)."""
        return self.max_new_tokens if "max_new_tokens" in self.model_fields_set else None


class CustomParams(RequestModel):
    """SGLang's `custom_params`: the arguments of a custom logit processor, which flatwire has not (refused by
    name), and the key slime's SGLang reads there: top-p replay, each output token's nucleus in meta_info."""

    return_top_p_token_ids: bool = False

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        if isinstance(value, dict) and (others := sorted(set(value) - set(cls.model_fields), key=str)):
            raise ValueError(f"{others[0]}: not supported (a custom logit processor's parameter, and this server "
                             f"runs none); the one key honoured is return_top_p_token_ids")
        return value


class SGLangSamplingParams(SamplingParamsFields, DetokenizeFields):
    """SGLang's `sampling_params`: the sampling and detokenizing fields, max_new_tokens, and n."""

    n: int = Field(default=1, ge=1)  # samples per prompt (GenerateRequest.samples_per_prompt)
    sampling_seed: Seed | None = None  # SGLang's name here for `seed`
    # SGLang's sampling parameters flatwire cannot honour yet: refused unless neutral.
    stop_regex: Annotated[Any, unsupported(None, [])] = None
    structural_tag: Annotated[Any, unsupported(None)] = None
    beam_width: Annotated[Any, unsupported(None)] = None
    custom_params: CustomParams | None = None  # top-p replay (CustomParams)
    watermark: Annotated[Any, unsupported(None)] = None
    stream_interval: Annotated[Any, unsupported(None)] = None  # per request; the server's --stream-interval

    @property
    def return_top_p_token_ids(self) -> bool:
        return self.custom_params is not None and self.custom_params.return_top_p_token_ids

    @model_validator(mode="after")
    def _one_seed(self) -> "SGLangSamplingParams":
        if self.sampling_seed is not None:
            if self.seed is not None and self.seed != self.sampling_seed:
                raise ValueError("seed and sampling_seed differ: give one")
            self.seed = self.sampling_seed
        return self
