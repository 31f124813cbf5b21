"""Attention over the paged KV memory for one step's flat batch, plugged into transformers.

Every step runs the model once on a single sequence [1, T] holding the tokens of all its rows: one token per
decoding request first, then each prefill chunk (a prompt, part of one, or a retracted request's prompt and
output), each row at its own positions. Registered in transformers' AttentionInterface as "flatwire", the
function below receives each layer's new queries, keys and values plus this step's `PagedBatch` (a forward
kwarg that transformers hands down to attention), writes the new keys and values into their pages, and attends
with two batched SDPA calls per layer, whatever the rows:
- decode rows (one query each) against the pages of their whole context, masked to each row's length;
- prefill chunks (many queries each, padded to the longest chunk) against the pages of their context so far,
  cached prefix included: causal, each query seeing the keys up to its own position.

This is the torch path, for CPU and CUDA, and the reference any kernel is tested against: it reads each row's
pages with one index_select per layer (a page-granular gather, padded to the row's page count), where a paged
kernel would read them in place.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from services.scheduler.model.kv_cache import KVPool

ATTENTION_NAME = "flatwire"


@dataclass
class PagedBatch:
    """Where each token of the step's flat sequence writes its KV, and which pages each row attends to (built once
    per step, used by every layer)."""

    pool: KVPool
    write_pages: torch.Tensor  # [T] the page of each new token
    write_offsets: torch.Tensor  # [T] its offset in that page
    num_decode: int  # rows [0, num_decode) of the flat sequence are single decode tokens
    decode_pages: torch.Tensor  # [D, P] pages of each decode row's context, padded with page 0
    decode_mask: torch.Tensor  # [D, 1, 1, P * page_size] True where a key is visible
    extend_queries: torch.Tensor  # [E, Q] flat index of each chunk's queries, padded with its first
    extend_valid: torch.Tensor  # [E, Q] which of those are real
    extend_pages: torch.Tensor  # [E, P'] pages of each chunk's context (cached prefix and the chunk)
    extend_mask: torch.Tensor  # [E, 1, Q, P' * page_size]

    @classmethod
    def build(cls, pool: KVPool, page_tables: list[list[int]], starts: np.ndarray, ends: np.ndarray,
              device: torch.device) -> "PagedBatch":
        """Row i feeds positions [starts[i], ends[i]) of its request, whose KV lives in page_tables[i]; rows of
        one token come first."""
        ps = pool.page_size
        counts = ends - starts
        num_decode = int(np.argmax(counts > 1)) if (counts > 1).any() else len(counts)
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if len(counts) else \
            np.zeros(0, np.int64)
        owners = np.repeat(np.arange(len(counts)), counts)
        pages_of = _padded_pages(page_tables, pool.page_size, ends)  # [rows, P]
        write_pages = pages_of[owners, positions // ps]

        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        decode, extend = slice(0, num_decode), slice(num_decode, len(counts))
        decode_pages = _trimmed(pages_of[decode], ends[decode], ps)
        decode_keys = np.arange(decode_pages.shape[1] * ps)
        decode_mask = (decode_keys[None, :] < ends[decode][:, None]).reshape(num_decode, 1, 1, len(decode_keys))

        extend_counts, extend_starts = counts[extend], starts[extend]
        width = int(extend_counts.max(initial=0))
        first_row = num_decode + np.concatenate([[0], np.cumsum(extend_counts)[:-1]]).astype(np.int64)
        offsets = np.arange(width)
        valid = offsets[None, :] < extend_counts[:, None]
        queries = first_row[:, None] + np.where(valid, offsets[None, :], 0)
        extend_pages = _trimmed(pages_of[extend], ends[extend], ps)
        keys = np.arange(extend_pages.shape[1] * ps)
        query_positions = extend_starts[:, None] + np.where(valid, offsets[None, :], 0)
        extend_mask = keys[None, None, :] <= query_positions[:, :, None]  # padded queries see their first key
        return cls(pool=pool, write_pages=put(write_pages), write_offsets=put(positions % ps), num_decode=num_decode,
                   decode_pages=put(decode_pages), decode_mask=put(decode_mask), extend_queries=put(queries),
                   extend_valid=put(valid), extend_pages=put(extend_pages),
                   extend_mask=put(extend_mask.reshape(len(extend_counts), 1, width, len(keys))))


def _padded_pages(page_tables: list[list[int]], page_size: int, ends: np.ndarray) -> np.ndarray:
    """[rows, most pages] the pages each row's context up to its end needs, padded with page 0."""
    needed = -(-ends // page_size)
    pages = np.zeros((len(page_tables), int(needed.max(initial=0))), dtype=np.int64)
    for row, (table, count) in enumerate(zip(page_tables, needed.tolist())):
        pages[row, :count] = table[:count]
    return pages


def _trimmed(pages: np.ndarray, ends: np.ndarray, page_size: int) -> np.ndarray:
    """The columns of `pages` that these rows' contexts reach."""
    return pages[:, :int(-(-ends.max(initial=0) // page_size))] if len(pages) else pages[:, :0]


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
    n = batch.num_decode
    if n:
        decoded = F.scaled_dot_product_attention(
            query[0, :, :n].transpose(0, 1).unsqueeze(2),  # [n, H, 1, D]
            _context(batch.decode_pages, keys), _context(batch.decode_pages, values),
            attn_mask=batch.decode_mask, scale=scaling, enable_gqa=True)
        out[:n] = decoded.squeeze(2)
    if batch.extend_queries.numel():
        chunk_queries = query[0][:, batch.extend_queries].transpose(0, 1)  # [E, H, Q, D]
        extended = F.scaled_dot_product_attention(
            chunk_queries, _context(batch.extend_pages, keys), _context(batch.extend_pages, values),
            attn_mask=batch.extend_mask, scale=scaling, enable_gqa=True)  # [E, H, Q, D]
        valid = batch.extend_valid
        out[batch.extend_queries[valid]] = extended.transpose(1, 2)[valid]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
