"""Decoding many id sequences in one call.

transformers' batch_decode wraps the Rust tokenizer in per-sequence Python that
costs as much as the decoding itself; where that wrapper would change nothing (a
fast tokenizer with no clean-up of tokenization spaces; fast tokenizers ignore
spaces_between_special_tokens), the Rust tokenizer's decode_batch is called directly.
A checkpoint whose tokenizer.json decodes so is loaded by the `tokenizers` library
alone (load_batch_decoder): the detokenizer then starts without importing transformers
(and torch) or building its tokenizer, a restart in a second rather than several.
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenizers import Tokenizer

BatchDecode = Callable[[list[list[int]], bool, bool], list[str]]
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def load_batch_decoder(model_dir: Path) -> BatchDecode:
    """The checkpoint's batch decoder: its tokenizer.json alone where that decodes as its transformers tokenizer
    would (see _rust_tokenizer), else that tokenizer's."""
    backend = _rust_tokenizer(model_dir)
    if backend is not None:
        return lambda sequences, skip, spaces: backend.decode_batch(sequences, skip_special_tokens=skip)
    from transformers import AutoTokenizer  # seconds: it imports torch

    return batch_decoder(AutoTokenizer.from_pretrained(model_dir))


def _rust_tokenizer(model_dir: Path) -> Tokenizer | None:
    """tokenizer.json, if decoding with it alone is what transformers does: tokenizer_config.json turns the
    clean-up of tokenization spaces off, and every token it calls special is special in tokenizer.json too."""
    config_file, tokenizer_file = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    config = json.loads(config_file.read_text())
    if config.get("clean_up_tokenization_spaces") is not False:
        return None
    backend = Tokenizer.from_file(str(tokenizer_file))
    special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    return backend if set(_special_tokens(config)) <= special else None


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
