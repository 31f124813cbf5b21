"""The sampler's transforms and draws on a small known distribution (in process, fast)."""

import numpy as np
import pytest
import torch

from services.scheduler.sampling.sampler import SamplingBatch, sample

PROBS = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
DRAWS = 40_000


def frequencies(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seeds=None) -> np.ndarray:
    torch.manual_seed(0)
    logits = PROBS.log().repeat(DRAWS, 1)
    generators = [torch.Generator().manual_seed(s) for s in seeds] if seeds else [None] * DRAWS
    params = SamplingBatch(rows=list(range(DRAWS)), temperature=[temperature] * DRAWS, top_p=[top_p] * DRAWS,
                           top_k=[top_k] * DRAWS, min_p=[min_p] * DRAWS, generators=generators)
    return np.bincount(sample(logits, params).numpy(), minlength=len(PROBS)) / DRAWS


def expected(kept: int, temperature: float = 1.0) -> np.ndarray:
    p = PROBS.numpy() ** (1 / temperature)
    p[kept:] = 0
    return p / p.sum()


@pytest.mark.parametrize("params, kept", [
    (dict(), 5),
    (dict(top_k=2), 2),
    (dict(top_p=0.8), 3),  # 0.45 + 0.25 < 0.8: the third token completes the nucleus
    (dict(min_p=0.3), 3),  # 0.3 * 0.45 = 0.135
    (dict(top_k=4, top_p=0.9, min_p=0.25), 3),  # top-k keeps 4, top-p all 4 (0.85 < 0.9 * 0.95), min-p 3
])
def test_draws_follow_the_truncated_distribution(params, kept):
    np.testing.assert_allclose(frequencies(**params), expected(kept), atol=0.01)


def test_temperature_sharpens():
    np.testing.assert_allclose(frequencies(temperature=0.5), expected(5, 0.5), atol=0.01)


def test_greedy_rows_and_seeded_rows():
    logits = PROBS.log().repeat(3, 1)
    params = SamplingBatch(rows=[1, 2], temperature=[1.0, 1.0], top_p=[1.0, 1.0], top_k=[0, 0], min_p=[0.0, 0.0],
                           generators=[torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)])
    tokens = sample(logits, params)
    assert tokens[0] == 0 and tokens[1] == tokens[2]  # row 0 is greedy; same seed, same draw
