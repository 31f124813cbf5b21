"""Attention over the paged KV memory for one step's flat batch, plugged into transformers.

Every step runs the model once on a single sequence [1, T] holding the tokens of all its rows: one token per
decoding request, and each prefill chunk (a prompt, part of one, or a retracted request's prompt and output),
each row at its own positions. Registered in transformers' AttentionInterface as "flatwire", the function below
receives each layer's new queries, keys and values plus this step's `PagedBatch` (a forward kwarg that
transformers hands down to attention), writes the new keys and values into their pages, and attends with one
batched SDPA call per group of rows: each row's queries against the pages of its context so far (cached prefix
included), causal, each query seeing the keys up to its own position. A group pads its rows' queries to the
longest and their pages to the most, so rows are grouped by size, largest first, such that padding costs at most
MAX_PADDING times what the rows need: a batch of similar rows is one call, and one long context among short ones
is a call of its own rather than the length every row pays. Decode rows and prefill chunks never share a group.

This is the torch path, for CPU and CUDA, and the reference any kernel is tested against: it reads each group's
pages with one index_select per layer (a page-granular gather of what the rows attend to), where a paged kernel
would read them in place.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from services.scheduler.model.kv_cache import KVPool

ATTENTION_NAME = "flatwire"
MAX_PADDING = 1.5  # a group's padded attention (rows x queries x pages) over what its rows need, at most


@dataclass
class AttentionGroup:
    """Rows attended by one SDPA call."""

    queries: torch.Tensor  # [R, Q] flat index of each row's queries, padded with its first
    valid: torch.Tensor  # [R, Q] which of those are real
    pages: torch.Tensor  # [R, P] pages of each row's context (cached prefix and the row), padded with page 0
    mask: torch.Tensor  # [R, 1, Q, P * page_size] True where a query sees a key


@dataclass
class PagedBatch:
    """Where each token of the step's flat sequence writes its KV, and the groups its rows attend in (built once
    per step, used by every layer)."""

    pool: KVPool
    write_pages: torch.Tensor  # [T] the page of each new token
    write_offsets: torch.Tensor  # [T] its offset in that page
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, pool: KVPool, page_tables: list[list[int]], starts: np.ndarray, ends: np.ndarray,
              device: torch.device) -> "PagedBatch":
        """Row i feeds positions [starts[i], ends[i]) of its request, whose KV lives in page_tables[i]; the rows'
        tokens follow each other in the flat sequence."""
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

        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        def group(rows: np.ndarray) -> AttentionGroup:
            width, page_count = int(counts[rows].max()), int(needed[rows].max())
            pages = np.zeros((len(rows), page_count), dtype=np.int64)
            for i, row in enumerate(rows.tolist()):
                pages[i, :needed[row]] = tables[row]
            offsets = np.arange(width)
            valid = offsets[None, :] < counts[rows][:, None]
            shift = np.where(valid, offsets[None, :], 0)
            keys = np.arange(page_count * ps)
            mask = keys[None, None, :] <= (starts[rows][:, None] + shift)[:, :, None]  # padding sees its first key
            return AttentionGroup(queries=put(first[rows][:, None] + shift), valid=put(valid), pages=put(pages),
                                  mask=put(mask.reshape(len(rows), 1, width, len(keys))))

        single = counts == 1
        groups = [group(rows) for kind in (single, ~single)
                  for rows in _similar(np.flatnonzero(kind), counts, needed)]
        return cls(pool=pool, write_pages=put(write_pages), write_offsets=put(positions % ps), groups=groups)


def _similar(rows: np.ndarray, queries: np.ndarray, pages: np.ndarray) -> list[np.ndarray]:
    """`rows`, largest first, cut into runs whose padded size stays within MAX_PADDING of their own."""
    order = rows[np.lexsort((queries[rows], pages[rows]))[::-1]]  # most pages first, then most queries
    runs: list[list[int]] = []
    own = most_queries = most_pages = 0
    for row in order.tolist():
        q, p = int(queries[row]), int(pages[row])
        if runs and (len(runs[-1]) + 1) * max(most_queries, q) * most_pages <= MAX_PADDING * (own + q * p):
            runs[-1].append(row)
            own, most_queries = own + q * p, max(most_queries, q)
        else:
            runs.append([row])
            own, most_queries, most_pages = q * p, q, p
    return [np.array(run, dtype=np.int64) for run in runs]


def _context(pages: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """[rows, P] pages of a [pages, page_size, Hkv, D] layer cache -> [rows, Hkv, P * page_size, D]."""
    rows, count = pages.shape
    gathered = cache.index_select(0, pages.reshape(-1))  # [rows * P, page_size, Hkv, D]
    return gathered.view(rows, count * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    paged_batch: PagedBatch | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    batch = paged_batch
    assert batch is not None  # the model runner passes paged_batch to every forward
    keys, values = batch.pool.keys[module.layer_idx], batch.pool.values[module.layer_idx]
    keys[batch.write_pages, batch.write_offsets] = key[0].transpose(0, 1)  # [T, Hkv, D]
    values[batch.write_pages, batch.write_offsets] = value[0].transpose(0, 1)

    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    for group in batch.groups:
        attended = F.scaled_dot_product_attention(
            query[0][:, group.queries].transpose(0, 1),  # [R, H, Q, D]
            _context(group.pages, keys), _context(group.pages, values),
            attn_mask=group.mask, scale=scaling, enable_gqa=True)  # [R, H, Q, D]
        out[group.queries[group.valid]] = attended.transpose(1, 2)[group.valid]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
