"""One model step for a scheduled batch: forward over every row's tokens, then for the rows that sample the
logits, their adjustments and masks, the draw and the logprob rows, and for prefill rows the prompt's logprob
rows; one host copy. Launched (`launch_step`: the device's work queued, on CUDA) and then waited for
(`LaunchedStep.result`), so that the engine can do other host work in between."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows

from services.scheduler.model.host_copy import HostRows, copy_to_host
from services.scheduler.request import Request
from services.scheduler.sampling.grammar import ConstrainedRow, TokenMask, accept_tokens
from services.scheduler.sampling.logit_adjust import AdjustedRow, SlotPenalties, adjust_logits
from services.scheduler.sampling.sampler import (
    Draw,
    ProcessedRows,
    SamplingBatch,
    chunked_logprob_rows,
    logprob_rows,
    sample,
)
from services.scheduler.step import Batch, BatchRow, StepResult


class Model(Protocol):
    """What a step needs of the model runner (model/runner.py)."""

    device: torch.device
    penalties: SlotPenalties
    token_mask: TokenMask

    def forward(self, batch: Batch, input_ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's tokens (each row's, in row order)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the given hidden rows."""


def row_tokens(row: BatchRow) -> np.ndarray:
    """The token ids at positions [start, end) of the row's sequence (prompt, then output)."""
    request = row.request
    if row.end <= request.prompt_len:
        return request.input_ids[row.start:row.end]
    if row.end - row.start == 1:  # a decoding row: its last output token
        return np.array([request.output_ids[row.start - request.prompt_len]], dtype=np.int64)
    return request.sequence()[row.start:row.end]


def _padded_ids(requests: list[Request], device) -> torch.Tensor:
    """token_ids_logprob of each row, zero-padded to the longest list: [B, n_max]."""
    width = max((len(r.token_ids_logprob) for r in requests), default=0)
    ids = np.zeros((len(requests), width), dtype=np.int64)
    for row, request in enumerate(requests):
        ids[row, :len(request.token_ids_logprob)] = request.token_ids_logprob
    return torch.from_numpy(ids).to(device)


@dataclass
class LaunchedStep:
    """A step whose results are on their way to the host."""

    copy: HostRows
    constrained: list[ConstrainedRow]

    def result(self) -> StepResult:
        """Waits for the copy; advances the constrained rows' grammars by their tokens (the next step's masks)."""
        host_ids, host_output, host_prompt = self.copy.wait()
        accept_tokens(self.constrained, host_ids)
        return StepResult(next_ids=host_ids, output=host_output, prompt=host_prompt)


def launch_step(runner: Model, batch: Batch, chunk_rows: int) -> LaunchedStep:
    rows = batch.rows
    counts = np.array([row.end - row.start for row in rows], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # each row's first flat index
    input_ids = np.concatenate([row_tokens(row) for row in rows])
    positions = np.concatenate([np.arange(row.start, row.end) for row in rows])
    with torch.inference_mode():
        hidden = runner.forward(batch, input_ids, positions)
        sampling = [i for i, row in enumerate(rows) if row.samples]
        requests = [rows[i].request for i in sampling]
        last = torch.from_numpy(first[sampling] + counts[sampling] - 1).to(runner.device)
        logits = runner.logits(hidden[last])
        sampled = [(i, r) for i, r in enumerate(requests) if r.temperature > 0]
        params = SamplingBatch(
            rows=[i for i, _ in sampled], temperature=[r.temperature for _, r in sampled],
            top_p=[r.top_p for _, r in sampled], top_k=[r.top_k for _, r in sampled],
            min_p=[r.min_p for _, r in sampled], generators=[r.generator(runner.device) for _, r in sampled])
        constrained = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
        draw, adjusted = _sample_adjusted(logits, requests, params, runner.penalties, runner.token_mask, constrained)
        next_ids = draw.tokens
        output = None
        if any(r.return_logprob for r in requests):
            processed = [i for i, r in enumerate(requests) if r.processed_logprobs]
            output = logprob_rows(logits, next_ids, max(r.top_logprobs_num for r in requests),
                                  _padded_ids(requests, runner.device),
                                  ProcessedRows(processed, draw, params, adjusted) if processed else None)
        prompt = _prompt_logprobs(runner, hidden, rows, first, chunk_rows)
        return LaunchedStep(copy_to_host(next_ids, output, prompt), constrained)


def _sample_adjusted(logits: torch.Tensor, requests: list[Request], params: SamplingBatch, penalties: SlotPenalties,
                     mask: TokenMask, constrained: list[ConstrainedRow]) -> tuple[Draw, torch.Tensor]:
    """Next tokens sampled from the logits as each request adjusts them (logit_adjust.py), then as the
    `constrained` rows' grammars allow (grammar.py), and the logits so adjusted; raw logprobs are taken from
    the unadjusted `logits`."""
    for request in requests:
        if not request.sampling_ready:  # it took its slot since it last sampled: the slot's penalties are not its
            if request.adjustment is not None and request.adjustment.counts_tokens:
                penalties.start(request.slot, request.adjustment, request.input_ids, request.output_ids)
            request.sampling_ready = True
    adjusted = [AdjustedRow(i, r.slot, len(r.output_ids), r.adjustment) for i, r in enumerate(requests)
                if r.adjustment is not None]
    to_sample = adjust_logits(logits, adjusted, penalties)
    if constrained:  # masked in place: on a copy of `logits` unless the adjustments made one
        to_sample = mask.apply(to_sample if adjusted else logits.clone(), constrained)
    draw = sample(to_sample, params)
    counted = [a for a in adjusted if a.adjustment.counts_tokens]
    if counted:
        device = logits.device
        penalties.add(torch.tensor([a.slot for a in counted], device=device),
                      draw.tokens[torch.tensor([a.row for a in counted], device=device)])
    return draw, to_sample


def _prompt_logprobs(runner: Model, hidden: torch.Tensor, rows: list[BatchRow], first: np.ndarray,
                     chunk_rows: int) -> list[LogprobRows[torch.Tensor]]:
    """The prompt logprob rows each row computes (BatchRow.prompt_positions), in row order: position q's row
    comes from the hidden state at q - 1."""
    parts = []
    for row, begin in zip(rows, first.tolist()):
        positions = row.prompt_positions
        if not len(positions):
            continue
        request = row.request
        targets = torch.from_numpy(request.input_ids[positions.start:positions.stop]).to(runner.device)
        ids = torch.tensor([request.token_ids_logprob], dtype=torch.long, device=runner.device)
        at = begin + positions.start - 1 - row.start  # the flat row of the hidden state at positions.start - 1
        parts.append(chunked_logprob_rows(hidden[at:at + len(positions)], targets, request.top_logprobs_num, ids,
                                          runner.logits, chunk_rows))
    return parts
