"""Paged attention in torch (--attention-backend torch, the default): batched SDPA over gathered pages.

Rows are attended in groups, one SDPA call per group: each row's queries against the pages of its context so far
(cached prefix included), causal, each query seeing the keys up to its own position. A group pads its rows'
queries to the longest and their pages to the most, so rows are grouped by size, largest first, such that
padding costs at most MAX_PADDING times what the rows need: a batch of similar rows is one call, and one long
context among short ones is a call of its own rather than the length every row pays. Decode rows and prefill
chunks never share a group.

The path for CPU, and the reference every kernel is tested against: it reads each group's pages with one
index_select per layer (a page-granular gather of what the rows attend to), where a paged kernel
(model/triton_attention.py) reads them in place.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

MAX_PADDING = 1.5  # a group's padded attention (rows x queries x pages) over what its rows need, at most


@dataclass
class AttentionGroup:
    """Rows attended by one SDPA call."""

    queries: torch.Tensor  # [R, Q] flat index of each row's queries, padded with its first
    valid: torch.Tensor  # [R, Q] which of those are real
    pages: torch.Tensor  # [R, P] pages of each row's context (cached prefix and the row), padded with page 0
    mask: torch.Tensor  # [R, 1, Q, P * page_size] True where a query sees a key


@dataclass
class TorchPlan:
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, tables: list[np.ndarray], starts: np.ndarray, counts: np.ndarray, first: np.ndarray,
              page_size: int, device: torch.device) -> "TorchPlan":
        """Row i's queries are flat indices first[i] + [0, counts[i]) at positions starts[i] + [0, counts[i]),
        its context's pages tables[i]."""
        needed = np.array([len(t) for t in tables], dtype=np.int64)

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
            keys = np.arange(page_count * page_size)
            mask = keys[None, None, :] <= (starts[rows][:, None] + shift)[:, :, None]  # padding sees its first key
            return AttentionGroup(queries=put(first[rows][:, None] + shift), valid=put(valid), pages=put(pages),
                                  mask=put(mask.reshape(len(rows), 1, width, len(keys))))

        single = counts == 1
        return cls([group(rows) for kind in (single, ~single)
                    for rows in _similar(np.flatnonzero(kind), counts, needed)])

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """query [T, H, D] against one layer's caches [pages, page_size, Hkv, D] -> [T, H, D]."""
        out = query.new_empty(query.shape)
        for group in self.groups:
            attended = F.scaled_dot_product_attention(
                query[group.queries].permute(0, 2, 1, 3),  # [R, H, Q, D]
                _context(group.pages, keys), _context(group.pages, values),
                attn_mask=group.mask, scale=scale, enable_gqa=True)  # [R, H, Q, D]
            out[group.queries[group.valid]] = attended.transpose(1, 2)[group.valid]
        return out


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
