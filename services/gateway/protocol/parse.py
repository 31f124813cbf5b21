"""Body bytes -> a validated request model, or an InvalidRequest naming the field.

Validation that depends on the served model (vocabulary size, the largest top-k) or on
the gateway's limits (sub-requests per HTTP request) reads a ModelLimits passed as
pydantic validation context.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

import orjson
from flatwire_wire.logprobs import LogprobsMode
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

M = TypeVar("M", bound=BaseModel)
# A request's `logprobs_mode` (vLLM's names and SGLang's; absent: its API's default, ModelLimits.sglang_logprobs on
# /generate and the public gRPC API, the scheduler's --logprobs-mode on the OpenAI routes).
LogprobsModeName = Literal["raw_logprobs", "processed_logprobs", "sglang_logprobs"]


class RequestModel(BaseModel):
    """A request body's top-level object (and SGLang's sampling_params): a field it does not declare is refused
    with 400 naming it, as OpenAI refuses one, never taken and ignored (a misspelt max_tokens would otherwise
    run to the default length). The fields SGLang and OpenAI define that flatwire cannot honour are declared,
    accepted at their neutral values only (sampling.unsupported)."""

    model_config = ConfigDict(extra="forbid")


class InvalidRequest(Exception):
    """A request the gateway refuses before submitting it; `param` names the offending field."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status
        self.code = code


def rename_field(param: str | None, message: str, names: dict[str, str]) -> tuple[str | None, str]:
    """(param, message) with the field named as the client's API names it. `names` maps a field or a
    prefix of fields to the client's name for it ("" drops the prefix): under {"sampling": ""},
    "sampling.top_p: must be in (0, 1]" becomes "top_p: must be in (0, 1]". The longest match wins."""
    if not param:
        return param, message
    for old in sorted(names, key=len, reverse=True):
        if param == old or param.startswith((old + ".", old + "[")):
            new = names[old]
            rest = param[len(old):]
            client = new + rest if new or not rest.startswith(".") else rest[1:]
            if message.startswith(param):
                message = client + message[len(param):]
            return client, message
    return param, message


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int
    max_top_logprobs: int
    max_batch_size: int  # sub-requests (generations) one HTTP request may ask for
    # The gateway's request limits (protocol/cost.py), GatewayConfig's defaults.
    max_stop_strings: int = 32
    max_stop_length: int = 256  # characters
    max_logprob_elements: int = 4 * 1024 * 1024  # positions x (top-k + ids), over a request's generations
    # The output logprobs of a /generate or public gRPC request that names no logprobs_mode: SGLang's, or the
    # model's own with the gateway's --return-original-logprob.
    sglang_logprobs: LogprobsMode = LogprobsMode.SGLANG


def model_limits(model_info, config) -> ModelLimits:
    """The limits every API checks requests against (HTTP and the public gRPC API alike), from the
    scheduler's ModelInfo and the GatewayConfig."""
    return ModelLimits(vocab_size=model_info.vocab_size, max_context=model_info.max_context,
                       max_top_logprobs=model_info.max_top_logprobs, max_batch_size=config.max_batch_size,
                       max_stop_strings=config.max_stop_strings, max_stop_length=config.max_stop_length,
                       max_logprob_elements=config.max_logprob_elements,
                       sglang_logprobs=LogprobsMode.RAW if config.return_original_logprob else LogprobsMode.SGLANG)


def limits_of(info: ValidationInfo) -> ModelLimits:
    context = info.context
    assert context is not None  # parse_data always validates with the limits as context
    return context["limits"]


def check_top_k(name: str, k: int, info: ValidationInfo) -> int:
    limit = limits_of(info).max_top_logprobs
    if k > limit:
        raise ValueError(f"{name}={k} exceeds this server's maximum of {limit}")
    return k


def check_vllm_top_k(name: str, k: int, info: ValidationInfo) -> int:
    """vLLM's logprobs and prompt_logprobs: a top-k, or -1 for the whole vocabulary (where the server's maximum
    allows that many)."""
    if k == -1:
        vocab, limit = limits_of(info).vocab_size, limits_of(info).max_top_logprobs
        if vocab > limit:
            raise ValueError(f"-1 (the whole vocabulary: {vocab} per position) exceeds this server's maximum "
                             f"of {limit}")
        return k
    return check_top_k(name, k, info)


def check_batch_size(param: str, count: int, what: str, info: ValidationInfo) -> None:
    """Refuse a request of more than max_batch_size sub-requests; `what` says how they were counted."""
    limit = limits_of(info).max_batch_size
    if count > limit:
        raise InvalidRequest(param, f"{param}: {what} make {count} sub-requests; this server's maximum "
                                    f"(max_batch_size) is {limit}")


def check_token_ids(ids: list[int], info: ValidationInfo) -> list[int]:
    vocab = limits_of(info).vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab})")
    return ids


def is_id_lists(items: Sequence[object]) -> "TypeIs[list[list[int]]]":
    """Token ids given as a list of lists rather than one list (an empty list is one list, of no ids)."""
    return bool(items) and isinstance(items[0], list)


def is_token_ids(items: Sequence[object]) -> "TypeIs[list[int]]":
    """A prompt given as one (non-empty) list of token ids, not as texts or lists of ids."""
    return bool(items) and isinstance(items[0], int)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_branch_tag(part: str | int) -> bool:
    """A union branch's name in an error's location ("int", "list[int]", "constrained-int", a model's name),
    never a field's (a Python name)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def _location(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; drops pydantic's union-branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_branch_tag(part):
            out += f".{part}" if out else part
    return out


def _reach(error) -> tuple[int, tuple[int, ...]]:
    """How far into the input an error got: its depth, then its list positions. Of a union's branches, the
    one that matched the input's shape gets furthest (a list of sampling_params fails at an element's field,
    the dict branch at the list itself), so its error is the one that names what is wrong."""
    parts = [part for part in error["loc"] if not _is_branch_tag(part)]
    return len(parts), tuple(part for part in parts if isinstance(part, int))


def parse_body(model: type[M], body: bytes, limits: ModelLimits) -> M:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest("body", f"malformed JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("body", "the request body must be a JSON object")
    return parse_data(model, data, limits)


# vLLM's own request fields, which neither SGLang's nor OpenAI's APIs have: refused as what they are (not as a
# misspelling) where a route does not take them, naming this server's way to ask for the same where it has one.
# (Chat and completions take prompt_logprobs, include_stop_str_in_output and return_token_ids, as vLLM's.)
VLLM_FIELDS = {
    "include_stop_str_in_output": "no_stop_trim", "guided_json": "response_format or json_schema",
    "guided_regex": "regex", "guided_choice": "regex", "guided_grammar": "ebnf",
    "structured_outputs": "response_format, json_schema, regex or ebnf", "allowed_token_ids": "logit_bias",
    "prompt_logprobs": "logprob_start_len (chat and completions take prompt_logprobs)",
    **dict.fromkeys(("bad_words", "use_beam_search", "length_penalty", "truncate_prompt_tokens",
                     "add_generation_prompt", "add_special_tokens", "chat_template", "documents", "request_id",
                     "mm_processor_kwargs", "guided_decoding_backend"), ""),
}


def _unrecognized(field: object) -> str:
    if not isinstance(field, str) or field not in VLLM_FIELDS:
        return "unrecognized field"
    instead = VLLM_FIELDS[field]
    return "vLLM's field, not supported by this server" + (f"; use {instead}" if instead else "")


def parse_data(model: type[M], data: dict, limits: ModelLimits) -> M:
    """A decoded body (or the public gRPC request's fields: protocol/public.py) -> the validated model."""
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as exc:
        # Without the input and the context (the validator's exception): those would make a reference cycle
        # (exception -> traceback -> this frame -> `first` -> exception) that keeps a rejected 20 MB body
        # alive until the cyclic garbage collector runs.
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        error = max(errors, key=_reach)  # the first of the furthest
        param = _location(error["loc"]) or None
        message = (_unrecognized(error["loc"][-1]) if error["type"] == "extra_forbidden"
                   else error["msg"].removeprefix("Value error, "))
        raise InvalidRequest(param, f"{param}: {message}" if param else message) from None


def logprobs_mode(name: LogprobsModeName | None, default: LogprobsMode = LogprobsMode.UNSPECIFIED) -> LogprobsMode:
    """The mode a request names; `default` when it names none."""
    return default if name is None else LogprobsMode.named(name)
