"""The sampler's transforms and draws on a small known distribution, and its per-slot state (in process, fast)."""

import numpy as np
import pytest
import torch
from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.scheduler import SamplingParams, TokenizedRequest

from services.scheduler.request import Request
from services.scheduler.sampling.draw import SamplingBatch, nuclei, sample
from services.scheduler.sampling.logprobs import StepDistributions
from services.scheduler.sampling.sampler import Sampler
from services.scheduler.submit import SubmitLimits, parse_request

PROBS = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
DRAWS = 40_000


def frequencies(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seeds=None) -> np.ndarray:
    torch.manual_seed(0)
    logits = PROBS.log().repeat(DRAWS, 1)
    generators = [torch.Generator().manual_seed(s) for s in seeds] if seeds else [None] * DRAWS
    params = SamplingBatch(rows=list(range(DRAWS)), temperature=[temperature] * DRAWS, top_p=[top_p] * DRAWS,
                           top_k=[top_k] * DRAWS, min_p=[min_p] * DRAWS, generators=generators)
    return np.bincount(sample(logits, params).tokens.numpy(), minlength=len(PROBS)) / DRAWS


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
    tokens = sample(logits, params).tokens
    assert tokens[0] == 0 and tokens[1] == tokens[2]  # row 0 is greedy; same seed, same draw


# (temperature, top_p, top_k, min_p) per row; temperature 0: greedy.
PROCESSED_ROWS = [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.3, 1.0, 50, 0.0), (1.0, 1.0, 0, 0.05),
                  (0.8, 0.95, 200, 0.01), (0.0, 1.0, 0, 0.0), (0.0, 0.5, 5, 0.2)]


def reference_processed(logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """float64 log-probabilities of what the sampler draws from: temperature, then top-k, top-p, min-p."""
    if temperature == 0:
        out = np.full(len(logits), -np.inf)
        out[logits.argmax()] = 0.0
        return out
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    if top_k:
        p[p < np.sort(p)[-top_k]] = 0
    if top_p < 1:
        ordered = np.sort(p)[::-1]
        kept = max(int(((np.cumsum(ordered) - ordered) < top_p * p.sum()).sum()), 1)
        p[p < ordered[kept - 1]] = 0
    if min_p:
        p[p < min_p * p.max()] = 0
    with np.errstate(divide="ignore"):
        return np.log(p / p.sum())


def batch_of(rows: list[tuple[float, float, int, float]]) -> SamplingBatch:
    """The sampling batch of rows (temperature, top_p, top_k, min_p); temperature 0: greedy."""
    sampled = [i for i, row in enumerate(rows) if row[0] > 0]
    return SamplingBatch(rows=sampled, temperature=[rows[i][0] for i in sampled], top_p=[rows[i][1] for i in sampled],
                         top_k=[rows[i][2] for i in sampled], min_p=[rows[i][3] for i in sampled],
                         generators=[None] * len(sampled))


def test_processed_logprobs_match_a_numpy_reference():
    """Rows in processed mode get the logprobs of the distribution their token was drawn from; the others,
    in the same batch, stay raw."""
    vocab, k = 2000, 30
    logits = torch.from_numpy(np.random.default_rng(0).normal(0, 3, (len(PROCESSED_ROWS) + 1, vocab))).float()
    params = batch_of(PROCESSED_ROWS)
    draw = sample(logits, params)
    processed = [LogprobsMode.PROCESSED] * len(PROCESSED_ROWS) + [LogprobsMode.RAW]  # the last row stays raw
    ids = torch.tensor([[3, 7, 11]] * len(logits))
    distributions = StepDistributions(logits, logits, draw, params)
    rows = distributions.output_rows(processed, k, ids)
    for i, row_params in enumerate(PROCESSED_ROWS):
        want = reference_processed(logits[i].double().numpy(), *row_params)
        token = int(draw.tokens[i])
        assert np.isfinite(want[token]) and rows.token_logprobs[i] == pytest.approx(want[token], abs=1e-4)
        best = np.sort(want)[::-1][:k]
        np.testing.assert_allclose(rows.topk_values[i].numpy(), best, atol=1e-4)
        np.testing.assert_allclose(rows.ids_logprobs[i].numpy(), want[[3, 7, 11]], atol=1e-4)
        finite = np.isfinite(best)
        np.testing.assert_array_equal(np.isfinite(want[rows.topk_ids[i].numpy()]), finite)
        # The undrawable candidates still come in the model's order, after the drawable ones.
        assert (np.diff(logits[i][rows.topk_ids[i]].numpy()) <= 0).all()
    every = distributions.output_rows([LogprobsMode.PROCESSED] * len(logits), k, ids)
    for mixed, alone in zip(rows.arrays, every.arrays):  # a batch of processed rows only takes its own path
        torch.testing.assert_close(mixed[:-1], alone[:-1])
    raw = torch.log_softmax(logits[-1], dim=-1)
    assert rows.token_logprobs[-1] == pytest.approx(float(raw[draw.tokens[-1]]))
    np.testing.assert_allclose(rows.topk_values[-1].numpy(), raw.topk(k).values.numpy(), atol=1e-6)


def test_sglang_logprobs_are_the_adjusted_distribution_at_the_temperature_before_the_cut():
    """SGLang's: log-softmax of the logits drawn from (here biased) over the temperature, whatever the cut; a greedy
    row's at temperature 1; the top-k in the same distribution's order. Raw rows of the same batch are of the
    unadjusted logits."""
    vocab, k = 2000, 30
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.normal(0, 3, (len(PROCESSED_ROWS) + 1, vocab))).float()
    adjusted = logits + torch.from_numpy(rng.normal(0, 1, logits.shape)).float()  # as logit_bias would
    params = batch_of(PROCESSED_ROWS)
    draw = sample(adjusted, params)
    ids = torch.tensor([[3, 7, 11]] * len(logits))
    modes = [LogprobsMode.SGLANG] * len(PROCESSED_ROWS) + [LogprobsMode.RAW]
    rows = StepDistributions(logits, adjusted, draw, params).output_rows(modes, k, ids)
    for i, (temperature, *_) in enumerate(PROCESSED_ROWS):
        want = torch.log_softmax(adjusted[i].double() / (temperature or 1.0), dim=-1)
        assert rows.token_logprobs[i] == pytest.approx(float(want[draw.tokens[i]]), abs=1e-5)
        np.testing.assert_allclose(rows.topk_values[i].numpy(), want.topk(k).values.numpy(), atol=1e-5)
        np.testing.assert_array_equal(rows.topk_ids[i].numpy(), want.topk(k).indices.numpy())
        np.testing.assert_allclose(rows.ids_logprobs[i].numpy(), want[[3, 7, 11]].numpy(), atol=1e-5)
    raw = torch.log_softmax(logits[-1], dim=-1)
    assert rows.token_logprobs[-1] == pytest.approx(float(raw[draw.tokens[-1]]), abs=1e-6)
    np.testing.assert_array_equal(rows.topk_ids[-1].numpy(), raw.topk(k).indices.numpy())


def test_nuclei_are_what_each_row_could_draw():
    """Top-p replay: a sampled row's nucleus is the set its temperature, top-k, top-p and min-p kept (the numpy
    reference's finite entries), ascending, and holds the token drawn; a greedy row's is its token."""
    vocab = 2000
    logits = torch.from_numpy(np.random.default_rng(2).normal(0, 3, (len(PROCESSED_ROWS), vocab))).float()
    params = batch_of(PROCESSED_ROWS)
    for seed in range(3):
        torch.manual_seed(seed)
        draw = sample(logits, params)
        rows = [4, 0, 5, 1, 6]  # out of order, greedy rows among them
        sizes, ids = nuclei(draw, params, rows, vocab)
        assert sizes.dtype == ids.dtype == torch.int32 and int(sizes.sum()) == len(ids)
        for row, kept in zip(rows, torch.split(ids, sizes.tolist())):
            want = np.flatnonzero(np.isfinite(reference_processed(logits[row].double().numpy(), *PROCESSED_ROWS[row])))
            np.testing.assert_array_equal(kept.numpy(), want)
            assert int(draw.tokens[row]) in kept.tolist()
        sampled_only = [1, 2, 3, 4]  # every row sampled: straight from the draw's probabilities
        sizes, ids = nuclei(draw, params, sampled_only, vocab)
        assert sizes.tolist() == [int((draw.probs[params.rows.index(row)] > 0).sum()) for row in sampled_only]


@pytest.mark.parametrize("spread", [3.0, 0.1])  # peaked: nuclei within top-p's head; flat: past it
def test_nuclei_read_from_top_ps_head_equal_a_full_pass(spread):
    """When every sampled row has a top-p, the nuclei come from the head top-p sorted (a peaked distribution's)
    unless it does not hold them all; either way they are the reference's."""
    rows = [(0.9, 0.9, 0, 0.0), (1.0, 0.95, 300, 0.0), (0.7, 0.8, 0, 0.05), (1.2, 0.5, 20, 0.0)]
    vocab = 5000
    logits = torch.from_numpy(np.random.default_rng(3).normal(0, spread, (len(rows), vocab))).float()
    params = batch_of(rows)
    draw = sample(logits, params)
    assert (draw.head is not None and bool(draw.head[1].all())) == (spread > 1)
    sizes, ids = nuclei(draw, params, [2, 0, 3], vocab)
    for row, kept in zip([2, 0, 3], torch.split(ids, sizes.tolist())):
        want = np.flatnonzero(np.isfinite(reference_processed(logits[row].double().numpy(), *rows[row])))
        np.testing.assert_array_equal(kept.numpy(), want)
    draw.head = None  # the full pass
    assert all(torch.equal(a, b) for a, b in zip(nuclei(draw, params, [2, 0, 3], vocab), (sizes, ids)))


def test_a_tie_at_the_cut_past_top_ps_head_is_kept():
    """Tokens past the head that tie the threshold are kept by the cut: the nucleus is read in full then."""
    vocab = 1100  # equally likely: top-p 0.5 reaches its mass within the head of 1024, and keeps every tie
    params = batch_of([(1.0, 0.5, 0, 0.0)])
    draw = sample(torch.zeros(1, vocab), params)
    sizes, ids = nuclei(draw, params, [0], vocab)
    assert draw.head is not None and not bool(draw.head[1].all())
    assert int(sizes[0]) == vocab and ids.tolist() == list(range(vocab))


def penalised(rid: str, prompt: list[int]) -> Request:
    """A greedy request with a frequency penalty of 1 (each of its output tokens' logits less its count), over a
    vocabulary of 5."""
    return parse_request(TokenizedRequest(rid=rid, input_ids=prompt, sampling=SamplingParams(
        max_new_tokens=8, temperature=0, frequency_penalty=1.0)), SubmitLimits(5, 64, 5, (), output_interval=50))


def test_a_slot_counts_the_tokens_of_the_request_that_holds_it():
    """The sampler's per-slot penalty state names the request it counts and how many of its tokens: a request that
    samples on in its slot keeps it; one that comes back to a slot after sampling elsewhere, or that takes one another
    request used, has it counted anew from its own tokens (stale counts would choose otherwise below)."""
    sampler = Sampler(num_slots=2, vocab_size=5, device=torch.device("cpu"))
    logits = torch.tensor([[0.0, 1.0, 2.2, 3.0, 2.9]])
    first, second = penalised("first", [3]), penalised("second", [1])

    def step(request: Request, slot: int) -> int:
        request.slot = slot
        token = int(sampler.choose(logits.clone(), [request]).tokens[0])
        request.append_output(token)
        return token

    assert [step(first, 0), step(first, 0)] == [3, 4]  # 3 counted once: 2.9 is the best left
    assert step(first, 1) == 2  # a new slot counts its 3 and 4: 2.2 is the best left
    assert step(first, 0) == 3  # slot 0 had counted its first two tokens only: counted again, 2 included
    assert step(second, 0) == 3  # another request's counts: anew from its own output, which is none
