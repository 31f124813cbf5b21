"""Prompts -> token ids (off the event loop), and the length checks SGLang makes."""

import asyncio

from services.gateway.protocol.openai import ChatMessage
from services.gateway.protocol.parse import InvalidRequest, ModelLimits


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts)["input_ids"]


async def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Tokenize in a worker thread: a long prompt must not stall other requests' streams."""
    return await asyncio.to_thread(_encode, tokenizer, texts)


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


async def encode_chat(tokenizer, messages: list[ChatMessage]) -> list[int]:
    try:
        return await asyncio.to_thread(_chat_ids, tokenizer, [m.template_dict() for m in messages])
    except Exception as exc:  # a template that rejects the conversation (roles out of order, ...)
        raise InvalidRequest("messages", f"messages: the chat template failed: {exc}") from None


def check_lengths(ids: list[int], limits: ModelLimits, prompt_field: str, max_new_tokens: int | None,
                  max_field: str) -> int:
    """The max_new_tokens to ask for: the requested one, or what the context leaves when None."""
    if not ids:
        raise InvalidRequest(prompt_field, f"{prompt_field}: the prompt is empty")
    room = limits.max_context - len(ids)
    if room <= 0:
        raise InvalidRequest(prompt_field, f"{prompt_field}: the prompt has {len(ids)} tokens; this model's "
                                           f"context is {limits.max_context}")
    if max_new_tokens is None:
        return room
    if max_new_tokens > room:
        raise InvalidRequest(max_field, f"{max_field}: {len(ids)} prompt tokens + {max_new_tokens} new tokens "
                                        f"exceed this model's context of {limits.max_context}")
    return max_new_tokens
