"""Logprob rows of a step's tokens, on the model's device.

Logprobs are float32 log-softmax of the raw logits: the model's distribution before
temperature, top-p, top-k or min-p (vLLM's default, `raw_logprobs`); a request in
`processed_logprobs` mode gets those of the distribution its token was drawn from
(ProcessedRows): what RL trainers need for the importance ratio.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from flatwire_wire.logprobs import LogprobRows

from services.scheduler.sampling.draw import Draw, SamplingBatch, put


@dataclass
class ProcessedRows:
    """The rows whose output logprobs are of the distribution they were sampled from (LogprobsMode.PROCESSED):
    a sampled row's filtered probabilities renormalized (-inf where the sampler could not draw), a greedy row's
    all on its token (the temperature-0 limit). Only the columns returned are ever computed."""

    rows: list[int]  # of the step's sampling rows
    draw: Draw
    params: SamplingBatch
    adjusted: torch.Tensor  # [B, V] the logits drawn from: they order the top-k, the undrawable ones too

    def logprobs_at(self, columns: torch.Tensor) -> torch.Tensor:
        """[len(rows), c]: the log-probability of each row's distribution at `columns` [len(rows), c]."""
        device = columns.device
        tokens = self.draw.tokens[put(self.rows, torch.long, device)].unsqueeze(1)
        out = torch.full(columns.shape, -torch.inf, device=device).masked_fill_(columns == tokens, 0.0)
        sampled_at = {row: i for i, row in enumerate(self.params.rows)}
        pairs = [(j, sampled_at[row]) for j, row in enumerate(self.rows) if row in sampled_at]
        if pairs:
            probs = self.draw.probs
            assert probs is not None  # params.rows were sampled
            mine, theirs = (put(list(side), torch.long, device) for side in zip(*pairs))
            index = torch.zeros(probs.shape[0], columns.shape[1], dtype=torch.long, device=device)
            index[theirs] = columns[mine]
            picked = probs.gather(1, index)[theirs] / probs.sum(dim=-1, keepdim=True)[theirs]
            out[mine] = picked.log_()
        return out


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int, ids: torch.Tensor,
                 processed: ProcessedRows | None = None) -> LogprobRows[torch.Tensor]:
    """Logprob of `tokens` [R], top-k, and logprobs of `ids` [R, n] under float32 logits [R, V], or for the
    `processed` rows under the distribution they were sampled from."""
    if processed is None:
        return _raw_rows(logits, tokens, k, ids)
    rows = len(tokens)
    raw = sorted(set(range(rows)) - set(processed.rows))
    if not raw:
        return _processed_rows(processed, processed.adjusted, tokens, k, ids)
    at, raw_at = (put(side, torch.long, logits.device) for side in (processed.rows, raw))
    parts = [(at, _processed_rows(processed, processed.adjusted[at], tokens[at], k, ids[at])),
             (raw_at, _raw_rows(logits[raw_at], tokens[raw_at], k, ids[raw_at]))]
    merged = LogprobRows(tokens.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, k),
                         tokens.new_empty(rows, k), logits.new_empty(rows, ids.shape[1]))
    for where, part in parts:
        for field, values in zip(merged.arrays, part.arrays):
            field[where] = values
    return merged


def _raw_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int, ids: torch.Tensor) -> LogprobRows[torch.Tensor]:
    """log-softmax at the columns returned only: logit - logsumexp, never a [R, V] tensor of logprobs."""
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    values, top_ids = logits.topk(k, dim=-1) if k else (logits[:, :0], tokens.new_empty(len(tokens), 0))
    return LogprobRows(
        token_logprobs=(logits.gather(1, tokens.unsqueeze(1)) - normalizer).squeeze(1),
        topk_values=values - normalizer,
        topk_ids=top_ids,
        ids_logprobs=logits.gather(1, ids) - normalizer,
    )


def _processed_rows(processed: ProcessedRows, ranking: torch.Tensor, tokens: torch.Tensor, k: int,
                    ids: torch.Tensor) -> LogprobRows[torch.Tensor]:
    """The processed rows' logprob rows; `ranking`: their adjusted logits (the top-k's order)."""
    top_ids = ranking.topk(k, dim=-1).indices if k else tokens.new_empty(len(tokens), 0)
    values = processed.logprobs_at(torch.cat([tokens.unsqueeze(1), top_ids, ids], dim=1))
    return LogprobRows(token_logprobs=values[:, 0], topk_values=values[:, 1:1 + k], topk_ids=top_ids,
                       ids_logprobs=values[:, 1 + k:])


def chunked_logprob_rows(hidden: torch.Tensor, tokens: torch.Tensor, k: int, ids: torch.Tensor,
                         to_logits: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int
                         ) -> LogprobRows[torch.Tensor]:
    """logprob_rows over many positions, `chunk_rows` at a time, so [rows, vocab] never exists at once."""
    parts = [logprob_rows(to_logits(hidden[first:first + chunk_rows]), tokens[first:first + chunk_rows], k,
                          ids.expand(min(chunk_rows, len(tokens) - first), -1))
             for first in range(0, max(len(tokens), 1), chunk_rows)]  # one (empty) part when no rows
    return LogprobRows(*(torch.cat(field) for field in zip(*(p.arrays for p in parts))))
