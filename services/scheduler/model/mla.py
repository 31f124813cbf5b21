"""Multi-head latent attention (DeepSeek V3, Kimi K2) over the paged KV memory, with the latent cached.

transformers' DeepseekV3Attention compresses each token's keys and values into a latent c (kv_lora_rank wide,
after its norm) and a rope key k_r shared by every head, then decompresses c into per-head keys and values
(kv_b_proj) before attending. The KV memory keeps [c, k_r] per token and layer (kv/specs.py:MLASpec: 576 values
for DeepSeek V3 instead of 128 heads x (192 + 128)), and attention absorbs the decompression into the query and
the output instead of decompressing the context (SGLang's and vLLM's MLA backends): with kv_b_proj's rows split
per head into W_k [nope, c] and W_v [v, c],

    q_nope . (W_k c) + q_r . k_r = (W_k^T q_nope) . c + q_r . k_r,   and   softmax(...) (W_v c) = W_v (softmax(...) c),

so every head attends to the one shared [c, k_r] (multi-query attention with keys of c + rope width and values c),
and W_v turns each head's attended latent into its value. The same arithmetic as transformers' forward in another
order: equal to it within float rounding.

`use_latent_cache(model)` swaps in this forward for every such layer; the step's PagedBatch reaches it as a forward
kwarg, as it reaches model/attention.py. An 8-bit pool (--kv-cache-dtype) keeps [c, k_r] over the layer's k_scale,
written and read as every other layer's (kv/quantize.py).
"""

import types

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from services.scheduler.kv.quantize import KVScales
from services.scheduler.model.attention import PagedBatch


def is_latent_attention(module: nn.Module) -> bool:
    return hasattr(module, "kv_lora_rank") and hasattr(module, "kv_b_proj") and hasattr(module, "expand_kv")


def use_latent_cache(model: nn.Module) -> int:
    """Route every MLA layer's attention through the latent cache; how many layers that is."""
    layers = [module for module in model.modules() if is_latent_attention(module)]
    for module in layers:
        module.forward = types.MethodType(latent_attention, module)
    return len(layers)


def latent_attention(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                     attention_mask=None, paged_batch: PagedBatch | None = None, **kwargs):
    """DeepseekV3Attention.forward over the step's flat batch [1, T, hidden]: the latent of each new token into its
    page, then each head's query against the cached latents (absorbed, see the module docstring)."""
    assert paged_batch is not None  # the model runner passes paged_batch to every forward
    hidden = hidden_states[0]  # [T, hidden]
    tokens = hidden.shape[0]
    nope, rope, latent = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    if self.q_lora_rank is None:
        q_states = self.q_proj(hidden)
    else:
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
    q_pass, q_rot = torch.split(q_states.view(tokens, -1, nope + rope), [nope, rope], dim=-1)  # [T, H, .]
    kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden), [latent, rope], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope)
    cos, sin = position_embeddings  # [1, T, rope]
    rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot.transpose(0, 1).unsqueeze(0), k_rot.view(1, 1, tokens, rope), cos, sin)
    q_rot, k_rot = q_rot[0].transpose(0, 1), k_rot[0, 0]  # [T, H, rope], [T, rope]

    pool = paged_batch.pool
    step = paged_batch.groups[pool.group_of[self.layer_idx]]
    entry = torch.cat([kv_nope, k_rot], dim=-1)[:, None]  # [T, 1, latent + rope]
    pool.write(self.layer_idx, step.write_pages, paged_batch.write_offsets, entry)
    cache = pool.keys(self.layer_idx)  # [pages, page_size, 1, latent + rope]
    scale = pool.scales[self.layer_idx].key  # of the one tensor the keys and the values are both read from

    absorb = self.kv_b_proj.weight.view(-1, nope + self.v_head_dim, latent)  # [H, nope + v, latent]
    query = torch.cat([torch.einsum("thn,hnc->thc", q_pass, absorb[:, :nope]), q_rot], dim=-1)  # [T, H, latent+rope]
    # The values are the latent, the cache's first `latent` columns; attending to the whole [c, k_r] and dropping the
    # rope columns after gives the same, and keeps key and value widths equal: torch's CPU SDPA falls back to a path
    # some 20x slower when they differ.
    attended = step.plan.attend(query, cache, cache, self.scaling,
                                kv_scales=KVScales(scale, scale))[..., :latent]  # [T, H, latent]
    values = torch.einsum("thc,hvc->thv", attended, absorb[:, nope:])  # [T, H, v]
    return self.o_proj(values.reshape(1, tokens, -1)), None
