"""The KV memory's tensors: what every layer keeps for `num_pages` pages of `page_size` token slots, as its
group's spec says (specs.py).

A full-attention layer holds two tensors shaped [num_pages, page_size, kv_heads, head_dim]; token p of a request
lives in page page_table[p // page_size] at offset p % page_size (the KV manager, manager.py, hands out the
pages). Zero-filled, so that the padding a step's attention reads (page 0) never carries NaN into it (0 * NaN is
NaN).

How many pages: --max-total-tokens when given; else on CUDA what --mem-fraction-static of the device leaves
after the weights, and on CPU DEFAULT_CPU_TOKENS.
"""

import logging

import torch

from services.scheduler.kv.specs import LayerGroup, token_bytes

log = logging.getLogger(__name__)

DEFAULT_CPU_TOKENS = 131072  # the KV memory of the former 32 slots x 4096 tokens


class KVPool:
    """`routed_top_k`: also keep, per slot and layer, the top-k experts a MoE router chose for the token
    (model/routed_experts.py): int32 [num_pages, page_size, layers, top_k], -1 where none did."""

    def __init__(self, groups: list[LayerGroup], num_pages: int, page_size: int, device: torch.device,
                 routed_top_k: int = 0):
        self.groups = groups
        self.num_layers = sum(len(group.layers) for group in groups)
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self._routed_top_k = routed_top_k
        self.keys: list[torch.Tensor] = []  # per decoder layer
        self.values: list[torch.Tensor] = []
        self.routed_experts = torch.empty(0, dtype=torch.int32)
        self.resume()

    def resume(self) -> None:
        """(Re)allocate every layer's tensors, zero-filled."""
        keys: list[torch.Tensor | None] = [None] * self.num_layers
        values: list[torch.Tensor | None] = [None] * self.num_layers
        for group in self.groups:
            shape, dtype = group.spec.page_shape(self.num_pages, self.page_size), group.spec.dtype
            for layer in group.layers:
                keys[layer] = torch.zeros(shape, dtype=dtype, device=self.device)
                values[layer] = torch.zeros(shape, dtype=dtype, device=self.device)
        assert all(t is not None for t in keys), "every decoder layer belongs to a group"
        self.keys, self.values = keys, values  # type: ignore[assignment]
        if self._routed_top_k:
            self.routed_experts = torch.full((self.num_pages, self.page_size, self.num_layers, self._routed_top_k),
                                             -1, dtype=torch.int32, device=self.device)

    def release(self) -> None:
        """Free every layer's tensors (memory release: no request holds a page)."""
        self.keys, self.values = [], []
        self.routed_experts = torch.empty(0, dtype=torch.int32)

    @property
    def token_bytes(self) -> int:
        """What one token takes over every layer."""
        return token_bytes(self.groups)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, self.routed_experts))


def pool_pages(max_total_tokens: int, page_size: int, token_bytes: int, device: torch.device,
               mem_fraction_static: float) -> int:
    """The pool's pages (page 0, the padding page, included) for --max-total-tokens or, on CUDA without it,
    --mem-fraction-static of the device's memory less what the weights (already loaded) take."""
    tokens = max_total_tokens
    if not tokens and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        room = int(mem_fraction_static * total) - torch.cuda.memory_allocated(device)
        if room <= 0:
            raise ValueError(f"--mem-fraction-static {mem_fraction_static}: the weights already take "
                             f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
        tokens = room // token_bytes
    tokens = tokens or DEFAULT_CPU_TOKENS
    return max(tokens // page_size, 1) + 1
