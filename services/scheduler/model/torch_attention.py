"""Paged attention in torch (--attention-backend torch, the default): batched SDPA over gathered pages.

Rows are attended in groups, one SDPA call per group: each row's queries against the pages of its context so far
(cached prefix included), causal, each query seeing the keys up to its own position. A group pads its rows'
queries to the longest and their pages to the most, so rows are grouped by size, largest first, such that
padding costs at most MAX_PADDING times what the rows need: a batch of similar rows is one call, and one long
context among short ones is a call of its own rather than the length every row pays. Decode rows and prefill
chunks never share a group.

Sliding windows: a layer attended with `window` W > 0 lets the query at position q see the keys at positions k
with q - W < k <= q, the W latest positions, its own included. That is transformers' convention for every family
it windows: masking_utils.sliding_window_overlay (`kv_idx > q_idx - sliding_window`), which
create_sliding_window_causal_mask applies to Mistral's, Gemma 3's, OLMo 3's and gpt-oss's sliding layers alike
(modeling_mistral, modeling_gemma3, modeling_olmo3, modeling_gpt_oss), as does flash attention's
`window_size=(W - 1, W - 1)` (modeling_flash_attention_utils): a config's `sliding_window` is W as it stands.
Window 0 is full causal attention. A windowed layer gathers each row from the page of the first key its first
query sees: earlier pages lie wholly outside every window of the row (its later queries see later keys), and the
KV manager may have freed them. Groups and masks are built per distinct window when a layer first asks for it,
once per step.

Attention sinks (gpt-oss): a learned logit per query head that joins each query's softmax denominator with no
value, as transformers' modeling_gpt_oss.eager_attention_forward concatenates `module.sinks` (unscaled) to the
scaled scores and drops its column after the softmax. SDPA has no sinks: the sink is one more key, a zero key
whose score 0 the additive mask turns into exactly the sink's logit, with a zero value.

The path for CPU, and the reference every kernel is tested against: it reads each group's pages with one
index_select per layer (a page-granular gather of what the rows attend to), where a paged kernel
(model/triton_attention.py) reads them in place. An 8-bit pool's pages are gathered as bytes, then widened to the
query's dtype times the layer's scales (kv/quantize.py).
"""

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from services.scheduler.kv.quantize import UNSCALED, KVScales, as_bytes, widen

MAX_PADDING = 1.5  # a group's padded attention (rows x queries x pages) over what its rows need, at most


@dataclass
class AttentionGroup:
    """Rows attended by one SDPA call."""

    queries: torch.Tensor  # [R, Q] flat index of each row's queries, padded with its first
    valid: torch.Tensor  # [R, Q] which of those are real
    pages: torch.Tensor  # [R, P] pages each row reads (its window's), padded with its last
    mask: torch.Tensor  # [R, 1, Q, P * page_size] True where a query sees a key


@dataclass
class TorchPlan:
    """A step's rows, and the groups each window attends them in (built on a window's first use)."""

    tables: list[np.ndarray]
    starts: np.ndarray
    counts: np.ndarray
    first: np.ndarray
    page_size: int
    device: torch.device
    _groups: dict[int, list[AttentionGroup]] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def build(cls, tables: list[np.ndarray], starts: np.ndarray, counts: np.ndarray, first: np.ndarray,
              page_size: int, device: torch.device) -> "TorchPlan":
        """Row i's queries are flat indices first[i] + [0, counts[i]) at positions starts[i] + [0, counts[i]),
        its context's pages tables[i]."""
        return cls(tables, starts, counts, first, page_size, device)

    def groups(self, window: int) -> list[AttentionGroup]:
        """The rows' groups for layers of `window` (0: full causal attention)."""
        if window not in self._groups:
            self._groups[window] = self._grouped(window)
        return self._groups[window]

    def _grouped(self, window: int) -> list[AttentionGroup]:
        first_key = np.maximum(self.starts - window + 1, 0) if window else np.zeros_like(self.starts)
        skipped = first_key // self.page_size
        tables = [table[skip:] for table, skip in zip(self.tables, skipped.tolist())]
        needed = np.array([len(t) for t in tables], dtype=np.int64)
        single = self.counts == 1
        return [self._group(rows, tables, needed, skipped * self.page_size, window)
                for kind in (single, ~single) for rows in _similar(np.flatnonzero(kind), self.counts, needed)]

    def _group(self, rows: np.ndarray, tables: list[np.ndarray], needed: np.ndarray, first_read: np.ndarray,
               window: int) -> AttentionGroup:
        """`rows` reading pages tables[row], whose first key is at position first_read[row]."""
        counts, starts = self.counts[rows], self.starts[rows]
        width, page_count = int(counts.max()), int(needed[rows].max())
        pages = np.empty((len(rows), page_count), dtype=np.int64)
        for i, row in enumerate(rows.tolist()):
            pages[i, :needed[row]] = tables[row]
            pages[i, needed[row]:] = tables[row][-1]  # padding past the row's context: masked, and a page it holds
        offsets = np.arange(width)
        valid = offsets[None, :] < counts[:, None]
        shift = np.where(valid, offsets[None, :], 0)
        query_positions = (starts[:, None] + shift)[:, :, None]  # padding repeats the row's first query
        key_positions = (first_read[rows][:, None] + np.arange(page_count * self.page_size))[:, None, :]
        mask = key_positions <= query_positions
        if window:
            mask &= key_positions > query_positions - window
        return AttentionGroup(queries=self._put(self.first[rows][:, None] + shift), valid=self._put(valid),
                              pages=self._put(pages), mask=self._put(mask[:, None]))

    def _put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int = 0,
               sinks: torch.Tensor | None = None, kv_scales: KVScales = UNSCALED) -> torch.Tensor:
        """query [T, H, D] against one layer's caches, keys [pages, page_size, Hkv, D] and values [pages,
        page_size, Hkv, Dv] -> [T, H, Dv]. `window`: the keys a query sees, its own included (transformers'
        `sliding_window`; 0: all before it); `sinks` [H]: the layer's sink logits (gpt-oss), not scaled by
        `scale`; `kv_scales`: the caches' (an 8-bit pool's)."""
        out = query.new_empty((*query.shape[:2], values.shape[-1]))
        for group in self.groups(window):
            context_keys = _context(group.pages, keys, query.dtype, kv_scales.key)
            context_values = context_keys if values is keys and kv_scales.value == kv_scales.key else \
                _context(group.pages, values, query.dtype, kv_scales.value)  # MLA: one latent for both
            mask = group.mask
            if sinks is not None:
                context_keys, context_values, mask = _with_sink(context_keys, context_values, mask, sinks)
            attended = F.scaled_dot_product_attention(
                query[group.queries].permute(0, 2, 1, 3),  # [R, H, Q, D]
                context_keys, context_values, attn_mask=mask, scale=scale, enable_gqa=True)  # [R, H, Q, D]
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


def _context(pages: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """[rows, P] pages of a [pages, page_size, Hkv, D] layer cache -> [rows, Hkv, P * page_size, D] in `dtype`, what
    the cache holds times `scale`."""
    rows, count = pages.shape
    gathered = as_bytes(cache).index_select(0, pages.reshape(-1)).view(cache.dtype)  # [rows * P, page_size, Hkv, D]
    context = widen(gathered, dtype, scale)
    return context.view(rows, count * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _with_sink(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context keys and values [R, Hkv, K, D] and mask [R, 1, Q, K] with the sink as key K: a zero key and
    value, and an additive mask [R, H, Q, K + 1] that is 0 where a query sees a key, -inf where not, and each
    query head's sink logit on the sink's key (its score q . 0 = 0, exactly)."""
    rows, _, queries, _ = mask.shape
    zero = keys.new_zeros(rows, keys.shape[1], 1, keys.shape[3])
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device).masked_fill_(~mask, float("-inf"))
    sink = sinks.to(keys.dtype).view(1, -1, 1, 1).expand(rows, -1, queries, 1)
    return (torch.cat([keys, zero], 2), torch.cat([values, zero], 2),
            torch.cat([bias.expand(-1, sink.shape[1], -1, -1), sink], 3))
