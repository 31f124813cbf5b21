"""One model step for a scheduled batch: forward, logprobs, sampling, one host copy."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows

from services.scheduler.model.host_copy import copy_to_host
from services.scheduler.request import Request
from services.scheduler.sampling.grammar import ConstrainedRow, TokenMask, accept_tokens
from services.scheduler.sampling.logit_adjust import AdjustedRow, SlotPenalties, adjust_logits
from services.scheduler.sampling.sampler import SamplingBatch, chunked_logprob_rows, logprob_rows, sample
from services.scheduler.step import StepResult


@dataclass
class StepTokens:
    """The step's flat sequence: decode tokens first, then whole prompts."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    decode_lengths: np.ndarray  # [num_decode] sequence length (position + 1) of each decode token
    prefill_lengths: np.ndarray  # [num_prefill]


def _flat_tokens(decode: list[Request], prefill: list[Request]) -> StepTokens:
    prefill_ids = [r.prefill_ids for r in prefill]
    lengths = np.array([len(ids) for ids in prefill_ids], dtype=np.int64)
    return StepTokens(
        input_ids=np.concatenate([np.array([r.output_ids[-1] for r in decode], dtype=np.int64), *prefill_ids]),
        positions=np.concatenate([np.array([r.length - 1 for r in decode], dtype=np.int64),
                                  *(np.arange(n) for n in lengths)]),
        slots=np.concatenate([np.array([r.slot for r in decode], dtype=np.int64),
                              np.repeat(np.array([r.slot for r in prefill], dtype=np.int64), lengths)]),
        decode_lengths=np.array([r.length for r in decode], dtype=np.int64),
        prefill_lengths=lengths,
    )


class Model(Protocol):
    """What a step needs of the model runner (model/runner.py)."""

    device: torch.device
    penalties: SlotPenalties
    token_mask: TokenMask
    def forward(self, step: StepTokens) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's tokens."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the given hidden rows."""


def _padded_ids(requests: list[Request], device) -> torch.Tensor:
    """token_ids_logprob of each row, zero-padded to the longest list: [B, n_max]."""
    width = max((len(r.token_ids_logprob) for r in requests), default=0)
    ids = np.zeros((len(requests), width), dtype=np.int64)
    for row, request in enumerate(requests):
        ids[row, :len(request.token_ids_logprob)] = request.token_ids_logprob
    return torch.from_numpy(ids).to(device)


def run_step(runner: Model, decode: list[Request], prefill: list[Request], chunk_rows: int) -> StepResult:
    """Rows are decode requests then prefill requests."""
    rows = decode + prefill
    step = _flat_tokens(decode, prefill)
    with torch.inference_mode():
        hidden = runner.forward(step)
        prompt_ends = len(decode) + np.cumsum(step.prefill_lengths)
        last_rows = torch.from_numpy(np.concatenate([np.arange(len(decode)), prompt_ends - 1])).to(runner.device)
        logits = runner.logits(hidden[last_rows])
        sampled = [(i, r) for i, r in enumerate(rows) if r.temperature > 0]
        params = SamplingBatch(
            rows=[i for i, _ in sampled], temperature=[r.temperature for _, r in sampled],
            top_p=[r.top_p for _, r in sampled], top_k=[r.top_k for _, r in sampled],
            min_p=[r.min_p for _, r in sampled], generators=[r.generator(runner.device) for _, r in sampled])
        constrained = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
        next_ids = _sample_adjusted(logits, rows, prefill, params, runner.penalties, runner.token_mask,
                                    constrained)
        output = None
        if any(r.return_logprob for r in rows):
            output = logprob_rows(logits, next_ids, max(r.top_logprobs_num for r in rows),
                                  _padded_ids(rows, runner.device))
        prompt = _prompt_logprobs(runner, hidden, prefill, prompt_ends, chunk_rows)
        host_ids, host_output, host_prompt = copy_to_host(next_ids, output, prompt)
        accept_tokens(constrained, host_ids)
        return StepResult(next_ids=host_ids, output=host_output, prompt=host_prompt)


def _sample_adjusted(logits: torch.Tensor, rows: list[Request], prefill: list[Request], params: SamplingBatch,
                     penalties: SlotPenalties, mask: TokenMask,
                     constrained: list[ConstrainedRow]) -> torch.Tensor:
    """Next tokens sampled from the logits as each request adjusts them (logit_adjust.py), then as the
    `constrained` rows' grammars allow (grammar.py); logprobs are taken from the unadjusted `logits`."""
    for request in prefill:
        if request.adjustment is not None and request.adjustment.counts_tokens:
            penalties.start(request.slot, request.adjustment, request.input_ids, request.output_ids)
    adjusted = [AdjustedRow(i, r.slot, len(r.output_ids), r.adjustment) for i, r in enumerate(rows)
                if r.adjustment is not None]
    to_sample = adjust_logits(logits, adjusted, penalties)
    if constrained:  # masked in place: on a copy of `logits` unless the adjustments made one
        to_sample = mask.apply(to_sample if adjusted else logits.clone(), constrained)
    next_ids = sample(to_sample, params)
    counted = [a for a in adjusted if a.adjustment.counts_tokens]
    if counted:
        device = logits.device
        penalties.add(torch.tensor([a.slot for a in counted], device=device),
                   next_ids[torch.tensor([a.row for a in counted], device=device)])
    return next_ids


def _prompt_logprobs(runner: Model, hidden: torch.Tensor, prefill: list[Request], prompt_ends: np.ndarray,
                     chunk_rows: int) -> list[LogprobRows[torch.Tensor]]:
    """Prompt logprob rows of each prefill owing them, in request order.

    Position p's logprob comes from the hidden state at p - 1, for p in [start, L).
    """
    parts = []
    for request, end in zip(prefill, prompt_ends.tolist()):
        if not request.owes_prompt_logprobs:
            continue
        first = request.prompt_logprob_start
        begin = end - len(request.prefill_ids)  # the request's first row in the flat sequence
        targets = torch.from_numpy(request.input_ids[first:]).to(runner.device)
        ids = torch.tensor([request.token_ids_logprob], dtype=torch.long, device=runner.device)
        prompt_end = begin + request.prompt_len
        parts.append(chunked_logprob_rows(hidden[begin + first - 1:prompt_end - 1], targets,
                                          request.top_logprobs_num, ids, runner.logits, chunk_rows))
    return parts
