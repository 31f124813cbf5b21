"""Decoding many id sequences in one call.

transformers' batch_decode wraps the Rust tokenizer in per-sequence Python that
costs as much as the decoding itself; where that wrapper would change nothing (a
fast tokenizer with no clean-up of tokenization spaces; fast tokenizers ignore
spaces_between_special_tokens), the Rust tokenizer's decode_batch is called directly.
"""

from collections.abc import Callable

BatchDecode = Callable[[list[list[int]], bool, bool], list[str]]


def batch_decoder(tokenizer) -> BatchDecode:
    """f(sequences, skip_special_tokens, spaces_between_special_tokens) -> texts."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is not None and hasattr(backend, "decode_batch")
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return lambda sequences, skip, spaces: backend.decode_batch(sequences, skip_special_tokens=skip)
    return lambda sequences, skip, spaces: tokenizer.batch_decode(
        sequences, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
