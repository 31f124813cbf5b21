"""The Triton paged-attention kernels (model/triton_attention.py), run by Triton's interpreter on the CPU, equal
the torch path (model/torch_attention.py) across page sizes and boundaries, GQA ratios, dtypes, key splits and
mixed decode/prefill batches, and never read a key outside a row's context; and the engine's greedy outputs and
top-k logprobs with --attention-backend triton equal the torch backend's."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # CI installs it (pyproject's test extra); an x86-64 Linux wheel only

from services.scheduler.model import triton_attention  # noqa: E402
from services.scheduler.model.torch_attention import TorchPlan  # noqa: E402
from services.scheduler.model.triton_attention import TritonPlan  # noqa: E402
from tests.scheduler.engine_run import Run, check, prompt  # noqa: E402

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # about 2 ulp of the output


def test_the_kernels_run_interpreted():
    """tests/conftest.py sets TRITON_INTERPRET before anything imports triton."""
    assert triton_attention.INTERPRETED


def random_batch(rng, page_size: int, starts: list[int], counts: list[int], pages: int = 96):
    """Page tables of rows at positions starts[i] + [0, counts[i]), each drawn at random from the pool's pages
    (page 0 excluded, as the page pool does), and the flat index of each row's first query."""
    starts_, counts_ = np.array(starts), np.array(counts)
    needed = -(-(starts_ + counts_) // page_size)
    order = rng.permutation(np.arange(1, pages))
    cut = np.concatenate([[0], np.cumsum(needed)])
    tables = [order[cut[i]:cut[i + 1]] for i in range(len(starts))]
    return tables, starts_, counts_, np.concatenate([[0], np.cumsum(counts_)[:-1]])


def run_both(tables, starts, counts, first, heads, kv_heads, head_dim, page_size, dtype, splits, pages=96,
             outside=float("nan")):
    """(triton, torch) outputs: the caches hold `outside` in every slot no row's context covers, for the kernel;
    zeros there for the torch path, which reads its padding."""
    torch.manual_seed(0)
    keys = torch.randn(pages, page_size, kv_heads, head_dim)
    values = torch.randn(pages, page_size, kv_heads, head_dim)
    query = torch.randn(int(counts.sum()), heads, head_dim)
    inside = torch.zeros(pages, page_size, dtype=torch.bool)
    for table, end in zip(tables, starts + counts):
        for p in range(end):
            inside[table[p // page_size], p % page_size] = True
    zeroed = [t.masked_fill(~inside[:, :, None, None], 0.0) for t in (keys, values)]
    filled = [t.masked_fill(~inside[:, :, None, None], outside).to(dtype) for t in (keys, values)]
    scale = head_dim ** -0.5
    reference = TorchPlan.build(tables, starts, counts, first, page_size, CPU).attend(
        query.to(dtype).float(), zeroed[0].to(dtype).float(), zeroed[1].to(dtype).float(), scale)
    plan = TritonPlan.build(tables, starts, counts, first, heads // kv_heads, kv_heads, CPU, splits=splits)
    return plan.attend(query.to(dtype), *filled, scale), reference


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1), (6, 2)])  # GQA 1, 4, 8 and a non-power of two
def test_mixed_decode_and_prefill_rows_equal_the_torch_path(page_size, heads, kv_heads):
    rng = np.random.default_rng(page_size * 100 + heads * 10 + kv_heads)
    # decoding rows at, below and past a page boundary; prefill chunks from position 0, after a cached prefix,
    # across pages, and longer than one query block
    tables, starts, counts, first = random_batch(rng, page_size, [15, 0, 16, 40, 3, 17, 63], [1, 9, 1, 1, 30, 40, 1])
    out, reference = run_both(tables, starts, counts, first, heads, kv_heads, 32, page_size, torch.float32, 1)
    torch.testing.assert_close(out, reference, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_caches_equal_the_torch_path_in_float32(dtype):
    rng = np.random.default_rng(7)
    tables, starts, counts, first = random_batch(rng, 16, [5, 0, 33], [1, 20, 1])
    out, reference = run_both(tables, starts, counts, first, 8, 2, 64, 16, dtype, 1)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("splits", [2, 4, 16])
def test_split_keys_merge_to_the_unsplit_output(splits):
    """Flash-decoding: decoding rows' keys split `splits` ways, some splits empty for short rows."""
    rng = np.random.default_rng(splits)
    tables, starts, counts, first = random_batch(rng, 4, [0, 3, 70, 150, 12], [1, 1, 1, 1, 5], pages=128)
    out, reference = run_both(tables, starts, counts, first, 8, 2, 16, 4, torch.float32, splits, pages=128)
    torch.testing.assert_close(out, reference, atol=TOLERANCE[torch.float32], rtol=0)


def test_rows_whose_tables_hold_more_pages_than_their_context_reads_none_of_them():
    """A table may reach past the row's context (pages held for the next tokens): those are NaN here."""
    rng = np.random.default_rng(11)
    tables, starts, counts, first = random_batch(rng, 4, [0, 9], [6, 1])
    spare = [np.concatenate([t, [90, 91]]) for t in tables]
    out, reference = run_both(spare, starts, counts, first, 4, 2, 16, 4, torch.float32, 1)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference, atol=TOLERANCE[torch.float32], rtol=0)


def test_the_engine_on_the_kernel_equals_transformers(model):
    """Chunked prompts across page boundaries, prefix-cache hits and n samples of one prompt, decoded together:
    greedy tokens and logprobs (the sampled token's, top-k, the prompt's) equal the reference model's."""
    path, reference_model = model
    run = Run(path, chunked_prefill_size=7, attention_backend="triton")
    shared = prompt(40, 13)
    cases = {"short": (prompt(1, 3), 0), "long": (prompt(2, 21), 0), "shared-a": (shared, -1),
             "shared-b": (shared + prompt(41, 6), -1)}
    for rid, (ids, start) in cases.items():
        run.submit(rid, ids, 8, start, stream_interval=1)
    run.run()
    for rid, (ids, start) in cases.items():
        check(reference_model, ids, 8, run.result(rid), start)
    assert run.engine.stats.cached_prompt_tokens > 0
