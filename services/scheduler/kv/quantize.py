"""How the KV memory stores what attention computes (--kv-cache-dtype): in the model's compute dtype (`auto`), or
in 8-bit floats (`fp8_e4m3`, `fp8_e5m2`, SGLang's names for torch.float8_e4m3fn and torch.float8_e5m2): half the
bytes of bfloat16, a quarter of float32.

An 8-bit pool keeps each layer's keys divided by the layer's key scale and its values by its value scale (one float
each, per tensor as SGLang takes them: a checkpoint's k_scale and v_scale, model/kv_scales.py, else 1.0), clamped
to the format's finite range and cast; a read widens to the compute dtype and multiplies by the scale. Every write
goes through `quantize` (KVPool.write) and every read of the torch path through `widen`; the Triton kernel widens
its tiles as it loads them and applies the scales to the scores and to its output (model/triton_attention.py),
the same products. A spec of either kind (kv/specs.py) is stored alike: an MLA layer's one tensor, its latent and
rope key, over the layer's key scale (model/mla.py).
"""

from dataclasses import dataclass

import torch

FLOAT8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # --kv-cache-dtype's 8-bit values


def storage_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    """What the KV memory's tensors hold: --kv-cache-dtype's format, or `compute` for auto."""
    return compute if kv_cache_dtype == "auto" else FLOAT8[kv_cache_dtype]


def is_float8(dtype: torch.dtype) -> bool:
    return dtype in FLOAT8.values()


@dataclass(frozen=True)
class KVScales:
    """One layer's per-tensor scales: its stored keys (an MLA layer's latent) and values are these times what its
    tensors hold."""

    key: float = 1.0
    value: float = 1.0


UNSCALED = KVScales()  # a pool in the compute dtype, or a checkpoint without scales


def quantize(new: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`new` as a pool of `dtype` stores it. The clamp: a cast of what lies past the format's largest finite value
    gives inf (e5m2) or NaN, and either would poison every softmax that reads it."""
    if not is_float8(dtype):
        return new.to(dtype)
    largest = torch.finfo(dtype).max
    return (new.float() / scale).clamp_(-largest, largest).to(dtype)


def widen(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What `stored` holds, in the compute `dtype` (every 8-bit value is exact there) times its scale."""
    widened = stored.to(dtype)
    return widened if scale == 1.0 else widened * scale


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An 8-bit float tensor as uint8 over the same memory (any other as it is): indexing kernels that a device
    lacks for float8 (index_select, index_put) run on the bytes, as SGLang's pools store float8 for that reason."""
    return tensor.view(torch.uint8) if is_float8(tensor.dtype) else tensor
