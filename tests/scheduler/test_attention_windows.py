"""Sliding windows and attention sinks in both paged-attention paths: the torch path (model/torch_attention.py) and
the Triton kernels (model/triton_attention.py, run by Triton's interpreter) equal a dense float64 softmax over
explicit positions across window edges, page boundaries, GQA ratios, sinks, split decoding rows and mixed
decode/prefill batches, and never read what lies before a row's window (NaN there, and page 0 in its table); the
window and the sinks are transformers' own (masking_utils' sliding window, gpt-oss's eager attention)."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

pytest.importorskip("triton")  # CI installs it (pyproject's test extra); an x86-64 Linux wheel only

from services.scheduler.model.torch_attention import TorchPlan  # noqa: E402
from services.scheduler.model.triton_attention import TritonPlan  # noqa: E402
from tests.scheduler.test_triton_attention import TOLERANCE, random_batch  # noqa: E402

CPU = torch.device("cpu")
PAGE_SIZE = 4
HEAD_DIM = 16
FULL = 0  # the window of a full-attention layer
# Decoding rows at the first position, a page's last slot, a page's first, mid-page and deep in the context;
# prefill chunks from position 0, after a cached prefix ending mid-page, and over several query blocks.
MIXED_STARTS, MIXED_COUNTS = [0, 3, 4, 13, 40, 0, 5, 17], [1, 1, 1, 1, 1, 9, 7, 40]


@dataclass
class Batch:
    tables: list[np.ndarray]
    starts: np.ndarray
    counts: np.ndarray
    first: np.ndarray
    query: torch.Tensor  # [T, H, D]
    keys: torch.Tensor  # [pages, PAGE_SIZE, Hkv, D]: what the rows wrote
    values: torch.Tensor
    window: int

    @property
    def first_seen(self) -> np.ndarray:
        """Each row's first visible key: its first query's window start."""
        return np.maximum(self.starts - self.window + 1, 0) if self.window else np.zeros_like(self.starts)

    def unread_set_to_nan(self, cache: torch.Tensor, whole_pages: bool) -> torch.Tensor:
        """`cache` with NaN wherever no row reads: outside every row's slots [first_seen, end), or with
        `whole_pages` outside every page holding one of them (the torch path gathers whole pages)."""
        read = torch.zeros(cache.shape[:2], dtype=torch.bool)
        for table, seen, end in zip(self.tables, self.first_seen, self.starts + self.counts):
            positions = np.arange(seen, end)
            read[table[positions // PAGE_SIZE], positions % PAGE_SIZE] = True
        if whole_pages:
            read[:] = read.any(1, keepdim=True)
        return cache.masked_fill(~read[:, :, None, None], float("nan"))


def make_batch(seed: int, starts: list[int], counts: list[int], window: int, heads: int, kv_heads: int,
               pages: int = 96, dtype: torch.dtype = torch.float32) -> Batch:
    """Rows at positions starts[i] + [0, counts[i]) on random pages, those wholly before a row's window freed:
    page 0 in its table, as the KV manager leaves them."""
    tables, starts_, counts_, first = random_batch(np.random.default_rng(seed), PAGE_SIZE, starts, counts, pages)
    torch.manual_seed(seed)
    cache_shape = (pages, PAGE_SIZE, kv_heads, HEAD_DIM)
    batch = Batch([t.copy() for t in tables], starts_, counts_, first,
                  torch.randn(int(counts_.sum()), heads, HEAD_DIM).to(dtype), torch.randn(cache_shape).to(dtype),
                  torch.randn(cache_shape).to(dtype), window)
    for table, seen in zip(batch.tables, batch.first_seen):
        table[:seen // PAGE_SIZE] = 0
    return batch


def dense_attention(batch: Batch, sinks: torch.Tensor | None) -> torch.Tensor:
    """float64: each query's softmax over the keys at the positions its window holds, plus its head's sink in the
    denominator; a row's keys read slot by slot from its table."""
    group = batch.query.shape[1] // batch.keys.shape[2]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    for table, start, count, first in zip(batch.tables, batch.starts, batch.counts, batch.first):
        key_positions = torch.arange(start + count)
        slots = (torch.as_tensor(table)[key_positions // PAGE_SIZE], key_positions % PAGE_SIZE)
        keys = batch.keys[slots].double().repeat_interleave(group, 1)  # [K, H, D]
        values = batch.values[slots].double().repeat_interleave(group, 1)
        query_positions = torch.arange(start, start + count)[:, None]
        seen = key_positions[None, :] <= query_positions
        if batch.window:
            seen &= key_positions[None, :] > query_positions - batch.window
        queries = batch.query[first:first + count].double()  # [Q, H, D]
        logits = torch.einsum("qhd,khd->hqk", queries, keys).mul(HEAD_DIM ** -0.5).masked_fill(~seen, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks.double()[:, None, None].expand(-1, count, 1)], 2)
        weights = logits.softmax(2)[:, :, :len(key_positions)]
        out[first:first + count] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def kernel_attention(batch: Batch, sinks: torch.Tensor | None, splits: int = 1) -> torch.Tensor:
    """The Triton path, NaN in every slot it may not read."""
    heads, kv_heads = batch.query.shape[1], batch.keys.shape[2]
    plan = TritonPlan.build(batch.tables, batch.starts, batch.counts, batch.first, heads // kv_heads, kv_heads, CPU,
                            splits=splits)
    return plan.attend(batch.query, batch.unread_set_to_nan(batch.keys, whole_pages=False),
                       batch.unread_set_to_nan(batch.values, whole_pages=False), HEAD_DIM ** -0.5, batch.window, sinks)


def torch_attention(batch: Batch, sinks: torch.Tensor | None) -> torch.Tensor:
    """The torch path, NaN in every page it may not read."""
    plan = TorchPlan.build(batch.tables, batch.starts, batch.counts, batch.first, PAGE_SIZE, CPU)
    return plan.attend(batch.query, batch.unread_set_to_nan(batch.keys, whole_pages=True),
                       batch.unread_set_to_nan(batch.values, whole_pages=True), HEAD_DIM ** -0.5, batch.window, sinks)


def random_sinks(heads: int) -> torch.Tensor:
    """Sink logits around the scores' range, one well above it (a head that mostly attends to its sink)."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(heads))
    sinks[0] = 6.0
    return sinks


@pytest.mark.parametrize("window", [1, 3, PAGE_SIZE, 6, 11])
def test_a_windowed_layers_mask_is_transformers_sliding_window(window):
    """masking_utils.sliding_window_causal_mask_function, which every windowed family's mask is made of."""
    plan = TorchPlan.build([np.array([5, 6, 7])], np.array([0]), np.array([11]), np.array([0]), PAGE_SIZE, CPU)
    positions = torch.arange(11)
    expected = sliding_window_causal_mask_function(window)(0, 0, positions[:, None], positions[None, :])
    (group,) = plan.groups(window)
    assert torch.equal(group.mask[0, 0, :, :11], expected)
    (full,) = plan.groups(FULL)
    assert torch.equal(full.mask[0, 0, :, :11], causal_mask_function(0, 0, positions[:, None], positions[None, :]))


@pytest.mark.parametrize("window", [FULL, 5])
def test_sinks_equal_gpt_oss_eager_attention(window):
    """transformers' modeling_gpt_oss.eager_attention_forward: the sink joins the softmax unscaled, no value."""
    heads, kv_heads, tokens = 4, 2, 12
    batch = make_batch(5, [0], [tokens], window, heads, kv_heads)
    sinks = random_sinks(heads)
    slots = (torch.as_tensor(batch.tables[0])[torch.arange(tokens) // PAGE_SIZE], torch.arange(tokens) % PAGE_SIZE)
    keys, values = (cache[slots].transpose(0, 1)[None] for cache in (batch.keys, batch.values))  # [1, Hkv, T, D]
    positions = torch.arange(tokens)
    sees = (sliding_window_causal_mask_function(window) if window else causal_mask_function)(
        0, 0, positions[:, None], positions[None, :])
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    expected, _ = eager_attention_forward(module, batch.query.transpose(0, 1)[None], keys, values,
                                          torch.zeros(sees.shape).masked_fill(~sees, float("-inf")), HEAD_DIM ** -0.5)
    torch.testing.assert_close(torch_attention(batch, sinks), expected[0], atol=TOLERANCE[torch.float32], rtol=0)
    torch.testing.assert_close(kernel_attention(batch, sinks), expected[0], atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (6, 2)])  # GQA 1, 4 and a non-power of two
@pytest.mark.parametrize("window", [FULL, 1, 3, PAGE_SIZE, 6, 1000])  # below, at and past a page; past the context
def test_mixed_batches_equal_a_dense_softmax(window, heads, kv_heads, with_sinks):
    batch = make_batch(window * 10 + heads, MIXED_STARTS, MIXED_COUNTS, window, heads, kv_heads)
    sinks = random_sinks(heads) if with_sinks else None
    expected = dense_attention(batch, sinks).float()
    torch.testing.assert_close(torch_attention(batch, sinks), expected, atol=TOLERANCE[torch.float32], rtol=0)
    torch.testing.assert_close(kernel_attention(batch, sinks), expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [FULL, 3, 9, 100])
@pytest.mark.parametrize("splits", [2, 4])
def test_split_decoding_rows_equal_a_dense_softmax(splits, window, with_sinks):
    """Flash-decoding over the window's keys, some splits empty; the sink counted once, in the merge."""
    batch = make_batch(splits * 1000 + window, [0, 3, 70, 150, 12], [1, 1, 1, 1, 5], window, 8, 2, pages=128)
    sinks = random_sinks(8) if with_sinks else None
    torch.testing.assert_close(kernel_attention(batch, sinks, splits), dense_attention(batch, sinks).float(),
                               atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_windows_and_sinks_equal_a_dense_softmax(dtype):
    batch = make_batch(9, MIXED_STARTS, MIXED_COUNTS, 6, 8, 2, dtype=dtype)
    sinks = random_sinks(8)
    expected = dense_attention(batch, sinks).float()
    for out in (torch_attention(batch, sinks), kernel_attention(batch, sinks)):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_a_windowed_row_gathers_only_the_pages_of_its_window():
    """Position 150 with a window of 8 sees keys 143..150: pages 35 to 37 of its table, not the 35 before."""
    table = np.arange(1, 39)
    plan = TorchPlan.build([table], np.array([150]), np.array([1]), np.array([0]), PAGE_SIZE, CPU)
    (group,) = plan.groups(8)
    assert group.pages.tolist() == [table[35:].tolist()]
    assert group.mask[0, 0, 0].nonzero().flatten().tolist() == list(range(143 % PAGE_SIZE, 143 % PAGE_SIZE + 8))


def test_groups_and_masks_are_built_once_per_window_per_step():
    batch = make_batch(2, MIXED_STARTS, MIXED_COUNTS, 3, 4, 2)
    plan = TorchPlan.build(batch.tables, batch.starts, batch.counts, batch.first, PAGE_SIZE, CPU)
    windowed = plan.groups(3)
    for _ in range(2):  # two layers of each kind
        plan.attend(batch.query, batch.keys, batch.values, 1.0, window=3)
        plan.attend(batch.query, batch.keys, batch.values, 1.0, window=FULL)
    assert plan.groups(3) is windowed and plan.groups(FULL) is plan.groups(FULL)
