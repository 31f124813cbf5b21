"""The KV memory's tensors: in every layer, keys and values for `num_pages` pages of `page_size` token slots.

Each layer holds two tensors shaped [num_pages, page_size, kv_heads, head_dim]; token p of a request lives in page
page_table[p // page_size] at offset p % page_size (cache/pages.py hands out the pages). Zero-filled, so that
the padding a step's attention reads (page 0) never carries NaN into it (0 * NaN is NaN).

How many pages: --max-total-tokens when given; else on CUDA what --mem-fraction-static of the device leaves
after the weights, and on CPU DEFAULT_CPU_TOKENS.
"""

import logging

import torch

log = logging.getLogger(__name__)

DEFAULT_CPU_TOKENS = 131072  # the KV memory of the former 32 slots x 4096 tokens


class KVPool:
    """`routed_top_k`: also keep, per slot and layer, the top-k experts a MoE router chose for the token
    (model/routed_experts.py): int32 [num_pages, page_size, layers, top_k], -1 where none did."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, routed_top_k: int = 0):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self._layout = (num_layers, (num_pages, page_size, num_kv_heads, head_dim), dtype, device)
        self._routed_top_k = routed_top_k
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.routed_experts = torch.empty(0, dtype=torch.int32)
        self.resume()

    def resume(self) -> None:
        """(Re)allocate every layer's tensors, zero-filled."""
        layers, shape, dtype, device = self._layout
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        if self._routed_top_k:
            self.routed_experts = torch.full((*shape[:2], layers, self._routed_top_k), -1, dtype=torch.int32,
                                             device=device)

    def release(self) -> None:
        """Free every layer's tensors (memory release: no request holds a page)."""
        self.keys, self.values = [], []
        self.routed_experts = torch.empty(0, dtype=torch.int32)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, self.routed_experts))


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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
