"""One model step for a scheduled batch: forward over every row's tokens, then for the rows that sample the
logits, their adjustments and masks, the draw, the logprob rows and the top-p replay nuclei, and for prefill rows
the prompt's logprob rows; one host copy. Launched (`launch_step`: the device's work queued, on CUDA) and then
waited for (`LaunchedStep.result`), so that the engine can do other host work in between."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows

from services.scheduler.model.host_copy import HostRows, copy_to_host
from services.scheduler.sampling.grammar import ConstrainedRow, accept_tokens
from services.scheduler.sampling.logprobs import chunked_logprob_rows
from services.scheduler.sampling.sampler import Sampler
from services.scheduler.step import Batch, BatchRow, StepResult


class Model(Protocol):
    """What a step needs of the model runner (model/runner.py)."""

    device: torch.device
    sampler: Sampler

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


@dataclass
class LaunchedStep:
    """A step whose results are on their way to the host."""

    copy: HostRows
    constrained: list[ConstrainedRow]

    def result(self) -> StepResult:
        """Waits for the copy; advances the constrained rows' grammars by their tokens (the next step's masks)."""
        host_ids, host_output, host_prompt, host_nuclei = self.copy.wait()
        accept_tokens(self.constrained, host_ids)
        return StepResult(next_ids=host_ids, output=host_output, prompt=host_prompt, top_p=host_nuclei)


def launch_step(runner: Model, batch: Batch, chunk_rows: int) -> LaunchedStep:
    rows = batch.rows
    counts = np.array([row.end - row.start for row in rows], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # each row's first flat index
    input_ids = np.concatenate([row_tokens(row) for row in rows])
    positions = np.concatenate([np.arange(row.start, row.end) for row in rows])
    with torch.inference_mode():
        hidden = runner.forward(batch, input_ids, positions)
        sampling = [i for i, row in enumerate(rows) if row.samples]
        last = torch.from_numpy(first[sampling] + counts[sampling] - 1).to(runner.device)
        choice = runner.sampler.choose(runner.logits(hidden[last]), [rows[i].request for i in sampling])
        prompt = _prompt_logprobs(runner, hidden, rows, first, chunk_rows)
        return LaunchedStep(copy_to_host(choice.tokens, choice.output, prompt, choice.nuclei), choice.constrained)


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
