"""SGLang's `POST /generate` request (GenerateReqInput), the fields flatwire implements; each prompt of it a
PromptRequest for the intake (protocol/intake.py)."""

import json
from typing import Annotated, Any

from flatwire_wire.sampling import DEFAULT_SAMPLING, INT32_MAX
from flatwire_wire.scheduler import LogprobParams
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from services.gateway.protocol.intake import PromptRequest
from services.gateway.protocol.parse import (
    InvalidRequest,
    LogprobsModeName,
    RequestModel,
    check_batch_size,
    check_token_ids,
    check_top_k,
    is_id_lists,
    limits_of,
    logprobs_mode,
)
from services.gateway.protocol.sampling import SGLangSamplingParams, unsupported

MAX_RID_LENGTH = 256
PER_PROMPT_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob")


def no_media(value) -> bool:
    """Whether a media field's value holds no item: null, "", or lists of those at any depth ([], a batch's
    [[], []]), as SGLang's has_valid_data reads them; AReaL sends image_data [] with every prompt."""
    if value is None or value == "":
        return True
    return isinstance(value, list) and all(no_media(item) for item in value)


def _check_no_media(value):
    if not no_media(value):
        raise ValueError('not supported by this server yet (no media input); only an empty value is accepted: '
                         'null, "" or [] (per prompt of a batch too)')
    return value


NoMedia = Annotated[Any, AfterValidator(_check_no_media)]


class SGLangServerFields(RequestModel):
    """Fields of SGLang's /generate and OpenAI routes alike: the LoRA adapter a request runs on (lora_path: its name,
    as loaded; /generate takes one per prompt of a batch) and its prefix-cache namespace (vLLM's cache_salt,
    SGLang's extra_key: requests share cached KV only with the same ones); and those that ask for what flatwire does
    not have (images, sessions, hidden states, disaggregated prefill and data-parallel placement, custom logit
    processors, priority scheduling, metric labels), accepted at their neutral values only, which clients send."""

    lora_path: str | list[str | None] | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    return_hidden_states: Annotated[bool | None, unsupported(None, False)] = None
    session_params: Annotated[Any, unsupported(None)] = None
    custom_logit_processor: Annotated[Any, unsupported(None)] = None
    bootstrap_host: Annotated[Any, unsupported(None)] = None
    bootstrap_port: Annotated[Any, unsupported(None)] = None
    bootstrap_room: Annotated[Any, unsupported(None)] = None
    data_parallel_rank: Annotated[Any, unsupported(None)] = None
    routed_dp_rank: Annotated[Any, unsupported(None)] = None
    disagg_prefill_dp_rank: Annotated[Any, unsupported(None)] = None
    session_id: Annotated[Any, unsupported(None)] = None
    priority: Annotated[Any, unsupported(None)] = None
    custom_labels: Annotated[Any, unsupported(None, {})] = None
    images_config: Annotated[Any, unsupported(None, {})] = None
    max_dynamic_patch: Annotated[Any, unsupported(None)] = None
    min_dynamic_patch: Annotated[Any, unsupported(None)] = None
    use_audio_in_video: Annotated[bool | None, unsupported(None, False)] = None
    return_prompt_token_ids: Annotated[bool | None, unsupported(None, False)] = None

    def cache_namespace(self) -> str:
        return cache_namespace(self.cache_salt, self.extra_key)


def cache_namespace(cache_salt: str | None, extra_key: str | None = None) -> str:
    """The prefix-cache namespace vLLM's cache_salt and SGLang's extra_key ask for ("": the shared one): the same
    on every route, so that requests share cached KV exactly when they give the same ones."""
    if not (cache_salt or extra_key):
        return ""
    return json.dumps([cache_salt or "", extra_key or ""])


class SGLangGenerateFields(SGLangServerFields):
    """The rest of SGLang's GenerateReqInput that flatwire does not have (other modalities, disaggregation,
    entropy and sampling masks, thinking budgets, tracing): accepted at their neutral values only."""

    video_data: NoMedia = None
    audio_data: NoMedia = None
    mm_hashes: NoMedia = None
    mm_content_hashes: NoMedia = None
    video_config: Annotated[Any, unsupported(None, {})] = None
    image_max_dynamic_patch: Annotated[Any, unsupported(None)] = None
    video_max_dynamic_patch: Annotated[Any, unsupported(None)] = None
    positional_embed_overrides: Annotated[Any, unsupported(None)] = None
    multi_item_delimiter_indices: Annotated[Any, unsupported(None)] = None
    return_sampling_mask: Annotated[Any, unsupported(None, False)] = None
    return_indexer_topk: Annotated[bool | None, unsupported(None, False)] = None
    return_entropy: Annotated[bool | None, unsupported(None, False)] = None
    return_bytes: Annotated[bool | None, unsupported(None, False)] = None
    bootstrap_pair_key: Annotated[Any, unsupported(None)] = None
    decode_tp_size: Annotated[Any, unsupported(None)] = None
    kv_router_hint: Annotated[Any, unsupported(None)] = None
    background: Annotated[bool | None, unsupported(None, False)] = None
    require_reasoning: Annotated[bool | None, unsupported(None, False)] = None
    max_thinking_tokens: Annotated[Any, unsupported(None)] = None
    conversation_id: Annotated[Any, unsupported(None)] = None
    external_trace_header: Annotated[Any, unsupported(None)] = None


class GenerateRequest(SGLangGenerateFields):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # One object for every prompt of a batch, or one per prompt.
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] = Field(default_factory=SGLangSamplingParams)
    # The logprob fields: one value for every prompt of a batch, or a list of one per prompt (SGLang's).
    return_logprob: bool | list[bool] = False
    # First prompt position with logprobs; -1: output logprobs only.
    logprob_start_len: Annotated[int, Field(ge=-1)] | list[Annotated[int, Field(ge=-1)]] = -1
    top_logprobs_num: Annotated[int, Field(ge=0)] | list[Annotated[int, Field(ge=0)]] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    # Of the output logprobs (vLLM's names, and SGLang's); absent: SGLang's, or raw with --return-original-logprob.
    logprobs_mode: LogprobsModeName | None = None
    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False  # prompt side as flat arrays instead of nested rows
    return_flat_raw_output_top_logprobs: bool = False  # output side likewise
    return_flat_raw_top_logprobs_b64: bool = False  # the flat arrays as base64 of <f4 / <i4 bytes
    stream: bool = False
    # The request's id (meta_info.id, /abort_request's rid): one per prompt of a batch; default: a fresh uuid.
    rid: str | list[str] | None = None
    n: Annotated[int | None, unsupported(None, 1)] = None  # SGLang's top-level n: one sample per prompt here
    # MoE routing replay (SGLang's): meta_info.routed_experts, from a scheduler with --enable-return-routed-experts.
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0, le=INT32_MAX)  # the first position whose routing is returned
    image_data: NoMedia = None
    input_embeds: Annotated[Any, unsupported(None)] = None  # a prompt of its own: [] is an empty one, not none
    modalities: NoMedia = None  # of the media items: none
    lora_id: Annotated[Any, unsupported(None)] = None
    log_metrics: Annotated[bool | None, unsupported(None, True)] = None  # this server's metrics count every request
    # SGLang ignores it here; routers (smg, sglang-router) always send it: what it selects, http/context.py's
    # Gateway.model_named (absent, null or smg's "unknown": the served model).
    model: str | None = None
    routing_key: str | None = None  # SGLang's routing-key policy: routes as a session header does (routing.py)
    no_logs: bool = False  # flatwire logs no request's content, so this asks for what is so already

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_k(cls, value: int | list[int], info: ValidationInfo) -> int | list[int]:
        for k in value if isinstance(value, list) else [value]:
            check_top_k("top_logprobs_num", k, info)
        return value

    @field_validator("token_ids_logprob")
    @classmethod
    def _ids(cls, value: list[int] | list[list[int]] | None, info: ValidationInfo):
        for ids in (value if is_id_lists(value) else [value]) if value else []:
            check_token_ids(ids, info)
        return value

    @field_validator("input_ids")
    @classmethod
    def _input_ids(cls, value, info: ValidationInfo):
        rows = value if value and isinstance(value[0], list) else [value or []]
        for row in rows:
            check_token_ids(row, info)
        return value

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequest("text", "exactly one of text and input_ids must be given")
        if self.is_batch and self.batch_size == 0:
            raise InvalidRequest(self.prompt_field, "a batch must not be empty")
        if isinstance(self.sampling_params, list):
            if len(self.sampling_params) != self.batch_size:
                raise InvalidRequest("sampling_params", f"{len(self.sampling_params)} sampling_params for "
                                                       f"{self.batch_size} prompts")
            if len({options.n for options in self.sampling_params}) > 1:
                raise InvalidRequest("sampling_params", "sampling_params: every prompt's n must be the same")
        n = self.samples_per_prompt
        if n == 1:
            check_batch_size(self.prompt_field, self.batch_size, f"{self.batch_size} prompts", info)
        else:
            check_batch_size(f"{self.sampling_field(0)}.n", self.batch_size * n,
                             f"{self.batch_size} prompts x n={n}", info)
        self._check_rids()
        self._check_per_prompt()
        if isinstance(self.lora_path, list) and (not self.is_batch or len(self.lora_path) != self.batch_size):
            raise InvalidRequest("lora_path", f"lora_path: one adapter's name, or a list of one per prompt "
                                              f"({self.batch_size}{'' if self.is_batch else ': not a batch'})")
        if self.logprobs_mode is None:  # this API's default, the server's
            self.logprobs_mode = limits_of(info).sglang_logprobs.api_name  # type: ignore[assignment]
        if self.return_flat_raw_top_logprobs_b64 and not (
                self.return_flat_raw_top_logprobs or self.return_flat_raw_output_top_logprobs):
            raise InvalidRequest("return_flat_raw_top_logprobs_b64", "return_flat_raw_top_logprobs_b64 requires "
                                 "return_flat_raw_top_logprobs or return_flat_raw_output_top_logprobs")
        return self

    def _check_per_prompt(self) -> None:
        """A logprob field given per prompt has a value for each prompt of a batch."""
        for name in PER_PROMPT_FIELDS:
            if self._is_per_prompt(name) and (not self.is_batch or len(getattr(self, name)) != self.batch_size):
                raise InvalidRequest(name, f"{name}: one value for every prompt, or a list of one per prompt "
                                           f"({self.batch_size}{'' if self.is_batch else ': not a batch'})")

    def _is_per_prompt(self, name: str) -> bool:
        """Whether a logprob field holds a value per prompt (token_ids_logprob: a list of id lists)."""
        value = getattr(self, name)
        return is_id_lists(value) if name == "token_ids_logprob" else isinstance(value, list)

    def _per_prompt(self, name: str, i: int):
        """Prompt i's value of a logprob field."""
        return getattr(self, name)[i] if self._is_per_prompt(name) else getattr(self, name)

    def _check_rids(self) -> None:
        if self.rid is None:
            return
        if self.samples_per_prompt > 1:  # SGLang gives each sample an id of its own as well
            raise InvalidRequest("rid", "rid: not with n > 1, where each sample gets an id of its own")
        if isinstance(self.rid, list) and (not self.is_batch or len(self.rid) != self.batch_size):
            raise InvalidRequest("rid", f"rid: a string, or one id per prompt ({self.batch_size}"
                                        f"{'' if self.is_batch else ': not a batch'})")
        rids = [self._named(self.rid, i) for i in range(self.batch_size)]
        if self.rid == "" or not all(0 < len(rid) <= MAX_RID_LENGTH for rid in rids):
            raise InvalidRequest("rid", f"rid: each id must have 1 to {MAX_RID_LENGTH} characters")
        if len(set(rids)) != len(rids):
            raise InvalidRequest("rid", "rid: the ids of a batch must differ")

    def rid_for(self, i: int) -> str | None:
        """Prompt i's id: the client's, or for a batch named by one string, that string with "_i" (SGLang's)."""
        return None if self.rid is None else self._named(self.rid, i)

    def _named(self, rid: str | list[str], i: int) -> str:
        if isinstance(rid, list):
            return rid[i]
        return f"{rid}_{i}" if self.is_batch else rid

    @property
    def prompt_field(self) -> str:
        return "text" if self.text is not None else "input_ids"

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return self.input_ids is not None and is_id_lists(self.input_ids)

    @property
    def batch_size(self) -> int:
        return len(self.prompts())

    @property
    def samples_per_prompt(self) -> int:
        """sampling_params.n (the same for every prompt)."""
        return self.sampling_for(0).n

    @property
    def returns_list(self) -> bool:
        """Whether the response is a list: one result per prompt and sample, prompt-major (SGLang's order)."""
        return self.is_batch or self.samples_per_prompt > 1

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list (one entry when not a batch)."""
        if self.text is not None:
            return self.text if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None  # the validator requires text or input_ids
        return self.input_ids if is_id_lists(self.input_ids) else [self.input_ids]

    def sampling_for(self, i: int) -> SGLangSamplingParams:
        return self.sampling_params[i] if isinstance(self.sampling_params, list) else self.sampling_params

    def sampling_field(self, i: int) -> str:
        """What the client calls prompt i's sampling options."""
        return f"sampling_params[{i}]" if isinstance(self.sampling_params, list) else "sampling_params"

    def scheduler_fields(self, i: int) -> dict[str, str]:
        """The scheduler's field names -> this request's, for prompt i (GenerateInput.fields): a logprob field given
        per prompt is named with its index."""
        per_prompt = {f"logprob.{name}": f"{name}[{i}]" for name in PER_PROMPT_FIELDS if self._is_per_prompt(name)}
        lora = f"lora_path[{i}]" if isinstance(self.lora_path, list) else "lora_path"
        return {"input_ids": self.prompt_field, "sampling": self.sampling_field(i), "logprob": "", "lora_name": lora,
                **per_prompt,
                "return_top_p_token_ids": f"{self.sampling_field(i)}.custom_params.return_top_p_token_ids"}

    def prompt(self, i: int) -> PromptRequest:
        """Prompt i, for the intake."""
        options = self.sampling_for(i)
        return PromptRequest(sampling=options, max_new_tokens=options.requested_max_new_tokens,
                             default_max_new_tokens=DEFAULT_SAMPLING.max_new_tokens,
                             detokenize=options.detokenize(options.min_new_tokens), logprob=self.logprob(i),
                             fields=self.scheduler_fields(i), stream=self.stream, rid=self.rid_for(i),
                             return_routed_experts=self.return_routed_experts,
                             routed_experts_start_len=self.routed_experts_start_len,
                             return_top_p_token_ids=options.return_top_p_token_ids,
                             lora_name=self.lora_for(i), cache_namespace=self.cache_namespace())

    def lora_for(self, i: int) -> str:
        """Prompt i's LoRA adapter ("": the base model)."""
        return (self.lora_path[i] if isinstance(self.lora_path, list) else self.lora_path) or ""

    @property
    def any_logprob(self) -> bool:
        """Whether some prompt asks for logprobs."""
        return any(self.return_logprob) if isinstance(self.return_logprob, list) else self.return_logprob

    def logprob(self, i: int) -> LogprobParams:
        """Prompt i's logprob parameters."""
        if not self._per_prompt("return_logprob", i):
            return LogprobParams(logprob_start_len=-1)
        return LogprobParams(
            return_logprob=True, top_logprobs_num=self._per_prompt("top_logprobs_num", i),
            logprob_start_len=self._per_prompt("logprob_start_len", i),
            token_ids_logprob=self._per_prompt("token_ids_logprob", i) or [],
            logprobs_mode=logprobs_mode(self.logprobs_mode))
