"""What a layer keeps per token in the KV memory: one spec per kind of layer (vLLM's kv_cache_interface).

A model's layers are grouped by spec (`LayerGroup`): the pool (pool.py) allocates each group's tensors from its
spec, and the manager (manager.py) counts the memory a request takes in pages of `page_size` tokens. A spec
carries the dtype its tensors are stored in, so that a narrower KV cache is a spec of another dtype, not another
pool.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullAttention:
    """Keys and values of every token of the sequence: per layer, two [pages, page_size, kv_heads, head_dim]
    tensors."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        """What one token takes in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    def page_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        return num_pages, page_size, self.kv_heads, self.head_dim


KVSpec = FullAttention  # the kinds of layer memory this engine holds


@dataclass(frozen=True)
class LayerGroup:
    """Layers that keep the same kind of memory."""

    spec: KVSpec
    layers: tuple[int, ...]  # decoder layer indices

    @property
    def token_bytes(self) -> int:
        """What one token takes over the group's layers."""
        return len(self.layers) * self.spec.token_bytes


def token_bytes(groups: list[LayerGroup]) -> int:
    """What one token of a sequence takes in the KV memory, every layer included."""
    return sum(group.token_bytes for group in groups)
