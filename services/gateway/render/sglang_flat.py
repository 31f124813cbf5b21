"""SGLang's flat top-k fields: the [rows, k] arrays as one flat list or base64 buffer.

`*_top_logprobs_shape` is the literal [rows, k] shape of the arrays; the
`*_top_logprobs_null_prefix` positions without logprobs precede them (position i, entry
j is at flat[(i - null_prefix) * k + j]). JSON lists write -inf as null; base64 carries
the little-endian float32 / int32 bytes as they are, -inf included.
"""

from typing import Any

import numpy as np
import orjson
import pybase64
from flatwire_wire.logprobs import F32, I32, RequestLogprobs

from services.gateway.render.pieces import json_values


def flat_top_logprobs(side: str, track: RequestLogprobs, b64: bool) -> dict:
    """The fields for side "input" (prompt) or "output"."""
    prefix = f"{side}_top_logprobs"
    fields: dict[str, Any]
    if b64:
        fields = {
            f"{prefix}_val_flat_b64": b64_text(track.topk_values, F32),
            f"{prefix}_idx_flat_b64": b64_text(track.topk_ids, I32),
            f"{prefix}_val_flat_b64_dtype": "float32",
            f"{prefix}_idx_flat_b64_dtype": "int32",
        }
    else:
        fields = {
            f"{prefix}_val_flat": json_values(track.topk_values),
            f"{prefix}_idx_flat": json_values(track.topk_ids),
        }
    fields[f"{prefix}_shape"] = list(track.topk_values.shape)
    fields[f"{prefix}_null_prefix"] = track.null_prefix
    return fields


def b64_text(values: np.ndarray, dtype: np.dtype) -> orjson.Fragment:
    """A JSON string of the standard base64 of the array's little-endian bytes, encoded
    from the array in place and embedded as is (no str round trip)."""
    # ndarray has the buffer protocol, but numpy declares __buffer__ only for Python >= 3.12
    encoded = pybase64.b64encode(np.ascontiguousarray(values, dtype=dtype))  # type: ignore[arg-type]
    return orjson.Fragment(b"".join((b'"', encoded, b'"')))
