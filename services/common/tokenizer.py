"""A checkpoint's transformers tokenizer, loaded without importing torch where its class allows.

transformers' AutoTokenizer module imports the model configuration machinery, which imports torch: about 2 s
and 200 MB of every gateway's start, in a process that never runs a tensor. A checkpoint whose
tokenizer_config.json names the generic fast tokenizer (the default model's does) gets that class directly,
which is what AutoTokenizer would build for it; any other class goes through AutoTokenizer, which knows the
model-specific ones.
"""

import json
from pathlib import Path

# The names transformers gives its generic Rust-backed tokenizer (PreTrainedTokenizerFast is an alias since v5).
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(model_dir: str | Path):
    """The tokenizer AutoTokenizer.from_pretrained(model_dir) gives."""
    config = Path(model_dir) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in GENERIC_CLASSES:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_dir)
    from transformers import AutoTokenizer  # seconds: it imports torch

    return AutoTokenizer.from_pretrained(model_dir)
