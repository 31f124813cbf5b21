"""vLLM's token-in/token-out request, `POST /inference/v1/generate` (vLLM's GenerateRequest, in
vllm/entrypoints/scale_out/token_in_token_out/protocol.py, earlier vllm/entrypoints/serve/disagg/protocol.py): the
prompt as `token_ids`, vLLM's engine SamplingParams as `sampling_params`, one prompt per request and n samples of
it. SkyRL (skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py) and prime-rl
(prime_rl/utils/client.py) send it.

The sampling fields are the gateway's own (SamplingFields, DetokenizeFields) under vLLM's names and defaults
(max_tokens absent or null: all that the context leaves, as vLLM's route; top_k 0: no limit; min_tokens;
structured_outputs: the scheduler's grammar). vLLM's fields flatwire cannot honour are accepted at their neutral
values only and refused by name otherwise: multimodal features, the text output mode, structured outputs' choice
and whitespace options, allowed and bad words, logprobs of chosen ids, priority scheduling, disaggregation
parameters.
"""

import dataclasses
import json
from typing import Annotated, Any, Literal

from flatwire_wire.scheduler import LogprobParams
from pydantic import BeforeValidator, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from services.gateway.protocol.cost import LogprobFields
from services.gateway.protocol.intake import PromptRequest
from services.gateway.protocol.openai import StreamOptions
from services.gateway.protocol.parse import (
    InvalidRequest,
    RequestModel,
    check_batch_size,
    check_token_ids,
    check_vllm_top_k,
    limits_of,
)
from services.gateway.protocol.sampling import (
    DetokenizeFields,
    MaxNewTokens,
    MinNewTokens,
    Rule,
    SamplingFields,
    unsupported,
)
from services.gateway.protocol.sglang import cache_namespace

PARAMS = "sampling_params"
LOGPROB_FIELDS = LogprobFields(top_k=f"{PARAMS}.logprobs", max_new_tokens=f"{PARAMS}.max_tokens",
                               prompt=f"the prompt, with {PARAMS}.prompt_logprobs", n=f"{PARAMS}.n")
DELTA = 1  # vLLM's RequestOutputKind.DELTA


class StructuredOutputs(RequestModel):
    """vLLM's StructuredOutputsParams, one constraint of: json (a schema), regex, grammar (EBNF, as xgrammar reads
    it, vLLM's default backend and the scheduler's), json_object (any object). The scheduler's grammar
    (SamplingFields' json_schema, regex, ebnf) enforces it."""

    json_: Annotated[str | dict | None, Field(alias="json")] = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None
    choice: Annotated[Any, unsupported(None)] = None
    structural_tag: Annotated[Any, unsupported(None)] = None
    disable_any_whitespace: Annotated[bool, unsupported(False)] = False
    disable_additional_properties: Annotated[bool, unsupported(False)] = False
    whitespace_pattern: Annotated[Any, unsupported(None)] = None

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [name for name in ("json", "regex", "grammar", "json_object") if self.constraint_of(name) is not None]
        if len(given) != 1:
            raise ValueError(f"give one of json, regex, grammar and json_object (as vLLM), not {given or 'none'}")
        return self

    def constraint_of(self, name: str) -> str | dict | bool | None:
        """What the constraint `name` asks (json_object false asks nothing)."""
        value = self.json_ if name == "json" else getattr(self, name)
        return None if value is False else value

    def sampling_fields(self) -> dict[str, str]:
        """The scheduler's constraint: SamplingFields' json_schema, regex or ebnf."""
        if self.json_object:
            return {"json_schema": '{"type": "object"}'}
        if self.json_ is not None:
            return {"json_schema": self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)}
        return {"regex": self.regex} if self.regex is not None else {"ebnf": self.grammar or ""}


def _no_limit_at_zero(value):
    """vLLM's top_k 0 (its default) and -1 both mean no limit; the gateway's rule takes -1 for it."""
    return -1 if value == 0 else value


class VllmSamplingParams(SamplingFields, DetokenizeFields):
    """vLLM's SamplingParams (vllm/sampling_params.py) as its route takes it in JSON."""

    n: int = Field(1, ge=1)
    top_k: Annotated[int, BeforeValidator(_no_limit_at_zero), Rule("top_k")] = -1
    max_tokens: MaxNewTokens | None = None  # absent or null: what the context leaves
    min_tokens: MinNewTokens = 0
    logprobs: int | None = Field(None, ge=-1)  # output top-k; 0: the sampled token's alone; -1: the vocabulary
    prompt_logprobs: int | None = Field(None, ge=-1)
    include_stop_str_in_output: bool = False
    # The text is not returned here: it only decides whether stop strings can match (the method of that name is
    # DetokenizeFields', the detokenizer's options).
    detokenize_text: bool = Field(True, alias="detokenize")
    structured_outputs: StructuredOutputs | None = None
    output_kind: Literal[0, 1, 2] = 0  # CUMULATIVE, DELTA, FINAL_ONLY: how a stream's chunks carry the output
    flat_logprobs: bool = False  # vLLM's in-process layout of the same logprobs
    skip_clone: bool = False  # vLLM's in-process copy of the params
    # vLLM's fields flatwire cannot honour yet: refused unless neutral.
    stream_interval: Annotated[Any, unsupported(None)] = None
    allowed_token_ids: Annotated[Any, unsupported(None)] = None
    bad_words: Annotated[Any, unsupported(None, [])] = None
    extra_args: Annotated[Any, unsupported(None, {})] = None
    logprob_token_ids: Annotated[Any, unsupported(None)] = None
    prompt_logprob_token_ids: Annotated[Any, unsupported(None)] = None
    prompt_logprob_start: Annotated[Any, unsupported(None, 0)] = None
    skip_reading_prefix_cache: Annotated[Any, unsupported(None, False)] = None
    thinking_token_budget: Annotated[Any, unsupported(None, -1)] = None
    repetition_detection: Annotated[Any, unsupported(None)] = None
    routed_experts_prompt_start: Annotated[Any, unsupported(None, 0)] = None
    trace_decode_token_ids: Annotated[Any, unsupported(None)] = None

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _top_k(cls, value: int | None, info: ValidationInfo) -> int | None:
        return value if value is None else check_vllm_top_k(info.field_name or "", value, info)

    @model_validator(mode="after")
    def _vllm_rules(self) -> "VllmSamplingParams":
        if self.stop and not self.detokenize_text:
            raise InvalidRequest(f"{PARAMS}.stop", f"{PARAMS}.stop: stop strings need detokenize true (as vLLM's)")
        if self.structured_outputs is not None and (given := self.constraint()):
            raise InvalidRequest(f"{PARAMS}.structured_outputs", f"{PARAMS}.structured_outputs: not with "
                                 f"{next(iter(given))} as well")
        if "min_new_tokens" in self.model_fields_set:
            raise InvalidRequest(f"{PARAMS}.min_new_tokens", f"{PARAMS}.min_new_tokens: vLLM's name is min_tokens")
        return self


class InferenceGenerateRequest(RequestModel):
    """vLLM's GenerateRequest."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VllmSamplingParams
    request_id: str | None = None  # echoed in the response (vLLM's default: a fresh uuid)
    model: str | None = None  # the served model or a loaded LoRA adapter (vLLM's way: its own name)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    return_token_ids: bool | None = None  # the prompt's ids in the response (its first chunk, streamed)
    output_mode: Annotated[Literal["tokens", "text"], unsupported("tokens")] = "tokens"
    priority: Annotated[int, unsupported(0)] = 0  # vLLM refuses others too unless it schedules by priority
    features: Annotated[Any, unsupported(None)] = None
    content_parts: Annotated[Any, unsupported(None)] = None
    token_offsets: Annotated[Any, unsupported(None)] = None
    reasoning_ended: Annotated[Any, unsupported(None)] = None
    reasoning_parser_kwargs: Annotated[Any, unsupported(None)] = None
    kv_transfer_params: Annotated[Any, unsupported(None)] = None
    ec_transfer_params: Annotated[Any, unsupported(None)] = None
    _vocab_size: int = PrivateAttr(0)

    @field_validator("token_ids")
    @classmethod
    def _token_ids(cls, value: list[int], info: ValidationInfo) -> list[int]:
        return check_token_ids(value, info)

    @model_validator(mode="after")
    def _checks(self, info: ValidationInfo) -> "InferenceGenerateRequest":
        params = self.sampling_params
        check_batch_size(f"{PARAMS}.n", params.n, f"n={params.n} samples", info)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options", "stream_options: only with stream true")
        if self.stream and params.prompt_logprobs is not None:
            raise InvalidRequest(f"{PARAMS}.prompt_logprobs",
                                 f"{PARAMS}.prompt_logprobs: not available with stream true (as vLLM's)")
        if params.output_kind == DELTA and not self.stream:
            raise InvalidRequest(f"{PARAMS}.output_kind", f"{PARAMS}.output_kind: 1 (DELTA) without stream would "
                                 "answer with the last delta alone (as vLLM's does); send 0 or 2")
        self._vocab_size = limits_of(info).vocab_size
        return self

    def _top_k(self, value: int | None) -> int | None:
        """A logprobs field's top-k (-1: the vocabulary); None: not asked."""
        return self._vocab_size if value == -1 else value

    @property
    def output_top_k(self) -> int | None:
        return self._top_k(self.sampling_params.logprobs)

    @property
    def prompt_top_k(self) -> int | None:
        return self._top_k(self.sampling_params.prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprob(self) -> LogprobParams:
        """One top-k for both sides (the larger: each renders its own), from the prompt's first token with
        prompt_logprobs. The output's are of the scheduler's --logprobs-mode (vLLM's server flag)."""
        output_k, prompt_k = self.output_top_k, self.prompt_top_k
        if output_k is None and prompt_k is None:
            return LogprobParams(logprob_start_len=-1)
        return LogprobParams(return_logprob=True, top_logprobs_num=max(output_k or 0, prompt_k or 0),
                             logprob_start_len=-1 if prompt_k is None else 0)

    def prompt_request(self, adapter: str) -> PromptRequest:
        """The prompt for the intake (its n samples are the choices), on the LoRA `adapter` ("": the base model)."""
        params = self.sampling_params
        fields = {"sampling": PARAMS, "sampling.max_new_tokens": f"{PARAMS}.max_tokens",
                  "sampling.min_new_tokens": f"{PARAMS}.min_tokens", "input_ids": "token_ids",
                  "lora_name": "model",
                  **{f"logprob.{field.name}": f"{PARAMS}.logprobs" for field in dataclasses.fields(LogprobParams)}}
        constraint = params.structured_outputs.sampling_fields() if params.structured_outputs is not None else {}
        fields |= {f"sampling.{name}": f"{PARAMS}.structured_outputs" for name in constraint}
        sampling = params.model_copy(update={"min_new_tokens": params.min_tokens, **constraint})
        detokenize = dataclasses.replace(params.detokenize(params.min_tokens),
                                         include_stop_str=params.include_stop_str_in_output)
        return PromptRequest(sampling=sampling, max_new_tokens=params.max_tokens, default_max_new_tokens=None,
                             detokenize=detokenize, logprob=self.logprob(), fields=fields, stream=bool(self.stream),
                             lora_name=adapter, cache_namespace=cache_namespace(self.cache_salt))
