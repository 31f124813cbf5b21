"""What a layer keeps per token in the KV memory: one spec per kind of layer (vLLM's kv_cache_interface), and the
layers grouped by it.

- `AttentionSpec`: keys and values of every token of the sequence (full attention) or, with a `window`, of its
  latest positions only (sliding-window attention): pages wholly before every window can be given back.
- `MLASpec` (DeepSeek V3, Kimi K2): one compressed latent and one rope key per token, shared by every head; the
  attention decompresses or absorbs it.
- `RecurrentSpec` (Qwen3.5, Qwen3-Next's Gated DeltaNet layers): no pages, a fixed-size state per request (and per
  checkpoint the prefix cache keeps), whatever the sequence's length.

A spec carries the dtype its tensors are stored in, so that a narrower KV cache (fp8) is a spec of another
dtype, not another pool. `group_layers` puts the layers of a model into groups of one spec and (but for the last
of a kind) equal size (vLLM's hybrid allocator): every group holds its own pages, one page table per request, but
the groups share the pool's tensors, tensor i holding layer i of every group, so that a page of any group takes
the same memory and one pool of pages serves them all. A window group's pages that leave the window go back to
that pool for full-attention pages to use (manager.py).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Per layer, two [pages, page_size, kv_heads, head_dim] tensors: keys and values. `window` 0: full attention,
    every key so far; W > 0: sliding-window attention, a query at position q sees the keys at q - W < k <= q."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int = 0

    @property
    def token_bytes(self) -> int:
        """What one token takes in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, ...]:
        """What the pool's tensors hold per token, at [page, offset]."""
        return self.kv_heads, self.head_dim

    @property
    def tensors(self) -> int:
        """Tensors per layer: keys and values."""
        return 2

    def storage(self) -> "AttentionSpec":
        """What a tensor shared with another group must agree on: the spec without its window."""
        return AttentionSpec(self.kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class MLASpec:
    """Per layer, one [pages, page_size, 1, latent_dim + rope_dim] tensor: the compressed latent that keys and
    values are decompressed from, then the rope part of the key."""

    latent_dim: int  # kv_lora_rank
    rope_dim: int  # qk_rope_head_dim
    dtype: torch.dtype

    @property
    def window(self) -> int:
        return 0

    @property
    def token_bytes(self) -> int:
        return (self.latent_dim + self.rope_dim) * self.dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, ...]:
        return 1, self.latent_dim + self.rope_dim

    @property
    def tensors(self) -> int:
        return 1

    def storage(self) -> "MLASpec":
        return self


KVSpec = AttentionSpec | MLASpec  # kept in pages


@dataclass(frozen=True)
class RecurrentSpec:
    """Per layer and state slot, not per token: a linear-attention layer's (Gated DeltaNet's) state. Its causal
    convolution's last `conv_width` inputs [conv_dim, conv_width], in the model's dtype, and its recurrent state
    [heads, key_dim, value_dim] in float32 (as transformers keeps it: the decay and the delta rule accumulate)."""

    conv_dim: int
    conv_width: int  # the convolution's kernel less one
    heads: int  # value heads
    key_dim: int
    value_dim: int
    dtype: torch.dtype

    @property
    def state_bytes(self) -> int:
        """One slot of one layer."""
        return self.conv_dim * self.conv_width * self.dtype.itemsize + self.heads * self.key_dim * self.value_dim * 4


LayerSpec = KVSpec | RecurrentSpec


@dataclass(frozen=True)
class LayerGroup:
    """Layers that keep the same kind of memory in the same pages: layers[i] in the pool's tensor i."""

    spec: KVSpec
    layers: tuple[int, ...]  # decoder layer indices

    @property
    def window(self) -> int:
        return self.spec.window


@dataclass(frozen=True)
class StateGroup:
    """The linear-attention layers: a state slot each per request (and per prefix-cache checkpoint)."""

    spec: RecurrentSpec
    layers: tuple[int, ...]

    @property
    def slot_bytes(self) -> int:
        """One state slot over the group's layers: what a request holds whatever its length."""
        return len(self.layers) * self.spec.state_bytes


@dataclass(frozen=True)
class KVLayout:
    """What a model's decoder layers keep: the paged groups (attention, latents) and the recurrent state group."""

    groups: list[LayerGroup]
    states: StateGroup | None
    num_layers: int

    @property
    def windows(self) -> tuple[int, ...]:
        """Each paged group's window (0: every position)."""
        return tuple(group.window for group in self.groups)


def kv_layout(specs: list[LayerSpec]) -> KVLayout:
    """The layers (specs[i]: layer i's) laid out: recurrent ones in the state group, the others in page groups."""
    recurrent = [(layer, spec) for layer, spec in enumerate(specs) if isinstance(spec, RecurrentSpec)]
    if len({spec for _, spec in recurrent}) > 1:
        raise ValueError(f"linear-attention layers of different shapes: {sorted({str(s) for _, s in recurrent})}")
    states = StateGroup(recurrent[0][1], tuple(layer for layer, _ in recurrent)) if recurrent else None
    paged = {layer: spec for layer, spec in enumerate(specs) if not isinstance(spec, RecurrentSpec)}
    return KVLayout(group_layers(paged), states, len(specs))


def group_layers(specs: dict[int, KVSpec]) -> list[LayerGroup]:
    """Groups of the layers (specs[layer]: its spec), each of one spec and, but for the last of a spec, of the size
    of the smallest kind: a page of any group then spans the same tensors. Layers of different kinds must store
    alike (the same heads, widths and dtype)."""
    kinds: dict[KVSpec, list[int]] = {}
    for layer, spec in specs.items():
        kinds.setdefault(spec, []).append(layer)
    if len({spec.storage() for spec in kinds}) > 1:
        raise ValueError(f"layers of different kinds store different shapes: {sorted(map(str, kinds))}")
    size = min(len(layers) for layers in kinds.values())
    return [LayerGroup(spec, tuple(layers[i:i + size])) for spec, layers in kinds.items()
            for i in range(0, len(layers), size)]


def group_size(groups: list[LayerGroup]) -> int:
    """The pool's tensors per kind (keys, values): the largest group's layers."""
    return max(len(group.layers) for group in groups)


def token_bytes(groups: list[LayerGroup]) -> int:
    """What one page slot takes in the pool: a token of one group, over the tensors every group shares."""
    return group_size(groups) * groups[0].spec.token_bytes


def full_attention_bytes(groups: list[LayerGroup]) -> int:
    """What one token would take if every layer kept it (the baseline a window or a latent is measured against)."""
    return sum(len(group.layers) * group.spec.token_bytes for group in groups)
