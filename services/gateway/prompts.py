"""Prompts -> token ids, off the event loop: texts (refused before they are tokenized when they cannot fit the
context), and a chat's messages through the model's chat template."""

import asyncio

from services.common.memory import BIG_REQUEST_BYTES, trim_soon
from services.gateway.prompt_bound import check_prompt_text
from services.gateway.protocol.chat import ChatMessage
from services.gateway.protocol.intake import prompt_too_long
from services.gateway.protocol.parse import InvalidRequest

ENCODE_GROUP_CHARS = 1 << 20  # texts tokenized in one call: the tokenizer's buffers for ~1 MB of text at a time


def encode_checked(tokenizer, texts: list[str], max_context: int | None = None, field: str = "text",
                   add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text, a group of texts at a time; with max_context, a text that cannot fit is
    refused before it is tokenized (prompt_bound.py), and the first prompt found too long ends the work.
    Blocking: call it in a worker thread."""
    if max_context is not None:
        for text in texts:
            check_prompt_text(tokenizer, text, max_context, field)
    ids: list[list[int]] = []
    start = 0
    try:
        while start < len(texts):
            end, chars = start + 1, len(texts[start])
            while end < len(texts) and chars + len(texts[end]) <= ENCODE_GROUP_CHARS:
                chars += len(texts[end])
                end += 1
            group = tokenizer(texts[start:end], add_special_tokens=add_special_tokens)["input_ids"]
            if max_context is not None:
                for prompt_ids in group:
                    if len(prompt_ids) >= max_context:
                        raise prompt_too_long(field, len(prompt_ids), max_context)
            ids += group
            start = end
    finally:
        if sum(map(len, texts)) >= BIG_REQUEST_BYTES:
            trim_soon()  # the tokenizer's per-token buffers are freed by now: hand them back
    return ids


async def encode_texts(tokenizer, texts: list[str], max_context: int | None = None,
                       field: str = "text") -> list[list[int]]:
    """Tokenize in a worker thread: a long prompt must not stall other requests' streams."""
    return await asyncio.to_thread(encode_checked, tokenizer, texts, max_context, field)


def _chat_ids(tokenizer, messages: list[dict], max_context: int | None, tools: list[dict] | None,
              template_kwargs: dict) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs)
    return encode_checked(tokenizer, [text], max_context, "messages", add_special_tokens=False)[0]


async def encode_chat(tokenizer, messages: list[ChatMessage], max_context: int | None = None,
                      tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The conversation through the model's chat template (with the tools, and the request's
    chat_template_kwargs as template variables), tokenized."""
    try:
        return await asyncio.to_thread(_chat_ids, tokenizer, [m.template_dict() for m in messages], max_context,
                                       tools, template_kwargs or {})
    except InvalidRequest:
        raise
    except Exception as exc:  # a template that rejects the conversation (roles out of order, ...)
        raise InvalidRequest("messages", f"messages: the chat template failed: {exc}") from None
