"""Refusing a text prompt that cannot fit the context, before tokenizing it.

Tokenizing 20 MB of text takes the gateway tens of seconds and GBs of memory (millions of
token strings, offsets and Python ints) only to find that the prompt has millions of
tokens where the context holds 4096. A cheap characters-per-token guess would refuse
legitimate prompts (a token can cover 128 bytes: a run of spaces), so the bound here is
one that cannot be wrong: with a byte-level BPE tokenizer every token stands for at most
M bytes of the (normalized) text, M being its longest vocabulary entry or added token,
so a text of B bytes has at least B / M tokens. Normalizers that may shrink the text
(NFC, lowercasing, ...) divide that by how much they can; a tokenizer whose pipeline can
drop text (whitespace splitting, accent stripping, an unknown-token model that swallows
whole words) gets no bound, and its prompts are tokenized and checked after.

For the default model (byte-level BPE, no normalizer, M = 128) a 4096-token context
refuses any text over 512 KiB without tokenizing it.
"""

import json
import threading

from services.gateway.protocol.parse import InvalidRequest

# How many bytes of text a normalizer may turn into one (a 4-byte character into a 1-byte one).
_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1, "Append": 1, "ByteLevel": 1}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}

_cache: dict[int, tuple[object, int | None]] = {}  # id(tokenizer) -> (tokenizer, bound)
_lock = threading.Lock()


def _shrink(normalizer: dict | None) -> int | None:
    """How many times shorter (in UTF-8 bytes) the normalizer can make a text; None: unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type", "")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            shrink = _shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        if pattern is None or not content:  # a regex may match any length; nothing for content drops text
            return None
        return max(1, -(-len(pattern.encode()) // len(content.encode())))
    return _SHRINK.get(kind)


def _pre_tokenizer_keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(part) for part in pre.get("pretokenizers", []))
    return kind in _SAFE_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _has_byte_level(pre: dict | None) -> bool:
    parts = [pre or {}]
    while parts:
        part = parts.pop()
        if part.get("type") == "ByteLevel":
            return True
        parts += part.get("pretokenizers", [])
    return False


def _spec(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def max_bytes_per_token(tokenizer) -> int | None:
    """Most bytes of input text one token can stand for, when the tokenizer lets that be known; else None.
    The returned value already includes the normalizer's shrink factor."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pre = _spec(backend.pre_tokenizer)
    byte_level = _has_byte_level(pre)
    model = backend.model
    if type(model).__name__ != "BPE" or not (byte_level or getattr(model, "byte_fallback", False)):
        return None  # an unknown token may stand for any amount of text
    shrink = _shrink(_spec(backend.normalizer))
    if shrink is None or not _pre_tokenizer_keeps_text(pre):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    # A byte-level token spells each byte as one character; otherwise count the UTF-8 of its text.
    longest = max((len(token) if byte_level else len(token.encode()) for token in vocab), default=1)
    added = max((len(token.content.encode()) for token in backend.get_added_tokens_decoder().values()), default=1)
    return max(longest, added, 1) * shrink


def bytes_per_token(tokenizer) -> int | None:
    """max_bytes_per_token, computed once per tokenizer (a pass over its vocabulary: 0.2 s for 250k entries)."""
    with _lock:
        cached = _cache.get(id(tokenizer))
        if cached is None or cached[0] is not tokenizer:
            cached = _cache[id(tokenizer)] = (tokenizer, max_bytes_per_token(tokenizer))
        return cached[1]


def utf8_length_above(text: str, limit: int) -> int | None:
    """The text's UTF-8 length if it is above `limit`, else None."""
    if text.isascii():
        return len(text) if len(text) > limit else None
    if len(text) <= limit // 4:  # at most 4 bytes a character
        return None
    size = _utf8_len(text)
    return size if size > limit else None


def _utf8_len(text: str, chunk: int = 1 << 20) -> int:
    """UTF-8 length, a chunk at a time (no copy of a long text)."""
    return sum(len(text[i:i + chunk].encode("utf-8", "surrogatepass")) for i in range(0, len(text), chunk))


def check_prompt_text(tokenizer, text: str, max_context: int, field: str) -> None:
    """Refuse `text` (as `field`) when it has, for certain, more tokens than max_context holds.
    Cheap: no tokenization; at most a UTF-8 length count of a text that is already too long."""
    per_token = bytes_per_token(tokenizer)
    if per_token is None:
        return
    limit = max_context * per_token
    size = utf8_length_above(text, limit)
    if size is not None:
        at_least = -(-size // per_token)
        raise InvalidRequest(field, f"{field}: the prompt is {size} bytes of text, so at least {at_least} tokens "
                                    f"(a token of this model covers at most {per_token} bytes); this model's "
                                    f"context is {max_context}")
