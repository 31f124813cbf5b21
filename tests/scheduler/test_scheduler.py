"""The scheduler's outputs against transformers, over gRPC, with requests batched together; the lone scheduler
serves the small vocabulary (tests/conftest.py small_model_dir)."""

import numpy as np
import pytest
import torch
from flatwire_wire.scheduler import AbortRequest, LogprobParams, SamplingParams
from flatwire_wire.steps import FinishReason

from harness.checkpoints import SMALL_VOCABULARY

VOCAB_SAMPLE = SMALL_VOCABULARY  # prompt ids drawn below the special tokens
TIE = 1e-5  # reference_model candidates closer than this may swap places in the top-k


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB_SAMPLE, length).tolist()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """float32 log-softmax at every position of one forward over the whole sequence."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_topk_matches(values: np.ndarray, ids: np.ndarray, ref_rows: torch.Tensor) -> None:
    """[rows, k] top-k equal to the reference_model's, ids exact except between near-tied candidates."""
    ref_values, ref_ids = ref_rows.topk(values.shape[1], dim=-1)
    np.testing.assert_allclose(values, ref_values.numpy(), atol=1e-4, rtol=0)
    ref_values, ref_ids = ref_values.numpy(), ref_ids.numpy()
    gap_before = np.abs(np.diff(ref_values, axis=1, prepend=np.inf))
    gap_after = np.abs(np.diff(ref_values, axis=1, append=-np.inf))
    unambiguous = np.minimum(gap_before, gap_after) > TIE
    np.testing.assert_array_equal(ids[unambiguous], ref_ids[unambiguous])
    assert unambiguous.mean() > 0.5  # the check compares something


def test_batched_greedy_matches_transformers(scheduler_client, reference_model):
    """Four requests of different lengths arriving at different times: tokens and logprobs
    match transformers' generate and a full-sequence log_softmax reference_model."""
    specs = {  # name: (prompt, top_logprobs_num, logprob_start_len, token_ids_logprob)
        "a": (prompt(1, 6), 5, 0, [10, SMALL_VOCABULARY - 96]),
        "b": (prompt(2, 23), 20, 11, []),
        "c": (prompt(3, 57), 0, -1, []),
        "d": (prompt(4, 14), 3, 0, [7]),
    }
    new_tokens = 10

    def submit(name):
        ids, k, start, token_ids = specs[name]
        return scheduler_client.submit(
            input_ids=ids, sampling=greedy(new_tokens),
            logprob=LogprobParams(return_logprob=k > 0, top_logprobs_num=k, logprob_start_len=start,
                                                token_ids_logprob=token_ids))

    rids = {"a": submit("a")}
    scheduler_client.wait_tokens(rids["a"], 2)
    rids["b"], rids["c"] = submit("b"), submit("c")
    scheduler_client.wait_tokens(rids["b"], 1)
    rids["d"] = submit("d")
    results = {name: scheduler_client.wait(rid) for name, rid in rids.items()}

    # They really were batched: a decoded while b and c prefilled, and d joined running requests.
    assert set(results["a"].steps) & set(results["b"].steps)
    assert set(results["d"].steps) & set(results["c"].steps)

    for name, result in results.items():
        ids, k, start, token_ids = specs[name]
        assert result.start.prompt_tokens == len(ids) and result.start.owner == scheduler_client.owner
        assert result.start_step <= result.steps[0]
        expected = reference_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                            do_sample=False)[0, len(ids):]
        assert result.token_ids == expected.tolist(), name
        reason = FinishReason.LENGTH if len(expected) == new_tokens else FinishReason.STOP_TOKEN
        assert result.finish.reason == reason
        if not k:
            assert result.prompt is None
            continue
        ref = reference_logprobs(reference_model, ids + result.token_ids)
        output_rows = ref[len(ids) - 1:len(ids) - 1 + len(result.token_ids)]
        values, top_ids = result.topk()
        assert_topk_matches(values, top_ids, output_rows)
        token_logprobs = np.concatenate([o.token_logprobs for o in result.output])
        np.testing.assert_allclose(token_logprobs, output_rows.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        if token_ids:
            ids_logprobs = np.concatenate([o.ids_logprobs for o in result.output])
            np.testing.assert_allclose(ids_logprobs, output_rows[:, token_ids], atol=1e-4, rtol=0)

        first = max(start, 1)
        prompt_rows = ref[first - 1:len(ids) - 1]
        got = result.prompt
        assert got.n == len(ids) - first
        assert result.prompt_null_prefix == int(start == 0)
        assert_topk_matches(got.topk_values.reshape(-1, k), got.topk_ids.reshape(-1, k), prompt_rows)
        np.testing.assert_allclose(got.token_logprobs, prompt_rows.gather(1, torch.tensor(ids[first:])[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        if token_ids:
            np.testing.assert_allclose(got.ids_logprobs.reshape(-1, len(token_ids)), prompt_rows[:, token_ids],
                                       atol=1e-4, rtol=0)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05),
], ids=["plain", "top_p-top_k-min_p"])
def test_seeded_sampling_reproducible_across_batches(scheduler_client, params):
    ids = prompt(5, 9)

    def sampled(seed):
        return SamplingParams(max_new_tokens=12, seed=seed, **params)

    solo = scheduler_client.wait(scheduler_client.submit(input_ids=ids, sampling=sampled(7))).token_ids
    # Same seed while other requests share the steps (prefilling and decoding around it).
    others = [scheduler_client.submit(input_ids=prompt(10 + n, n), sampling=greedy(16)) for n in (5, 31, 12)]
    scheduler_client.wait_tokens(others[0], 1)
    batched_rid = scheduler_client.submit(input_ids=ids, sampling=sampled(7))
    late = scheduler_client.submit(input_ids=prompt(20, 17), sampling=greedy(4))
    batched = scheduler_client.wait(batched_rid)
    for rid in [*others, late]:
        scheduler_client.wait(rid)
    assert set(batched.steps) & set(scheduler_client.requests[others[1]].steps)

    assert batched.token_ids == solo
    assert scheduler_client.wait(scheduler_client.submit(input_ids=ids, sampling=sampled(8))).token_ids != solo


def entry_positions(first: int, interval: int, end: int) -> list[int]:
    """Where the entries of a request that does not stream start: 0, its staggered first entry's end, then every
    `interval` tokens until `end`."""
    return [0, *range(first, end, interval)] if first < end else [0]


def test_coalesced_entries_carry_the_same_tokens_and_rows_as_per_step_ones(scheduler_client):
    """A request that does not stream ships --output-interval (50) tokens per entry (its first one staggered: 1 to
    50 tokens, by its rid), and the rest at its end; its tokens and logprob rows are those of the same request
    streamed a token per step. An abort ships the tokens it had not shipped yet with its Finish."""
    ids = prompt(7, 9)
    logprob = LogprobParams(return_logprob=True, top_logprobs_num=5, logprob_start_len=-1,
                                          token_ids_logprob=[11, 12])
    streamed = scheduler_client.wait(scheduler_client.submit(input_ids=ids, sampling=greedy(120), logprob=logprob))
    coalesced = scheduler_client.wait(scheduler_client.submit(input_ids=ids, sampling=greedy(120), logprob=logprob,
                                                              stream_interval=0))

    assert streamed.entries == [(p, 1) for p in range(120)]
    first = coalesced.entries[0][1]
    assert 1 <= first <= 50
    starts = entry_positions(first, 50, 120)
    assert coalesced.entries == [(start, end - start) for start, end in zip(starts, [*starts[1:], 120])]
    assert coalesced.token_ids == streamed.token_ids
    for got, want in zip(coalesced.topk(), streamed.topk()):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.concatenate([o.ids_logprobs for o in coalesced.output]),
                                  np.concatenate([o.ids_logprobs for o in streamed.output]))

    rid = scheduler_client.submit(input_ids=ids, sampling=greedy(2000), logprob=logprob, stream_interval=0)
    scheduler_client.wait_tokens(rid, 50)
    scheduler_client.calls["Abort"](AbortRequest(rid=rid), timeout=10)
    aborted = scheduler_client.wait(rid)
    assert aborted.finish.reason == FinishReason.ABORT
    assert len(aborted.token_ids) == aborted.finish.output_tokens > 50  # nothing held back
    starts = [p for p, _ in aborted.entries]
    assert starts == entry_positions(aborted.entries[0][1], 50, starts[-1] + 1)


def test_first_entries_of_requests_admitted_together_are_staggered(scheduler_client):
    """Requests that do not stream, submitted together, do not all ship on the same steps (output/pending.py)."""
    rids = [scheduler_client.submit(input_ids=prompt(3, 5), sampling=greedy(60), stream_interval=0)
            for _ in range(12)]
    firsts = {scheduler_client.wait(rid).entries[0][1] for rid in rids}
    assert len(firsts) > 3 and all(1 <= first <= 50 for first in firsts), firsts
