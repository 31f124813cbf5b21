"""Attention over the paged KV memory for one step's flat batch, plugged into transformers.

Every step runs the model once on a single sequence [1, T] holding the tokens of all its rows: one token per
decoding request, and each prefill chunk (a prompt, part of one, or a retracted request's prompt and output),
each row at its own positions. Registered in transformers' AttentionInterface as "flatwire", the function below
receives each layer's new queries, keys and values plus this step's `PagedBatch` (a forward kwarg that
transformers hands down to attention), writes the new keys and values into their pages, and has the step's
attention plan attend each row's queries to its context so far (cached prefix included), causal:

- torch (model/torch_attention.py): grouped SDPA over gathered pages; CPU, and the reference;
- triton (model/triton_attention.py): a paged kernel that reads the pages in place.
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from transformers import AttentionInterface

from services.scheduler.kv.pool import KVPool
from services.scheduler.model.torch_attention import TorchPlan

ATTENTION_NAME = "flatwire"
BACKENDS = ("torch", "triton")


def check_backend(backend: str, device: torch.device) -> str:
    """`backend`, if it can run on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"--attention-backend: expected one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "triton":
        try:
            from services.scheduler.model.triton_attention import INTERPRETED
        except ImportError as exc:
            raise ValueError(f"--attention-backend triton: Triton is not installed ({exc})") from None
        if device.type != "cuda" and not INTERPRETED:
            raise ValueError(f"--attention-backend triton runs on CUDA, not {device.type} (TRITON_INTERPRET=1 runs "
                             "its kernels on the CPU, slowly, as the tests do)")
    return backend


class AttentionPlan(Protocol):
    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """query [T, H, D] against one layer's caches [pages, page_size, Hkv, D] -> [T, H, D]."""


@dataclass
class PagedBatch:
    """Where each token of the step's flat sequence writes its KV, and the plan its rows attend by (built once
    per step, used by every layer)."""

    pool: KVPool
    write_pages: torch.Tensor  # [T] the page of each new token
    write_offsets: torch.Tensor  # [T] its offset in that page
    plan: AttentionPlan

    @classmethod
    def build(cls, pool: KVPool, page_tables: list[list[int]], starts: np.ndarray, ends: np.ndarray,
              device: torch.device, backend: str = "torch", group: int = 1) -> "PagedBatch":
        """Row i feeds positions [starts[i], ends[i]) of its request, whose KV lives in page_tables[i]; the rows'
        tokens follow each other in the flat sequence. `group`: query heads per KV head."""
        ps = pool.page_size
        counts = ends - starts
        needed = -(-ends // ps)  # pages each row's context reaches
        tables = [np.asarray(table[:count], dtype=np.int64) for table, count in zip(page_tables, needed.tolist())]
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # each row's first flat index
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if len(counts) else \
            np.zeros(0, np.int64)
        owners = np.repeat(np.arange(len(counts)), counts)
        table_starts = np.concatenate([[0], np.cumsum(needed)[:-1]]).astype(np.int64)
        flat_tables = np.concatenate(tables) if tables else np.zeros(0, np.int64)
        write_pages = flat_tables[table_starts[owners] + positions // ps]
        plan: AttentionPlan
        if backend == "triton":
            from services.scheduler.model.triton_attention import TritonPlan  # imports triton
            plan = TritonPlan.build(tables, starts, counts, first, group, pool.groups[0].spec.kv_heads, device)
        else:
            plan = TorchPlan.build(tables, starts, counts, first, ps, device)
        return cls(pool=pool, write_pages=_put(write_pages, device), write_offsets=_put(positions % ps, device),
                   plan=plan)


def _put(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    paged_batch: PagedBatch | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    batch = paged_batch
    assert batch is not None  # the model runner passes paged_batch to every forward
    keys, values = batch.pool.keys[module.layer_idx], batch.pool.values[module.layer_idx]
    keys[batch.write_pages, batch.write_offsets] = key[0].transpose(0, 1)  # [T, Hkv, D]
    values[batch.write_pages, batch.write_offsets] = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return batch.plan.attend(query[0].transpose(0, 1), keys, values, scale).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
