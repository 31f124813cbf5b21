"""Decoding many id sequences in one call.

transformers' batch_decode wraps the Rust tokenizer in per-sequence Python that
costs as much as the decoding itself; where that wrapper would change nothing (a
fast tokenizer with no clean-up of tokenization spaces; fast tokenizers ignore
spaces_between_special_tokens), the Rust tokenizer's decode_batch is called directly.
A checkpoint whose tokenizer.json decodes so is loaded by the `tokenizers` library
alone (load_batch_decoder): the detokenizer then starts without importing transformers
(and torch) or building its tokenizer. It loads tokenizer.json without a BPE model's merges,
which decoding never reads and which are most of what loading costs (the default model's
500k: 1.2 s with them, 0.35 s without), from a copy kept in the cache directory: a restart
serves in half a second, not several.
"""

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
from tokenizers import Tokenizer

from services.common.cache_files import write_atomically

log = logging.getLogger("flatwire.detokenizer")

BatchDecode = Callable[[list[list[int]], bool, bool], list[str]]
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def load_batch_decoder(model_dir: Path, cache_dir: Path | None) -> BatchDecode:
    """The checkpoint's batch decoder: its tokenizer.json alone where that decodes as its transformers tokenizer
    would (see _rust_tokenizer), else that tokenizer's. `cache_dir`: where the decoding form of tokenizer.json
    is kept between starts (None: not kept)."""
    backend = _rust_tokenizer(model_dir, cache_dir)
    if backend is not None:
        return lambda sequences, skip, spaces: backend.decode_batch(sequences, skip_special_tokens=skip)
    from transformers import AutoTokenizer  # seconds: it imports torch

    return batch_decoder(AutoTokenizer.from_pretrained(model_dir))


def _rust_tokenizer(model_dir: Path, cache_dir: Path | None) -> Tokenizer | None:
    """tokenizer.json, if decoding with it alone is what transformers does: tokenizer_config.json turns the
    clean-up of tokenization spaces off, and every token it calls special is special in tokenizer.json too."""
    config_file, tokenizer_file = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    config = json.loads(config_file.read_text())
    if config.get("clean_up_tokenization_spaces") is not False:
        return None
    backend = _decoding_tokenizer(tokenizer_file, cache_dir)
    special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    return backend if set(_special_tokens(config)) <= special else None


def _decoding_tokenizer(tokenizer_file: Path, cache_dir: Path | None) -> Tokenizer:
    """tokenizer.json without a BPE model's merges (decoding maps ids to tokens; merges only encode), from
    `cache_dir`'s copy under tokenizer.json's digest, written there on first use."""
    content = tokenizer_file.read_bytes()
    kept = cache_dir / "decoding-tokenizers" / f"{hashlib.sha256(content).hexdigest()}.json" if cache_dir else None
    if kept is not None and kept.is_file():
        return Tokenizer.from_file(str(kept))
    parsed = orjson.loads(content)
    if parsed.get("model", {}).get("type") == "BPE":
        parsed["model"]["merges"] = []
    decoding = orjson.dumps(parsed)
    if kept is not None:
        try:
            write_atomically(kept, decoding)
        except OSError as exc:
            log.warning("could not keep the decoding tokenizer in %s (%s); the next start builds it again",
                        kept.parent, exc)
    return Tokenizer.from_str(decoding.decode())


def _special_tokens(config: dict) -> Iterator[str]:
    """The tokens tokenizer_config.json names special, in any of the forms transformers writes."""

    def content(token) -> str | None:
        return token if isinstance(token, str) else token.get("content") if isinstance(token, dict) else None

    named = [config.get(key) for key in SPECIAL_TOKEN_KEYS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        listed = config.get(key) or []
        named += list(listed.values()) if isinstance(listed, dict) else listed
    named += [token for token in (config.get("added_tokens_decoder") or {}).values()
              if isinstance(token, dict) and token.get("special")]
    yield from (text for token in named if (text := content(token)))


def batch_decoder(tokenizer) -> BatchDecode:
    """f(sequences, skip_special_tokens, spaces_between_special_tokens) -> texts."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is not None and hasattr(backend, "decode_batch")
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return lambda sequences, skip, spaces: backend.decode_batch(sequences, skip_special_tokens=skip)
    return lambda sequences, skip, spaces: tokenizer.batch_decode(
        sequences, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
