"""The experts a MoE model's routers chose for each token (SGLang's return_routed_experts), kept per KV slot.

Forward hooks on the routers (transformers' `*TopKRouter` modules, which return (logits, scores, indices))
write each step's top-k expert ids into a table laid out as the KV memory ([num_pages, page_size, layers,
top_k] int32, kv/pool.py): a token's routing lives where its keys and values live, so a prompt prefix
found in the prefix cache brings the routing its first prefill recorded, and a request's whole routing is read
off its page table when it ends. Dense layers (a MoE model's mlp_only_layers) keep -1.
"""

import re
from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from torch import nn

from services.scheduler.kv.pool import KVPool
from services.scheduler.model.attention import PageTable

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer, router module) of every MoE layer."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter") and (layer := _LAYER.search(f".{name}.")):
            found.append((int(layer.group(1)), module))
    return found


def router_top_k(model: nn.Module) -> int:
    """Experts per token of the model's routers (what the KV pool keeps per slot and layer)."""
    found = routers(model)
    if not found:
        raise ValueError("--enable-return-routed-experts: the model has no MoE router (a *TopKRouter module)")
    return int(getattr(found[0][1], "top_k", 0))


class ExpertRouting:
    """Records the routers' choices of each step into `kv.routed_experts`, at the step's tokens' KV slots (a pool
    made with routed_top_k=router_top_k(model))."""

    def __init__(self, model: nn.Module, kv: KVPool):
        found = routers(model)
        self.kv = kv
        # The table is laid out as a full-attention group's pages: a window group gives its pages back.
        full = [i for i, group in enumerate(kv.groups) if not group.window]
        if not full:
            raise ValueError("--enable-return-routed-experts: every layer of this model attends within a sliding "
                             "window, and the routing is kept with full-attention KV")
        self.group = full[0]
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None  # (pages, offsets) of the step's tokens
        for layer, module in found:
            module.register_forward_hook(partial(self._record, layer))

    def _record(self, layer: int, module: nn.Module, args, output) -> None:
        if self._slots is not None:
            pages, offsets = self._slots
            self.kv.routed_experts[pages, offsets, layer] = output[2].to(torch.int32)

    @contextmanager
    def recording(self, page_tables: Sequence[PageTable], starts: np.ndarray, ends: np.ndarray):
        """While a forward runs over rows of these page tables, positions [start, end) each, in row order."""
        pages, offsets = _slots(self.kv.page_size, page_tables, starts, ends)
        device = self.kv.routed_experts.device
        self._slots = (torch.from_numpy(pages).to(device), torch.from_numpy(offsets).to(device))
        try:
            yield
        finally:
            self._slots = None

    def of(self, page_table: list[int], tokens: int, start: int = 0) -> np.ndarray:
        """int32 [tokens - start, layers, top_k]: what positions start..tokens-1 of a sequence with this page table
        got."""
        pages, offsets = _slots(self.kv.page_size, [page_table], np.array([start]), np.array([max(start, tokens)]))
        table = self.kv.routed_experts
        return table[torch.from_numpy(pages).to(table.device), torch.from_numpy(offsets).to(table.device)].cpu().numpy()


def _slots(page_size: int, page_tables: Sequence[PageTable], starts: np.ndarray, ends: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    positions = [np.arange(start, end) for start, end in zip(starts.tolist(), ends.tolist())]
    pages = np.concatenate([np.asarray(table, dtype=np.int64)[p // page_size] if len(p) else p
                            for table, p in zip(page_tables, positions)] or [np.zeros(0, np.int64)])
    offsets = np.concatenate(positions or [np.zeros(0, np.int64)]) % page_size
    return pages.astype(np.int64), offsets.astype(np.int64)
