"""Attention over one flattened, unpadded batch, plugged into transformers.

Every step runs the model once on a single sequence [1, T] holding all scheduled
tokens: one token per decoding request first, then the whole prompt of each newly
admitted request. Registered in transformers' AttentionInterface as "flatwire", the
function below receives each layer's new queries/keys/values plus this step's
`FlatBatch` (a forward kwarg that transformers hands down to attention), stores the
new keys/values in the request slots, and attends:
- decode tokens: one batched SDPA over their slots' cached keys/values, masked to
  each request's length;
- prompts: causal SDPA per prompt over its own keys/values.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from services.scheduler.model.kv_cache import SlotKVCache

ATTENTION_NAME = "flatwire"


@dataclass
class FlatBatch:
    """Where each row of the flat sequence belongs."""

    cache: SlotKVCache
    slots: torch.Tensor  # [T] KV slot of each token
    positions: torch.Tensor  # [T] position of each token in its request
    num_decode: int  # rows [0, num_decode) are single decode tokens
    decode_slots: torch.Tensor  # [num_decode]
    decode_mask: torch.Tensor  # [num_decode, 1, 1, longest] True where a cached key is visible
    prefill_spans: list[tuple[int, int]]  # (first row, length) of each prompt


def flat_batch_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         flat_batch: FlatBatch | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    batch = flat_batch
    assert batch is not None  # the model runner passes flat_batch to every forward
    keys = batch.cache.keys[module.layer_idx]
    values = batch.cache.values[module.layer_idx]
    # Advanced indices on dims 0 and 2 put the token dim first: [T, Hkv, D].
    keys[batch.slots, :, batch.positions] = key[0].transpose(0, 1)
    values[batch.slots, :, batch.positions] = value[0].transpose(0, 1)

    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    n = batch.num_decode
    if n:
        longest = batch.decode_mask.shape[-1]
        decode_out = F.scaled_dot_product_attention(
            query[0, :, :n].transpose(0, 1).unsqueeze(2),  # [n, H, 1, D]
            keys[batch.decode_slots, :, :longest],
            values[batch.decode_slots, :, :longest],
            attn_mask=batch.decode_mask, scale=scaling, enable_gqa=True)
        out[:n] = decode_out.squeeze(2)
    for first, length in batch.prefill_spans:
        span = slice(first, first + length)
        prompt_out = F.scaled_dot_product_attention(
            query[:, :, span], key[:, :, span], value[:, :, span], is_causal=True, scale=scaling, enable_gqa=True)
        out[span] = prompt_out[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, flat_batch_attention)
