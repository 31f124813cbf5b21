"""Token id -> text and raw bytes for a whole vocabulary, built once per tokenizer.

Candidate text (SGLang's `[logprob, id, text]`, OpenAI's `token`) is what
`tokenizer.decode([id])` gives; OpenAI's `bytes` are the token's own bytes (half of a
UTF-8 character for a byte token), not the UTF-8 of its decoded text. Both are computed
for every id in one batched pass on first use, so rendering a response is array
indexing (`table.texts[ids]`), never a decode call per position. Nothing is built until
a format that needs text asks for it.
"""

import json
import threading
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

from services.common.tokenizer import load_tokenizer

# Byte-level BPE spells byte b as the character bytes_to_unicode()[b]; this undoes it.
_BYTE_LEVEL_TO_LATIN1 = str.maketrans({char: chr(byte) for byte, char in bytes_to_unicode().items()})


class TokenTable:
    """Per-id texts and bytes of one tokenizer, plus memoized tables derived from them."""

    def __init__(self, tokenizer, size: int | None = None):
        self.tokenizer = tokenizer
        # The model's vocabulary may be padded beyond the tokenizer's; those ids have
        # empty text and no bytes.
        self.size = max(len(tokenizer), size or 0)
        self._lock = threading.RLock()
        self._memo: dict[str, Any] = {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "TokenTable":
        config = Path(model_dir) / "config.json"
        size = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
        return cls(load_tokenizer(model_dir), size)

    def memo(self, key: str, build: Callable[["TokenTable"], Any]) -> Any:
        """build(self), computed once per table (renderers keep their per-id JSON pieces here)."""
        with self._lock:
            if key not in self._memo:
                self._memo[key] = build(self)
            return self._memo[key]

    @cached_property
    def texts(self) -> np.ndarray:
        """[size] object array of str: decode([id]) for every id."""
        with self._lock:
            return _as_objects(_decode_each(self.tokenizer, self.size))

    @cached_property
    def token_bytes(self) -> np.ndarray:
        """[size] object array of bytes: each token's own bytes."""
        with self._lock:
            return _as_objects(_raw_bytes(self.tokenizer, self.size))

    @cached_property
    def text_lengths(self) -> np.ndarray:
        """[size] int64: len() of each text, for OpenAI completions' text_offset."""
        return np.fromiter(map(len, self.texts), dtype=np.int64, count=self.size)


def _as_objects(values: list) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _decode_each(tokenizer, size: int) -> list[str]:
    singles = [[i] for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        texts = tokenizer.batch_decode(singles)
    else:
        # The Rust batch decode, parallel and ~4x faster than batch_decode's Python
        # wrapper; decode() adds only the optional space clean-up on top of it.
        texts = backend.decode_batch(singles, skip_special_tokens=False)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            texts = list(map(tokenizer.clean_up_tokenization, texts))
    return texts + [""] * (size - len(texts))


def _raw_bytes(tokenizer, size: int) -> list[bytes]:
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
    spell = _byte_level_bytes if byte_level else _sentencepiece_bytes
    out = [b"" if token is None else spell(token) for token in tokens]
    # Added tokens (specials included) are stored as their literal text.
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id < len(out):
            out[token_id] = added.content.encode()
    return out + [b""] * (size - len(out))


def _byte_level_bytes(token: str) -> bytes:
    try:
        return token.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte alphabet: not a byte token
        return token.encode()


def _sentencepiece_bytes(token: str) -> bytes:
    # Byte-fallback pieces are spelled <0xHH>; "▁" stands for a space.
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode()
