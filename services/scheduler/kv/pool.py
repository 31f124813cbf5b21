"""The KV memory's tensors: what every layer keeps for `num_pages` pages of `page_size` token slots, as its
group's spec says (specs.py).

The groups share the tensors: a full- or sliding-window-attention layer i of a group holds its keys in keys[i]
and its values in values[i] (tensor i of the pool, [num_pages, page_size, kv_heads, head_dim]), where layer i of
every other group holds its own, in other pages: a page belongs to one group at a time (the KV manager,
manager.py, hands out the pages; token p of a request lives in page table[p // page_size] at offset
p % page_size of its group's table). An MLA layer keeps one [num_pages, page_size, 1, latent + rope] tensor.
The tensors are of the spec's dtype: an 8-bit one (--kv-cache-dtype) holds each layer's KV over its `KVScales`,
written through `write` (kv/quantize.py). Zero-filled, so that the padding a step's attention reads (page 0)
never carries NaN into it (0 * NaN is NaN).

How many pages: --max-total-tokens when given; else on CUDA what --mem-fraction-static of the device leaves
after the weights, and on CPU DEFAULT_CPU_TOKENS.
"""

import logging

import torch

from services.scheduler.kv.quantize import KVScales, as_bytes, quantize
from services.scheduler.kv.specs import KVLayout, full_attention_bytes, group_size, token_bytes

log = logging.getLogger(__name__)

DEFAULT_CPU_TOKENS = 131072  # the KV memory of the former 32 slots x 4096 tokens


class KVPool:
    """`state_slots`: linear-attention state slots (the running requests' and the prefix cache's checkpoints), per
    such layer a conv state [slots, conv_dim, width] and a recurrent state [slots, heads, key_dim, value_dim];
    `routed_top_k`: also keep, per slot and layer, the top-k experts a MoE router chose for the token
    (model/routed_experts.py): int32 [num_pages, page_size, layers, top_k], -1 where none did, at the slots of the
    full-attention group's pages. `scales`: each decoder layer's (an 8-bit pool's), else 1.0."""

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, device: torch.device, state_slots: int = 0,
                 routed_top_k: int = 0, scales: list[KVScales] | None = None):
        self.layout = layout
        self.groups = layout.groups
        self.group_of: dict[int, int] = {}  # each paged decoder layer's group
        self.tensor_of: dict[int, int] = {}  # and its tensor in the pool
        for index, group in enumerate(self.groups):
            for tensor, layer in enumerate(group.layers):
                self.group_of[layer], self.tensor_of[layer] = index, tensor
        self.scales = scales or [KVScales()] * layout.num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self.state_slots = state_slots if layout.states is not None else 0
        self._routed_top_k = routed_top_k
        self._tensors: list[list[torch.Tensor]] = []  # [kind][tensor]: keys (and values) shared by the groups
        self._states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # linear layer -> (conv, recurrent)
        self.routed_experts = torch.empty(0, dtype=torch.int32)
        self.resume()

    def keys(self, layer: int) -> torch.Tensor:
        """The layer's keys (an MLA layer's latent and rope key)."""
        return self._tensors[0][self.tensor_of[layer]]

    def values(self, layer: int) -> torch.Tensor:
        return self._tensors[1][self.tensor_of[layer]]

    def states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear-attention layer's (conv state, recurrent state), indexed by state slot."""
        return self._states[layer]

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, *entries: torch.Tensor) -> None:
        """A step's new entries of `layer` into slot offsets[t] of pages[t], as the pool stores them (quantized over
        the layer's scales): keys and values [T, Hkv, D], or an MLA layer's latent and rope key [T, 1, width]."""
        assert len(entries) == len(self._tensors), "one entry per tensor of the layer's kind"
        scales = self.scales[layer]
        for tensors, new, scale in zip(self._tensors, entries, (scales.key, scales.value)):
            cache = tensors[self.tensor_of[layer]]
            as_bytes(cache)[pages, offsets] = as_bytes(quantize(new, cache.dtype, scale))

    def resume(self) -> None:
        """(Re)allocate the tensors, zero-filled."""
        if self.groups:
            spec = self.groups[0].spec
            shape = (self.num_pages, self.page_size, *spec.page_shape)
            self._tensors = [[torch.zeros(shape, dtype=spec.dtype, device=self.device)
                              for _ in range(group_size(self.groups))] for _ in range(spec.tensors)]
        if (states := self.layout.states) is not None:
            recurrent, slots = states.spec, self.state_slots
            self._states = {layer: (
                torch.zeros(slots, recurrent.conv_dim, recurrent.conv_width, dtype=recurrent.dtype, device=self.device),
                torch.zeros(slots, recurrent.heads, recurrent.key_dim, recurrent.value_dim, dtype=torch.float32,
                            device=self.device))
                for layer in states.layers}
        if self._routed_top_k:
            self.routed_experts = torch.full(
                (self.num_pages, self.page_size, self.layout.num_layers, self._routed_top_k), -1, dtype=torch.int32,
                device=self.device)

    def release(self) -> None:
        """Free the tensors (memory release: no request holds a page)."""
        self._tensors, self._states = [], {}
        self.routed_experts = torch.empty(0, dtype=torch.int32)

    def clear_slot(self, page: int, state: int) -> None:
        """Zero a page and a state slot again (the start-up check runs a step in them)."""
        for tensors in self._tensors:
            for tensor in tensors:
                tensor[page].zero_()
        for conv, recurrent in self._states.values():
            conv[state].zero_()
            recurrent[state].zero_()

    @property
    def token_bytes(self) -> int:
        """What one page slot takes over the tensors."""
        return token_bytes(self.groups)

    @property
    def bytes(self) -> int:
        tensors = [t for kinds in self._tensors for t in kinds] + [t for pair in self._states.values() for t in pair]
        return sum(t.numel() * t.element_size() for t in (*tensors, self.routed_experts))


def pool_pages(max_total_tokens: int, page_size: int, layout: KVLayout, device: torch.device,
               mem_fraction_static: float, state_slots: int = 0) -> int:
    """The pool's pages (page 0, the padding page, included) for the memory of --max-total-tokens tokens kept in
    every paged layer (what a full-attention model of these layers holds for them; window groups fit more) or, on
    CUDA without it, --mem-fraction-static of the device's memory less what the weights (already loaded) and the
    `state_slots` linear-attention state slots take."""
    groups = layout.groups
    slot = token_bytes(groups)  # one token of one group, over the tensors the groups share
    if not max_total_tokens and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        states = state_slots * layout.states.slot_bytes if layout.states is not None else 0
        room = int(mem_fraction_static * total) - torch.cuda.memory_allocated(device) - states
        if room <= 0:
            raise ValueError(f"--mem-fraction-static {mem_fraction_static}: the weights already take "
                             f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
        slots = room // slot
    else:
        slots = (max_total_tokens or DEFAULT_CPU_TOKENS) * full_attention_bytes(groups) // slot
    return max(slots // page_size, 1) + 1
