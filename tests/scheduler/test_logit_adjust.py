"""Penalties, logit_bias and min_new_tokens (services/scheduler/sampling/logit_adjust.py) against transformers' own
logits processors: on random logits, and through the lone scheduler (the small vocabulary: tests/conftest.py
small_model_dir) over gRPC against transformers' generate."""

import dataclasses

import numpy as np
import pytest
import torch
from flatwire_wire.sampling import SamplingOptions
from flatwire_wire.scheduler import LogprobParams, SamplingParams
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from harness.checkpoints import SMALL_VOCABULARY
from services.scheduler.sampling.logit_adjust import AdjustedRow, LogitAdjustment, SlotPenalties, adjust_logits

VOCAB = 1000


class FrequencyPresencePenalty(LogitsProcessor):
    """OpenAI's formula (logit - count * frequency - (count > 0) * presence over the output so far), which no
    transformers processor implements."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.prompt_len:], torch.ones_like(input_ids[:, self.prompt_len:],
                                                                                dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def adjustment(frequency=0.0, presence=0.0, repetition=1.0, min_new_tokens=0, stop_ids=frozenset(), bias=None):
    options = SamplingOptions(frequency_penalty=frequency, presence_penalty=presence, repetition_penalty=repetition,
                              min_new_tokens=min_new_tokens, logit_bias=bias or {})
    return LogitAdjustment.of(options, frozenset(stop_ids))


def reference_processors(prompt_len: int, frequency=0.0, presence=0.0, repetition=1.0, min_new_tokens=0,
                         stop_ids=frozenset(), bias=None) -> LogitsProcessorList:
    """Transformers' processors in the order the scheduler applies them (vLLM's)."""
    processors = LogitsProcessorList()
    if bias:
        processors.append(SequenceBiasLogitsProcessor([[[token], value] for token, value in bias.items()]))
    if min_new_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, min_new_tokens, sorted(stop_ids)))
    if repetition != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition))
    if frequency or presence:
        processors.append(FrequencyPresencePenalty(prompt_len, frequency, presence))
    return processors


CASES = {
    "repetition": dict(repetition=1.7),
    "repetition-below-1": dict(repetition=0.6),
    "frequency-presence": dict(frequency=0.8, presence=-0.5),
    "min_new_tokens": dict(min_new_tokens=4, stop_ids={3, 17}),
    "logit_bias": dict(bias={5: 20.0, 9: -100.0, 11: 0.25}),
    "everything": dict(frequency=-1.2, presence=2.0, repetition=1.3, min_new_tokens=2, stop_ids={5}, bias={5: 3.0}),
}


def test_neutral_fields_ask_for_nothing():
    assert adjustment(stop_ids={3}) is None


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_adjusted_logits_match_transformers_processors(case):
    """Two requests in two slots of a batch, over several steps: each row adjusted as transformers would,
    whatever the other rows ask; rows without an adjustment untouched. Midway, the adjusted request takes its
    slot again with its output so far (as after a retract): nothing changes."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40, n) for n in (7, 3)]  # small ids: prompt and outputs overlap
    penalties = SlotPenalties(num_slots=4, vocab_size=VOCAB, device=torch.device("cpu"))
    adjustments = [adjustment(**case), None]
    slots = [2, 0]
    outputs: list[list[int]] = [[], []]
    for step in range(8):
        if step in (0, 4) and adjustments[0] is not None and adjustments[0].counts_tokens:
            penalties.start(slots[0], adjustments[0], prompts[0], outputs[0])
        logits = torch.from_numpy(rng.normal(0, 3, (2, VOCAB)).astype(np.float32))
        rows = [AdjustedRow(i, slots[i], len(outputs[i]), adjust) for i, adjust in enumerate(adjustments)
                if adjust is not None]
        got = adjust_logits(logits, rows, penalties)
        sequence = torch.tensor([prompts[0].tolist() + outputs[0]])
        expected = reference_processors(len(prompts[0]), **case)(sequence, logits[:1].clone())
        torch.testing.assert_close(got[:1], expected, rtol=1e-6, atol=1e-5)
        assert torch.equal(got[1], logits[1])  # the unadjusted row
        tokens = rng.integers(0, 40, 2)  # "sampled": again small ids, so that tokens repeat
        counted = [r for r in rows if r.adjustment.counts_tokens]
        if counted:
            penalties.add(torch.tensor([r.slot for r in counted]), torch.from_numpy(tokens[[r.row for r in counted]]))
        for i in range(2):
            outputs[i].append(int(tokens[i]))


def test_a_slot_taken_again_forgets_its_previous_request():
    penalties = SlotPenalties(num_slots=2, vocab_size=VOCAB, device=torch.device("cpu"))
    penalties.start(1, adjustment(frequency=1.0, presence=1.0, repetition=1.5), np.array([4, 5]), [])
    for _ in range(2):
        penalties.add(torch.tensor([1]), torch.tensor([6]))
    assert penalties.subtract is not None and penalties.scale is not None and penalties.occurrences is not None
    assert penalties.subtract[1, 6] == 3.0  # 2 x frequency + presence once
    # Another request, with its output so far (as after a retract): only its tokens count.
    penalties.start(1, adjustment(frequency=0.5, presence=0.25, repetition=1.25), np.array([7]), [9, 9])
    assert penalties.occurrences[1, 9] == 2 and penalties.occurrences.sum() == 2
    assert penalties.subtract[1].nonzero().flatten().tolist() == [9] and penalties.subtract[1, 9] == 1.25
    assert (penalties.scale[1] != 1).nonzero().flatten().tolist() == [7, 9] and penalties.scale[1, 7] == 1.25


# Through the scheduler: batched greedy requests, each adjusted its own way, against transformers' generate.



def sampling(new_tokens: int, frequency=0.0, presence=0.0, repetition=1.0, min_new_tokens=0, stop_ids=frozenset(),
             bias=None) -> SamplingParams:
    """Greedy, to new_tokens unless a stop id ends it first (ignore_eos would ignore stop ids, as SGLang)."""
    return SamplingParams(
        max_new_tokens=new_tokens, temperature=0.0, ignore_eos=not stop_ids, stop_token_ids=sorted(stop_ids),
        frequency_penalty=frequency, presence_penalty=presence, repetition_penalty=repetition,
        min_new_tokens=min_new_tokens, logit_bias=bias or {})


@pytest.mark.slow
def test_batched_adjusted_greedy_matches_transformers(scheduler_client, reference_model):
    rng = np.random.default_rng(2)  # a prompt on which each adjustment changes the greedy output (below)
    prompt = rng.integers(0, SMALL_VOCABULARY, 12).tolist()
    new_tokens = 16
    plain = reference_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                     do_sample=False)[0, 12:].tolist()
    cases = {name: dict(case) for name, case in CASES.items() if name != "min_new_tokens"}
    # A stop token greedy would pick early, held off by min_new_tokens; biases on tokens greedy picks.
    cases["min_new_tokens"] = dict(min_new_tokens=5, stop_ids={plain[1]})
    cases["logit_bias"] = dict(bias={plain[0]: -100.0, plain[2]: -3.0, 7: 1.5})
    cases["everything"] = dict(cases["everything"], stop_ids={plain[0]}, bias={plain[0]: 2.0})
    rids = {name: scheduler_client.submit(input_ids=prompt, sampling=sampling(new_tokens, **case),
                                logprob=LogprobParams(return_logprob=True, logprob_start_len=-1))
            for name, case in cases.items()}
    with torch.no_grad():
        raw = torch.log_softmax(reference_model(torch.tensor([prompt + plain])).logits[0], dim=-1)
    for name, case in cases.items():
        result = scheduler_client.wait(rids[name])
        processors = reference_processors(len(prompt), **case)
        stop = case.get("stop_ids")
        expected = reference_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                      logits_processor=processors, eos_token_id=sorted(stop) if stop else None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        if stop and expected[-1] in stop:
            assert len(expected) >= case["min_new_tokens"]
        assert result.token_ids == expected, name
        assert result.token_ids != plain, name  # the adjustment changed what was generated
        # Logprobs stay the raw distribution's: the first token's, under the unadjusted model.
        first = float(result.output[0].token_logprobs[0])
        assert first == pytest.approx(float(raw[len(prompt) - 1, result.token_ids[0]]), abs=1e-4), name


@pytest.mark.slow
def test_repetition_penalty_reduces_repetition(scheduler_client):
    prompt = np.random.default_rng(2).integers(0, SMALL_VOCABULARY, 8).tolist()

    def distinct(penalty: float) -> int:
        rid = scheduler_client.submit(input_ids=prompt, sampling=sampling(48, repetition=penalty))
        return len(set(scheduler_client.wait(rid).token_ids))

    assert distinct(1.0) < distinct(2.0)


@pytest.mark.slow
def test_a_bias_too_large_for_float32_still_picks_its_token(scheduler_client):
    """A bias of 3e38, divided by a sampled temperature, would be +inf (softmax NaN, token 0 sampled); it
    works as the largest bias: its token always, and a token biased down by as much never."""
    prompt = np.random.default_rng(3).integers(0, SMALL_VOCABULARY, 8).tolist()
    greedy = scheduler_client.wait(scheduler_client.submit(input_ids=prompt, sampling=sampling(4))).token_ids
    for temperature in (0.0, 2e-6, 0.5):
        up = dataclasses.replace(sampling(4, bias={7: 3e38}), temperature=temperature, seed=1)
        assert scheduler_client.wait(scheduler_client.submit(input_ids=prompt, sampling=up)).token_ids == [7] * 4
        two = dataclasses.replace(sampling(8, bias={7: 3e38, 9: 3e38}), temperature=temperature, seed=1)
        assert set(scheduler_client.wait(scheduler_client.submit(input_ids=prompt, sampling=two)).token_ids) <= {7, 9}
    down = dataclasses.replace(sampling(4, bias={greedy[0]: -3e38}), temperature=2e-6, seed=1)
    assert greedy[0] not in scheduler_client.wait(scheduler_client.submit(input_ids=prompt, sampling=down)).token_ids
