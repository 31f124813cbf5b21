"""Logprobs and sampling for a step's rows, all on the model's device.

Logprobs are float32 log-softmax of the raw logits: the model's distribution before
temperature, top-p, top-k or min-p (vLLM's default, `raw_logprobs`); a request in
`processed_logprobs` mode gets those of the distribution its token was drawn from
(ProcessedRows): what RL trainers need for the importance ratio.

Sampling draws argmax(p / E) with E ~ Exp(1) per vocabulary entry (the exponential
race, equivalent to sampling from p; vLLM's sampler does the same). A seeded request
draws E from its own generator, and every transform below is computed per row, so it
samples the same tokens whatever else is in the batch. The race is also robust to
the last-bit differences that batched kernels introduce, where an inverse-CDF draw
over a flat distribution would flip between neighbouring tokens.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from flatwire_wire.logprobs import LogprobRows

NUCLEUS_HEAD = 1024  # top-p looks at this many best tokens first


@dataclass
class SamplingBatch:
    """Sampling parameters of the step's non-greedy rows, as host lists: every decision
    below (which rows, which transforms, how many candidates) is made without a device sync."""

    rows: list[int]  # indices of rows with temperature > 0
    temperature: list[float]
    top_p: list[float]  # 1: off
    top_k: list[int]  # 0: off
    min_p: list[float]  # 0: off
    generators: list[torch.Generator | None]  # per-request streams; None: the default generator


def _put(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass
class Draw:
    """A step's sampled tokens, and the distribution the sampled rows drew them from."""

    tokens: torch.Tensor  # [B] next token per row
    probs: torch.Tensor | None  # [len(params.rows), V] the sampled rows' filtered probabilities, not normalized


def sample(logits: torch.Tensor, params: SamplingBatch) -> Draw:
    """Next token per row of float32 logits [B, V]; rows not in params.rows are greedy."""
    tokens = logits.argmax(dim=-1)
    if not params.rows:
        return Draw(tokens, None)
    rows = _put(params.rows, torch.long, logits.device)
    temperature = _put(params.temperature, torch.float32, logits.device)
    probs = torch.softmax(logits[rows] / temperature.unsqueeze(1), dim=-1)
    probs = _keep_top_k(probs, params.top_k)
    probs = _keep_top_p(probs, params.top_p)
    if any(min_p > 0 for min_p in params.min_p):
        floor = _put(params.min_p, torch.float32, probs.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    tokens[rows] = (probs / _exponential_noise(params.generators, probs)).argmax(dim=-1)
    return Draw(tokens, probs)


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
        tokens = self.draw.tokens[_put(self.rows, torch.long, device)].unsqueeze(1)
        out = torch.full(columns.shape, -torch.inf, device=device).masked_fill_(columns == tokens, 0.0)
        sampled_at = {row: i for i, row in enumerate(self.params.rows)}
        pairs = [(j, sampled_at[row]) for j, row in enumerate(self.rows) if row in sampled_at]
        if pairs:
            probs = self.draw.probs
            assert probs is not None  # params.rows were sampled
            mine, theirs = (_put(list(side), torch.long, device) for side in zip(*pairs))
            index = torch.zeros(probs.shape[0], columns.shape[1], dtype=torch.long, device=device)
            index[theirs] = columns[mine]
            picked = probs.gather(1, index)[theirs] / probs.sum(dim=-1, keepdim=True)[theirs]
            out[mine] = picked.log_()
        return out


def _exponential_noise(generators: list[torch.Generator | None], like: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws shaped like `like` [S, V]; row i from generators[i]."""
    uniforms = torch.empty_like(like)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        uniforms[shared] = torch.rand(len(shared), like.shape[1], device=like.device, dtype=like.dtype)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row].uniform_(generator=generator)
    return uniforms.log_().neg_()  # -log(0) = inf only zeroes that entry's score


def _threshold(rows: list[int], values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[S, 1] per-row floor: `values` on `rows`, 0 (keep everything) elsewhere."""
    threshold = torch.zeros(like.shape[0], 1, dtype=like.dtype, device=like.device)
    threshold[rows] = values
    return threshold


def _keep_top_k(probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    rows = [i for i, k in enumerate(top_k) if k > 0]
    if not rows:
        return probs
    k = [min(top_k[i], probs.shape[-1]) for i in rows]
    kth = probs[rows].topk(max(k), dim=-1).values.gather(1, _put(k, torch.long, probs.device).unsqueeze(1) - 1)
    return probs.masked_fill(probs < _threshold(rows, kth, probs), 0.0)


def _keep_top_p(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    rows = [i for i, p in enumerate(top_p) if p < 1]
    if not rows:
        return probs
    candidates = probs[rows]
    limit = _put([top_p[i] for i in rows], torch.float32, probs.device).unsqueeze(1) * candidates.sum(-1, keepdim=True)
    # A real model's nucleus is usually small: sort only the head when it holds enough mass.
    ordered = candidates.topk(min(NUCLEUS_HEAD, candidates.shape[-1]), dim=-1).values
    if not bool((ordered.sum(dim=-1, keepdim=True) >= limit).all()):
        ordered = candidates.sort(dim=-1, descending=True).values
    mass_before = ordered.cumsum(dim=-1) - ordered
    kept = (mass_before < limit).sum(dim=-1, keepdim=True).clamp_min(1)
    return probs.masked_fill(probs < _threshold(rows, ordered.gather(1, kept - 1), probs), 0.0)


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
    at, raw_at = (_put(side, torch.long, logits.device) for side in (processed.rows, raw))
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
