"""OpenAI's chat and text completion requests, with SGLang's extensions.

Extensions: the SGLang sampling options (top_k, min_p, stop_token_ids, ignore_eos,
skip_special_tokens, spaces_between_special_tokens, no_stop_trim, json_schema, regex, ebnf), `return_meta_info`
(each choice carries SGLang's meta_info), `return_flat_raw_output_top_logprobs` (the
output candidates as flat arrays in meta_info instead of in `logprobs`) and
`return_flat_raw_top_logprobs_b64` (those arrays as base64; the default on chat).
"""

import dataclasses
import json
from typing import Annotated, Any, Literal

from flatwire_wire.sampling import DEFAULT_SAMPLING, Range
from flatwire_wire.scheduler import LogprobParams
from flatwire_wire.steps import DetokenizeParams
from pydantic import AfterValidator, BaseModel, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from services.gateway.agents.tool_choice import named_call_schema, required_calls_schema
from services.gateway.protocol.chat import TEMPLATE_VARIABLES, ChatMessage, NamedToolChoice, Tool
from services.gateway.protocol.cost import LogprobFields
from services.gateway.protocol.intake import PromptRequest
from services.gateway.protocol.parse import (
    InvalidRequest,
    LogprobsModeName,
    RequestModel,
    check_batch_size,
    check_token_ids,
    check_top_k,
    check_vllm_top_k,
    is_token_ids,
    limits_of,
    logprobs_mode,
)
from services.gateway.protocol.sampling import (
    CONSTRAINTS,
    CustomParams,
    DetokenizeFields,
    MaxNewTokens,
    MinNewTokens,
    Rule,
    SamplingFields,
    unsupported,
)
from services.gateway.protocol.sglang import SGLangServerFields

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's max_tokens for completions, given or null
OPENAI_TEMPERATURE = Range(0.0, 2.0)  # OpenAI's documented range, within the server's


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: Annotated[bool | None, unsupported(None, False)] = None  # SGLang's and vLLM's
    include_obfuscation: Annotated[bool | None, unsupported(None, False)] = None  # OpenAI's padding


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema. The schema is enforced whatever `strict` says, as SGLang does."""

    name: str
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema requires json_schema")
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must match (json_object: any object, as SGLang); None for text."""
        if self.json_schema is not None and self.type == "json_schema":
            return json.dumps(self.json_schema.schema_)
        return '{"type": "object"}' if self.type == "json_object" else None


def _no_other_constraint(value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
    """A JSON response_format is a constraint: not with SGLang's json_schema, regex or ebnf as well."""
    if value is not None and value.schema_text() is not None:
        if given := [name for name in CONSTRAINTS if info.data.get(name) is not None]:
            raise ValueError(f"cannot be combined with {given[0]}: at most one of response_format, json_schema, "
                             "regex and ebnf")
    return value


TOP_P_FIELD = "custom_params.return_top_p_token_ids"


def model_adapter(model: str, names: list[str], lora: bool) -> str:
    """The LoRA adapter a request's `model` names ("": the served model, by any of its `names`): `<served>:<adapter>`
    (SGLang's way) or, when the schedulers serve adapters (`lora`), the adapter's own name (vLLM's); else 404."""
    base = next((name for name in names if model.startswith(name + ":")), None)
    if model in names:
        return ""
    if base is not None:
        return model[len(base) + 1:]
    if lora:
        return model
    raise InvalidRequest("model", f"The model `{model}` does not exist; this server serves `{names[0]}`",
                         status=404, code="model_not_found")


class OpenAIRequest(SamplingFields, DetokenizeFields, SGLangServerFields):
    """What chat and completions share."""

    model: str
    n: int = Field(1, ge=1, le=128)
    max_tokens: MaxNewTokens | None = None  # 0: the prompt's logprobs only (with echo)
    temperature: Annotated[float, Rule("temperature", OPENAI_TEMPERATURE)] = DEFAULT_SAMPLING.temperature
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: Annotated[ResponseFormat | None, AfterValidator(_no_other_constraint)] = None  # json: a constraint
    # OpenAI's and SGLang's fields flatwire cannot honour yet: refused unless neutral.
    best_of: Annotated[int | None, unsupported(None, 1)] = None
    stop_regex: Annotated[Any, unsupported(None, [])] = None
    rid: Annotated[Any, unsupported(None)] = None
    ngram_corpus_id: Annotated[Any, unsupported(None)] = None
    return_cached_tokens_details: Annotated[bool | None, unsupported(None, False)] = None
    # SGLang's (and vLLM's) name for min_new_tokens here
    min_tokens: MinNewTokens | None = None
    # SGLang extensions (besides the sampling fields)
    return_meta_info: bool = False
    return_flat_raw_output_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    # Of the logprobs returned (vLLM's names, and SGLang's); absent: the scheduler's --logprobs-mode, as vLLM's
    logprobs_mode: LogprobsModeName | None = None
    # SGLang's; top-p replay: each choice's meta_info.top_p_token_ids (CustomParams)
    custom_params: CustomParams | None = None
    # vLLM's: the prompt's and each choice's token ids in the response, so that a trainer never retokenizes
    return_token_ids: bool = False
    # vLLM's: the prompt's logprobs, with this many top candidates per position (-1: the whole vocabulary), in its
    # shape (render/vllm_logprobs.py); the output's text through a matched stop string (SGLang's no_stop_trim keeps
    # the rest of its token too)
    prompt_logprobs: int | None = Field(None, ge=-1)
    include_stop_str_in_output: bool = False
    # SGLang's MoE routing replay: each choice's meta_info.routed_experts (a scheduler with
    # --enable-return-routed-experts)
    return_routed_experts: bool = False
    # The LoRA adapter it runs on and the field that named it (`choose_model`)
    _adapter: str = PrivateAttr("")
    _adapter_field: str = PrivateAttr("lora_path")

    @field_validator("lora_path")
    @classmethod
    def _one_adapter(cls, value):
        if isinstance(value, list):
            raise ValueError("one adapter's name for the whole request (a list of one per prompt is /generate's)")
        return value

    def choose_model(self, names: list[str], lora: bool) -> None:
        """The model the request runs on: the served one, by any of its `names`, or a LoRA adapter of it (`lora`:
        the schedulers serve adapters), which `model` names (vLLM's way: the adapter's own name; SGLang's:
        `<served>:<adapter>`) or lora_path does beside the served model's name (SGLang's). Whether such an adapter is
        loaded, the scheduler says (404 naming it)."""
        adapter = model_adapter(self.model, names, lora)
        path = self.lora_path if isinstance(self.lora_path, str) else ""  # a list is refused (_one_adapter)
        if adapter and path and path != adapter:
            raise InvalidRequest("lora_path", f"lora_path: {path!r}, but model names the adapter {adapter!r}")
        self._adapter, self._adapter_field = adapter or path, "model" if adapter else "lora_path"

    @property
    def adapter(self) -> str:
        """The LoRA adapter chosen (`choose_model`); "": the base model."""
        return self._adapter

    def response_model(self, served: str) -> str:
        """The `model` a response reports: the adapter the request ran on (as vLLM answers), else the served one."""
        return self.model if self._adapter_field == "model" and self._adapter else served
    _prompt_top_k: int | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _stream_options(self) -> "OpenAIRequest":
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options", "stream_options: only with stream true")
        return self

    @model_validator(mode="after")
    def _min_tokens(self) -> "OpenAIRequest":
        if self.min_tokens is not None:
            if "min_new_tokens" in self.model_fields_set and self.min_new_tokens != self.min_tokens:
                raise InvalidRequest("min_tokens", "min_tokens: min_new_tokens differs: give one")
            self.min_new_tokens = self.min_tokens
        return self

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_range(cls, value: int | None, info: ValidationInfo) -> int | None:
        return value if value is None else check_vllm_top_k("prompt_logprobs", value, info)

    @model_validator(mode="after")
    def _vllm_fields(self, info: ValidationInfo) -> "OpenAIRequest":
        if self.prompt_logprobs is not None:
            if self.stream:
                raise InvalidRequest("prompt_logprobs", "prompt_logprobs: not available with stream true (as vLLM's)")
            k = limits_of(info).vocab_size if self.prompt_logprobs == -1 else self.prompt_logprobs
            if self.return_flat_raw_output_top_logprobs and k > self.output_top_k:
                raise InvalidRequest("prompt_logprobs", "prompt_logprobs: at most the output's top-k with "
                                                        "return_flat_raw_output_top_logprobs (their arrays share it)")
            self._prompt_top_k = k
        return self

    @property
    def prompt_top_k(self) -> int | None:
        """The top-k of the prompt's logprobs (prompt_logprobs; -1: the vocabulary), None: none asked."""
        return self._prompt_top_k

    @property
    def output_top_k(self) -> int:
        """The top-k of the output's logprobs the request asks for."""
        return 0

    def logprob_fields(self, fields: LogprobFields) -> LogprobFields:
        """`fields` (the API's names for what sizes a response), with prompt_logprobs where it asks for the prompt's
        rows and for the top-k the scheduler computes."""
        if self._prompt_top_k is None:
            return fields
        top_k = "prompt_logprobs" if self._prompt_top_k >= self.output_top_k else fields.top_k
        return dataclasses.replace(fields, top_k=top_k, prompt="the prompt, with prompt_logprobs")

    def logprob_params(self, output: bool, output_k: int, echo: bool = False) -> LogprobParams:
        """The scheduler's LogprobParams: output logprobs (`output`, top `output_k`), the prompt's with `echo` or
        prompt_logprobs. The scheduler computes one top-k for both sides: the larger (each side renders its own)."""
        prompt_k = self.prompt_top_k
        if not output and prompt_k is None:
            return LogprobParams(logprob_start_len=-1)
        return LogprobParams(return_logprob=True, top_logprobs_num=max(output_k, prompt_k or 0),
                             logprob_start_len=0 if echo or prompt_k is not None else -1,
                             logprobs_mode=logprobs_mode(self.logprobs_mode))

    @model_validator(mode="after")
    def _flat_flags(self) -> "OpenAIRequest":
        for flag in ("return_flat_raw_output_top_logprobs", "return_routed_experts"):  # they live in meta_info
            if getattr(self, flag) and not self.return_meta_info:
                raise InvalidRequest(flag, f"{flag} requires return_meta_info")
        if self.return_top_p_token_ids and not self.return_meta_info:
            raise InvalidRequest(TOP_P_FIELD, f"{TOP_P_FIELD} requires return_meta_info (it lives in meta_info)")
        return self

    def detokenize(self, min_new_tokens: int) -> DetokenizeParams:
        return dataclasses.replace(super().detokenize(min_new_tokens), include_stop_str=self.include_stop_str_in_output)

    @property
    def return_top_p_token_ids(self) -> bool:
        return self.custom_params is not None and self.custom_params.return_top_p_token_ids

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    def constraint(self) -> dict[str, str]:
        schema = self.response_format.schema_text() if self.response_format is not None else None
        return {"json_schema": schema} if schema is not None else super().constraint()

    def scheduler_fields(self) -> dict[str, str]:
        """The scheduler's field names -> this request's (see pipeline.GenerateInput.fields)."""
        fields = {"sampling": "", "sampling.max_new_tokens": self.max_tokens_field, "lora_name": self._adapter_field,
                  **{f"logprob.{f.name}": "logprobs" for f in dataclasses.fields(LogprobParams)},
                  "return_top_p_token_ids": TOP_P_FIELD}
        if self.response_format is not None and self.response_format.schema_text() is not None:
            fields["sampling.json_schema"] = "response_format"
        return fields


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: MaxNewTokens | None = None
    return_flat_raw_top_logprobs_b64: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    # SGLang's: variables for the chat template (enable_thinking, ...) and the reasoning parser's switches
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # To the chat template as `reasoning_effort`, as SGLang passes it ("none" also turns thinking off).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # OpenAI's cache hint: requests with the same key go to the same replica, as with a session header.
    prompt_cache_key: str | None = None
    # Labels, which change nothing in the output (OpenAI keeps metadata with stored completions only).
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    # OpenAI's fields flatwire cannot honour yet (and SGLang's continue_final_message): refused unless neutral.
    functions: Annotated[Any, unsupported(None, [])] = None  # the legacy function calling: give tools
    function_call: Annotated[Any, unsupported(None, "none")] = None
    audio: Annotated[Any, unsupported(None)] = None
    modalities: Annotated[Any, unsupported(None, ["text"])] = None
    prediction: Annotated[Any, unsupported(None)] = None
    verbosity: Annotated[Any, unsupported(None)] = None
    web_search_options: Annotated[Any, unsupported(None)] = None
    store: Annotated[bool | None, unsupported(None, False)] = None
    service_tier: Annotated[str | None, unsupported(None, "auto", "default")] = None
    continue_final_message: Annotated[bool | None, unsupported(None, False)] = None
    input_ids: Annotated[Any, unsupported(None)] = None  # SGLang's: the prompt's ids instead of the template's
    task: Annotated[Any, unsupported(None)] = None  # SGLang's DeepSeek-V4 task tokens

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _newer_tool_choices(cls, value):
        """OpenAI's newer choices (allowed_tools, custom) get a refusal that says so."""
        if isinstance(value, dict) and value.get("type") in ("allowed_tools", "custom"):
            raise ValueError(f"type {value['type']!r} is not supported by this server yet; name a function "
                             '({"type": "function", "function": {"name": ...}}), or give auto, required or none')
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        return value if value is None else check_top_k("top_logprobs", value, info)

    @model_validator(mode="after")
    def _logprobs(self, info: ValidationInfo) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs", "top_logprobs requires logprobs=true")
        check_batch_size("n", self.n, f"n={self.n} choices", info)
        return self

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise InvalidRequest("tools", "tools: two functions have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequest("tool_choice", f"tool_choice: function {choice.function.name!r} is not in tools")
        if choice in ("auto", "required") and not names:
            raise InvalidRequest("tool_choice", f"tool_choice {choice!r} requires tools")
        if self.forced_tool_schema() is not None:
            given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
            if self.response_format is not None and self.response_format.schema_text() is not None:
                given.insert(0, "response_format")
            if given:
                raise InvalidRequest("tool_choice", f"tool_choice {self.tool_choice_name!r} constrains the output: "
                                                    f"it cannot be combined with {given[0]}")
        reserved = [key for key in self.chat_template_kwargs or {} if key in TEMPLATE_VARIABLES]
        if reserved:
            raise InvalidRequest("chat_template_kwargs", f"chat_template_kwargs: {reserved[0]!r} is the template's "
                                                         "own variable; give it as a request field")
        return self

    @property
    def tool_choice_name(self) -> str:
        """auto, none, required or function (OpenAI's default: auto with tools, none without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def function_names(self) -> frozenset[str]:
        """The functions the request declares: the only ones a call may name."""
        return frozenset(tool.function.name for tool in self.tools or [])

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def forced_tool_schema(self) -> str | None:
        """The output's JSON schema when tool_choice demands a call (tool_choice.py), else None."""
        functions = {tool.function.name: tool.function.parameters for tool in self.tools or []}
        if self.forced_function is not None:
            return named_call_schema(functions[self.forced_function])
        if self.tool_choice == "required":
            return required_calls_schema(functions, self.parallel_tool_calls)
        return None

    def constraint(self) -> dict[str, str]:
        schema = self.forced_tool_schema()
        return {"json_schema": schema} if schema is not None else super().constraint()

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort, as SGLang gives it to the template: the field wins over the
        same key there, and "none" defaults thinking and enable_thinking to false."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        if self.reasoning_effort == "none":
            kwargs.setdefault("thinking", False)
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def template_tools(self) -> list[dict] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def scheduler_fields(self) -> dict[str, str]:
        fields = {**super().scheduler_fields(), "input_ids": "messages", "logprob.top_logprobs_num": "top_logprobs"}
        if self.forced_tool_schema() is not None:
            fields["sampling.json_schema"] = "tools"  # a function's parameters schema the grammar cannot take
        return fields

    @property
    def output_top_k(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def logprob(self) -> LogprobParams:
        return self.logprob_params(self.logprobs, self.output_top_k)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # Chat's fields, which OpenAI's completions do not have: refused unless neutral.
    tools: Annotated[list | None, unsupported(None, [])] = None
    tool_choice: Annotated[str | dict | None, unsupported(None, "none")] = None
    suffix: Annotated[str | None, unsupported(None, "")] = None  # OpenAI's insertion after the completion
    max_tokens: MaxNewTokens | None = DEFAULT_COMPLETION_TOKENS
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _default_max_tokens(cls, value: int | None) -> int:
        return DEFAULT_COMPLETION_TOKENS if value is None else value  # an explicit null is OpenAI's default too

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        return value if value is None else check_top_k("logprobs", value, info)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value, info: ValidationInfo):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            for row in (value if isinstance(value[0], list) else [value] if isinstance(value[0], int) else []):
                check_token_ids(row, info)
        return value

    @model_validator(mode="after")
    def _batch_size(self, info: ValidationInfo) -> "CompletionRequest":
        # Choice p * n + j is prompt p's j-th sample: one sub-request each. The error names n when
        # it multiplies the prompts, prompt when the prompts alone are too many.
        prompts = len(self.prompts())
        param = "prompt" if self.n == 1 or prompts > limits_of(info).max_batch_size else "n"
        what = f"{prompts} prompts" if self.n == 1 else f"{prompts} prompts x n={self.n}"
        check_batch_size(param, prompts * self.n, what, info)
        return self

    def scheduler_fields(self) -> dict[str, str]:
        return {**super().scheduler_fields(), "input_ids": "prompt", "logprob.logprob_start_len": "echo"}

    def prompts(self) -> list[str] | list[list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if is_token_ids(prompt):
            return [prompt]
        return prompt

    @property
    def output_top_k(self) -> int:
        return self.logprobs or 0

    def logprob(self) -> LogprobParams:
        # echo returns the prompt's logprobs too, from its first position.
        output = self.logprobs is not None
        return self.logprob_params(output, self.output_top_k, echo=self.echo and output)


def prompt_request(req: ChatCompletionRequest | CompletionRequest) -> PromptRequest:
    """The request's prompt (each of a completion's prompts) for the intake, whose n samples are its choices."""
    return PromptRequest(sampling=req, max_new_tokens=req.requested_max_tokens, default_max_new_tokens=None,
                         detokenize=req.detokenize(req.min_new_tokens), logprob=req.logprob(),
                         fields=req.scheduler_fields(), stream=req.stream,
                         return_routed_experts=req.return_routed_experts,
                         return_top_p_token_ids=req.return_top_p_token_ids, lora_name=req.adapter,
                         cache_namespace=req.cache_namespace())
