"""Attention over the paged KV memory for one step's flat batch, plugged into transformers.

Every step runs the model once on a single sequence [1, T] holding the tokens of all its rows: one token per
decoding request, and each prefill chunk (a prompt, part of one, or a retracted request's prompt and output),
each row at its own positions. Registered in transformers' AttentionInterface as "flatwire", the function below
receives each layer's new queries, keys and values plus this step's `PagedBatch` (a forward kwarg that
transformers hands down to attention), writes the new keys and values into their layer group's pages, and has the
group's attention plan attend each row's queries to its context so far (cached prefix included), causal, within
the layer's sliding window if it has one, with its attention sinks if it has them (gpt-oss). An 8-bit pool
(--kv-cache-dtype) is written quantized over the layer's scales and read widened (kv/quantize.py):

- torch (model/torch_attention.py): grouped SDPA over gathered pages; CPU, and the reference;
- triton (model/triton_attention.py): a paged kernel that reads the pages in place.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from transformers import AttentionInterface

from services.scheduler.kv.pool import KVPool
from services.scheduler.kv.quantize import UNSCALED, KVScales
from services.scheduler.model.torch_attention import TorchPlan

if TYPE_CHECKING:
    from services.scheduler.model.linear_attention import StateRows

ATTENTION_NAME = "flatwire"
PageTable = Sequence[int] | np.ndarray  # a row's pages in one layer group, in order
BACKENDS = ("torch", "triton")


class BackendUnavailable(ValueError):
    """A backend flag this machine cannot run (an unknown name, no CUDA, a package missing): said at start, in one
    line naming the flag."""


def check_backend(backend: str, device: torch.device) -> str:
    """`backend`, if it can run on `device`."""
    if backend not in BACKENDS:
        raise BackendUnavailable(f"--attention-backend: expected one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "triton":
        require_triton("--attention-backend triton", device)
    return backend


def require_triton(flag: str, device: torch.device) -> None:
    """What a Triton backend (`flag`, as given) needs: Triton, and CUDA or Triton's interpreter (the tests)."""
    try:
        from services.scheduler.model.triton_attention import INTERPRETED
    except ImportError as exc:
        raise BackendUnavailable(f"{flag}: Triton is not installed ({exc})") from None
    if device.type != "cuda" and not INTERPRETED:
        raise BackendUnavailable(f"{flag} runs on CUDA, not {device.type} (TRITON_INTERPRET=1 runs its kernels on "
                                 "the CPU, slowly, as the tests do)")


class AttentionPlan(Protocol):
    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int = 0,
               sinks: torch.Tensor | None = None, kv_scales: KVScales = UNSCALED) -> torch.Tensor:
        """query [T, H, D] against one layer's caches [pages, page_size, Hkv, D] -> [T, H, D]; `window`: the
        positions a query sees, its own included (0: every one before it); `sinks` [H]: gpt-oss's sink logits;
        `kv_scales`: what the caches' keys and values are read times (an 8-bit pool's)."""


@dataclass
class GroupStep:
    """A layer group's part of a step: where each new token's KV goes, and the plan its rows attend by."""

    write_pages: torch.Tensor  # [T] the page of each new token, in the group's tables
    plan: AttentionPlan


@dataclass
class PagedBatch:
    """What every layer of a step needs (built once per step): each new token's offset in its page, and each layer
    group's pages and plan."""

    pool: KVPool
    write_offsets: torch.Tensor  # [T] each new token's offset in its page
    groups: list[GroupStep]
    states: "StateRows | None" = None  # the rows' linear-attention state slots (model/linear_attention.py)

    @classmethod
    def build(cls, pool: KVPool, tables: Sequence[Sequence[PageTable]], starts: np.ndarray, ends: np.ndarray,
              device: torch.device, backend: str = "torch", query_group: int = 1,
              states: "StateRows | None" = None) -> "PagedBatch":
        """Row i feeds positions [starts[i], ends[i]) of its request, whose KV lives in tables[g][i] in layer group
        g; the rows' tokens follow each other in the flat sequence. `query_group`: query heads per KV head."""
        ps = pool.page_size
        counts = ends - starts
        needed = -(-ends // ps)  # pages each row's context reaches
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # each row's first flat index
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if len(counts) else \
            np.zeros(0, np.int64)
        owners = np.repeat(np.arange(len(counts)), counts)
        table_starts = np.concatenate([[0], np.cumsum(needed)[:-1]]).astype(np.int64)
        steps = []
        for group, group_tables in zip(pool.groups, tables):
            rows = [np.asarray(table[:count], dtype=np.int64) for table, count in zip(group_tables, needed.tolist())]
            flat_tables = np.concatenate(rows) if rows else np.zeros(0, np.int64)
            plan: AttentionPlan
            if backend == "triton":
                from services.scheduler.model.triton_attention import TritonPlan  # imports triton
                kv_heads = group.spec.page_shape[0]
                plan = TritonPlan.build(rows, starts, counts, first, query_group, kv_heads, device)
            else:
                plan = TorchPlan.build(rows, starts, counts, first, ps, device)
            steps.append(GroupStep(_put(flat_tables[table_starts[owners] + positions // ps], device), plan))
        return cls(pool=pool, write_offsets=_put(positions % ps, device), groups=steps, states=states)


def _put(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    paged_batch: PagedBatch | None = None, sliding_window: int | None = None,
                    s_aux: torch.Tensor | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None). `sliding_window`: the layer's window
    (transformers passes it to windowed layers); `s_aux`: its sink logits (gpt-oss)."""
    batch = paged_batch
    assert batch is not None  # the model runner passes paged_batch to every forward
    pool, layer = batch.pool, module.layer_idx
    group = pool.group_of[layer]
    window = sliding_window or 0
    if window != pool.groups[group].window:  # the KV memory would hold the wrong pages: never silently
        raise RuntimeError(f"layer {layer} attends with a window of {window}, its KV memory keeps "
                           f"{pool.groups[group].window} (model/architecture.py read the config otherwise)")
    step = batch.groups[group]
    pool.write(layer, step.write_pages, batch.write_offsets, key[0].transpose(0, 1), value[0].transpose(0, 1))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    attended = step.plan.attend(query[0].transpose(0, 1), pool.keys(layer), pool.values(layer), scale, window=window,
                                sinks=s_aux, kv_scales=pool.scales[layer])
    return attended.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
