"""Body bytes -> a validated request model, or an InvalidRequest naming the field.

Validation that depends on the served model (vocabulary size, the largest top-k) or on
the gateway's limits (sub-requests per HTTP request) reads a ModelLimits passed as
pydantic validation context.
"""

from dataclasses import dataclass
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError, ValidationInfo

M = TypeVar("M", bound=BaseModel)


class InvalidRequest(Exception):
    """A request the gateway refuses before submitting it; `param` names the offending field."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int
    max_top_logprobs: int
    max_batch_size: int  # sub-requests (generations) one HTTP request may ask for


def limits_of(info: ValidationInfo) -> ModelLimits:
    return info.context["limits"]


def check_top_k(name: str, k: int, info: ValidationInfo) -> int:
    limit = limits_of(info).max_top_logprobs
    if k > limit:
        raise ValueError(f"{name}={k} exceeds this server's maximum of {limit}")
    return k


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


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _location(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; drops pydantic's union-branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper():
            continue
        else:
            out += f".{part}" if out else part
    return out


def parse_body(model: type[M], body: bytes, limits: ModelLimits) -> M:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest("body", f"malformed JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("body", "the request body must be a JSON object")
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _location(first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidRequest(param, f"{param}: {message}" if param else message) from None
