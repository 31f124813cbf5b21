"""Logprob rows of a step's tokens, on the model's device.

A prompt row is float32 log-softmax of the raw logits (no prompt token is sampled). An output row is of the
distribution its request's LogprobsMode names (resolved at submit: RAW, SGLANG or PROCESSED):

- RAW: of the model's logits, before every adjustment, mask and sampling transform (vLLM's raw_logprobs).
- SGLANG: of the logits the sampler drew from (after logit_bias, penalties, min_new_tokens and the grammar's mask)
  divided by the temperature, before top-k, top-p and min-p cut them: SGLang's. A greedy row's are at temperature
  1, as SGLang samples greedy rows (top-k 1 at temperature 1).
- PROCESSED: of the distribution its token was drawn from, renormalized over what the cut kept (ProcessedRows): the
  importance ratio's denominator; what a request with top-p replay gets in SGLANG mode, as SGLang's replay does.

Top-k rows are of the same distribution as the token's logprob, in its order.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from flatwire_wire.logprobs import LogprobRows, LogprobsMode

from services.scheduler.sampling.draw import Draw, SamplingBatch, put


@dataclass
class ProcessedRows:
    """The rows whose output logprobs are of the distribution they were sampled from (LogprobsMode.PROCESSED):
    a sampled row's filtered probabilities renormalized (-inf where the sampler could not draw), a greedy row's
    all on its token (the temperature-0 limit). Only the columns returned are ever computed."""

    rows: list[int]  # of the step's sampling rows
    draw: Draw
    params: SamplingBatch

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


@dataclass
class StepDistributions:
    """What a step's output rows are computed from."""

    logits: torch.Tensor  # [B, V] float32, the model's
    adjusted: torch.Tensor  # [B, V] what the sampler drew from: after the adjustments and masks (`logits` if none)
    draw: Draw
    params: SamplingBatch

    def output_rows(self, modes: list[LogprobsMode], k: int, ids: torch.Tensor) -> LogprobRows[torch.Tensor]:
        """Row i: the logprob of the token drawn, the top-k and the logprobs of `ids[i]` under the distribution
        modes[i] names (RAW, SGLANG or PROCESSED)."""
        tokens, sampled_at = self.draw.tokens, {row: i for i, row in enumerate(self.params.rows)}
        rows = {mode: [i for i, m in enumerate(modes) if m is mode] for mode in LogprobsMode}
        scaled = [i for i in rows[LogprobsMode.SGLANG] if i in sampled_at]
        greedy = [i for i in rows[LogprobsMode.SGLANG] if i not in sampled_at]
        parts = []  # (its rows, their logprob rows)
        if rows[LogprobsMode.RAW]:
            at = rows[LogprobsMode.RAW]
            parts.append((at, logprob_rows(self._of(self.logits, at), self._of(tokens, at), k, self._of(ids, at))))
        if greedy:
            parts.append((greedy, logprob_rows(self._of(self.adjusted, greedy), self._of(tokens, greedy), k,
                                            self._of(ids, greedy))))
        if scaled:
            assert self.draw.scaled is not None  # params.rows were sampled
            of_draw = [sampled_at[i] for i in scaled]
            scaled_logits = self.draw.scaled if of_draw == list(range(len(self.params.rows))) else \
                self.draw.scaled[put(of_draw, torch.long, tokens.device)]
            parts.append((scaled, logprob_rows(scaled_logits, self._of(tokens, scaled), k, self._of(ids, scaled))))
        if rows[LogprobsMode.PROCESSED]:
            at = rows[LogprobsMode.PROCESSED]
            processed = ProcessedRows(at, self.draw, self.params)
            parts.append((at, _processed_rows(processed, self._of(self.adjusted, at), self._of(tokens, at), k,
                                              self._of(ids, at))))
        if len(parts) == 1:  # one distribution for every row, in order
            return parts[0][1]
        merged = LogprobRows(tokens.new_empty(len(modes), dtype=torch.float32),
                             self.logits.new_empty(len(modes), k), tokens.new_empty(len(modes), k),
                             self.logits.new_empty(len(modes), ids.shape[1]))
        for where, part in parts:
            index = put(where, torch.long, tokens.device)
            for field, values in zip(merged.arrays, part.arrays):
                field[index] = values
        return merged

    @staticmethod
    def _of(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`tensor`'s `rows` (itself when they are all of them, in order: no copy of a [B, V] tensor)."""
        if rows == list(range(tensor.shape[0])):
            return tensor
        return tensor[put(rows, torch.long, tensor.device)]


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int, ids: torch.Tensor) -> LogprobRows[torch.Tensor]:
    """Logprob of `tokens` [R], top-k, and logprobs of `ids` [R, n] under float32 logits [R, V]: log-softmax at the
    columns returned only (logit - logsumexp), never a [R, V] tensor of logprobs."""
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
