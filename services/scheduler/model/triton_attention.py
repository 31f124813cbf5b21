"""Paged attention in Triton (--attention-backend triton): every row of a step read in place from the KV pages.

One program attends a block of one row's queries (a decoding row's single query, or up to BLOCK_M // group
consecutive queries of a prefill chunk) for one KV head and every query head that shares it (GQA: the key and
value tiles are loaded once per KV head, not once per query head). It walks the row's page table BLOCK_N keys at
a time, each key loaded from its page and offset (no gather into a new tensor), causal by position, with an
online softmax in float32. A step launches at most two such kernels per layer, one for its decoding rows and one
for its prefill chunks, since the two want different block shapes.

Decoding rows of long contexts and few rows leave most of a GPU idle, so their keys can be split SPLITS ways
(flash-decoding): each split writes its partial output and log-sum-exp, and a second kernel merges them. The
split bounds are computed in the kernel from the row's context length, so the launch shapes depend on the batch
size alone, as CUDA graph replay needs (model/cuda_graphs.py).

Sliding windows follow the torch path's (and transformers') convention: with `window` W > 0 the query at
position q sees the keys at positions q - W < k <= q. A block's key loop starts at the first key its first query
sees, so pages wholly before it are never loaded (the KV manager may have freed them: their table entries may be
page 0), and each query masks the keys before its own window; split decoding rows split the window's keys only.
Attention sinks (gpt-oss) join each query's softmax as a key of the sink's logit and no value: they start the
online softmax of an unsplit block, and split rows count them once, in the merge.

An 8-bit pool (--kv-cache-dtype, kv/quantize.py) is read as it is: each key and value tile is widened to the
query's dtype as it is loaded (exactly: every 8-bit value is representable there), the layer's key scale joins the
scores' scale and its value scale the output's normalization, the products the torch path forms element by element.

Tested against the torch path (model/torch_attention.py) under Triton's interpreter (TRITON_INTERPRET=1), which
runs these kernels on CPU tensors.
"""

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from services.scheduler.kv.quantize import UNSCALED, KVScales

DECODE_BLOCK_N = 64
EXTEND_BLOCK_M = 64  # queries x heads of one prefill block
EXTEND_BLOCK_N = 64
MAX_SPLITS = 16
LOG2E = 1.4426950408889634  # the kernels exponentiate in base 2: scores and sinks are scaled by log2(e)
# Triton's interpreter (3.9) multiplies bfloat16 tiles in tl.dot as raw integers: under it, queries are widened to
# float32 first (and the key and value tiles with them). Compiled kernels multiply bfloat16 on the tensor cores.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend_block(q_ptr, k_ptr, v_ptr, sinks_ptr, out_ptr, split_out_ptr, split_lse_ptr,
                  page_table_ptr, block_row_ptr, block_first_ptr, block_count_ptr, block_pos_ptr,
                  scale_log2, value_scale, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks,
                  stride_kh, stride_vp, stride_vs, stride_vh, stride_table, num_heads,
                  PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WIDEN: tl.constexpr,
                  WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(block_row_ptr + block)
    first = tl.load(block_first_ptr + block)
    count = tl.load(block_count_ptr + block)
    first_pos = tl.load(block_pos_ptr + block)

    m = tl.arange(0, BLOCK_M)
    token = m // GROUP
    head = kv_head * GROUP + m % GROUP
    m_valid = token < count
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(q_ptr + (first + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    q_pos = first_pos + token

    keys = first_pos + count  # the block's last query sees keys before this one
    lowest = 0  # the first key any of the block's queries sees: its first query's
    if WINDOWED:
        lowest = tl.maximum(first_pos - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(keys - lowest, SPLITS), BLOCK_N) * BLOCK_N
    key_start = lowest + split * per_split
    key_end = tl.minimum(key_start + per_split, keys)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS and SPLITS == 1:  # the sink as the first key seen: score sink, no value (split: in the merge)
        running_max = tl.load(sinks_ptr + head)
        running_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(key_start, key_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < key_end
        page = tl.load(page_table_ptr + row * stride_table + n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = n % PAGE_SIZE
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        seen = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if WINDOWED:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a query that sees no key here yet
        weights = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(running_max - safe_max)
        v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        running_max = new_max

    out_mask = m_valid[:, None] & d_valid[None, :]
    safe_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
    attended = acc * (value_scale / safe_sum)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + (first + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 attended.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # decoding rows only (count == 1): partials indexed [block, head, split]
        at = (block * num_heads + head) * SPLITS + split
        tl.store(split_out_ptr + at[:, None] * HEAD_DIM + d[None, :], attended, mask=out_mask)
        lse = tl.where(running_sum == 0.0, float("-inf"), running_max + tl.log2(safe_sum))
        tl.store(split_lse_ptr + at, lse, mask=m_valid)


@triton.jit
def _merge_splits(split_out_ptr, split_lse_ptr, sinks_ptr, out_ptr, block_first_ptr, stride_ot, stride_oh,
                  num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    block = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    at = (block * num_heads + head) * SPLITS + s
    lse = tl.load(split_lse_ptr + at)
    top = tl.max(lse, 0)  # the first split always saw a key: the max is finite
    sink_weight = 0.0
    if HAS_SINKS:  # the sink joins the denominator here, once for all the splits
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(top, sink)
        sink_weight = tl.exp2(sink - top)
    weights = tl.exp2(lse - top)
    parts = tl.load(split_out_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM, other=0.0)
    merged = tl.sum(parts * weights[:, None], 0) / (tl.sum(weights, 0) + sink_weight)
    first = tl.load(block_first_ptr + block)
    tl.store(out_ptr + first * stride_ot + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@dataclass
class Launch:
    """One kernel launch over blocks of query rows."""

    rows: torch.Tensor  # [blocks] int32: the row each block's queries belong to
    first: torch.Tensor  # [blocks] int32: the flat index of its first query
    count: torch.Tensor  # [blocks] int32: its queries
    position: torch.Tensor  # [blocks] int32: the position of its first query
    block_m: int
    block_n: int
    splits: int = 1

    @property
    def blocks(self) -> int:
        return self.rows.shape[0]


def block_m_for(group: int, queries: int) -> int:
    """Queries x heads of one block: room for `group` query heads of `queries` tokens, a power of two >= 16
    (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(group * queries))


def decode_splits(blocks: int, kv_heads: int, device: torch.device) -> int:
    """Key splits for decoding rows: enough programs for about two per multiprocessor."""
    if device.type != "cuda" or blocks == 0:
        return 1
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    return int(min(MAX_SPLITS, triton.next_power_of_2(max(1, -(-2 * processors // (blocks * kv_heads))))))


@dataclass
class TritonPlan:
    """A step's launches over its rows' page tables; built once per step, used by every layer."""

    page_tables: torch.Tensor  # [rows, pages] int32
    launches: list[Launch]
    group: int  # query heads per KV head

    @classmethod
    def build(cls, tables: list[np.ndarray], starts: np.ndarray, counts: np.ndarray, first: np.ndarray,
              group: int, kv_heads: int, device: torch.device, splits: int | None = None) -> "TritonPlan":
        """Row i's queries are flat indices first[i] + [0, counts[i]) at positions starts[i] + [0, counts[i]),
        its context's pages tables[i]. `splits`: for decoding rows, else decode_splits."""
        width = max((len(t) for t in tables), default=1)
        page_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, table in enumerate(tables):
            page_tables[i, :len(table)] = table

        def put(values) -> torch.Tensor:
            return torch.from_numpy(np.asarray(values, dtype=np.int32)).to(device, non_blocking=True)

        launches = []
        decoding = np.flatnonzero(counts == 1)
        if len(decoding):
            launches.append(Launch(put(decoding), put(first[decoding]), put(counts[decoding]), put(starts[decoding]),
                                   block_m_for(group, 1), DECODE_BLOCK_N,
                                   splits or decode_splits(len(decoding), kv_heads, device)))
        extending = np.flatnonzero(counts > 1)
        if len(extending):
            block_m = max(EXTEND_BLOCK_M, block_m_for(group, 1))
            per_block = block_m // group
            pieces = -(-counts[extending] // per_block)
            rows = np.repeat(extending, pieces)
            offset = np.concatenate([np.arange(p) for p in pieces]) * per_block
            launches.append(Launch(put(rows), put(first[rows] + offset),
                                   put(np.minimum(per_block, counts[rows] - offset)), put(starts[rows] + offset),
                                   block_m, EXTEND_BLOCK_N))
        return cls(put(page_tables), launches, group)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int = 0,
               sinks: torch.Tensor | None = None, kv_scales: KVScales = UNSCALED) -> torch.Tensor:
        """query [T, H, D] against one layer's caches [pages, page_size, Hkv, D] -> [T, H, D]. `window`: the
        keys a query sees, its own included (transformers' `sliding_window`; 0: all before it); `sinks` [H]: the
        layer's sink logits (gpt-oss), not scaled by `scale`; `kv_scales`: the caches' (an 8-bit pool's)."""
        return attend(query, keys, values, scale, self.page_tables, self.launches, self.group, window, sinks,
                      kv_scales)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, page_tables: torch.Tensor,
           launches: list[Launch], group: int, window: int = 0, sinks: torch.Tensor | None = None,
           kv_scales: KVScales = UNSCALED) -> torch.Tensor:
    tokens, heads, head_dim = query.shape
    kv_heads = keys.shape[2]
    out = query.new_empty((tokens, heads, head_dim))
    block_d = triton.next_power_of_2(head_dim)
    sinks_log2 = out if sinks is None else sinks.to(torch.float32) * LOG2E  # unused without sinks
    for launch in launches:
        split_out = split_lse = out  # unused unless the keys are split
        if launch.splits > 1:
            split_out = query.new_empty((launch.blocks, heads, launch.splits, head_dim), dtype=torch.float32)
            split_lse = query.new_empty((launch.blocks, heads, launch.splits), dtype=torch.float32)
        _attend_block[(launch.blocks, kv_heads, launch.splits)](
            query, keys, values, sinks_log2, out, split_out, split_lse,
            page_tables, launch.rows, launch.first, launch.count, launch.position,
            scale * LOG2E * kv_scales.key, kv_scales.value, window, query.stride(0), query.stride(1), out.stride(0),
            out.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
            values.stride(2), page_tables.stride(0), heads,
            PAGE_SIZE=keys.shape[1], GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, SPLITS=launch.splits,
            WIDEN=INTERPRETED and query.dtype == torch.bfloat16, WINDOWED=window > 0, HAS_SINKS=sinks is not None)
        if launch.splits > 1:
            _merge_splits[(launch.blocks, heads)](
                split_out, split_lse, sinks_log2, out, launch.first, out.stride(0), out.stride(1), heads,
                HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=launch.splits, HAS_SINKS=sinks is not None)
    return out
