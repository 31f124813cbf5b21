"""The sampler: how a step's sampling rows choose their next tokens, and the per-slot state that needs.

For each row, in order: the request's logit adjustments (logit_adjust.py: logit_bias, penalties, min_new_tokens),
its grammar's mask (grammar.py: structured output), then the draw (draw.py: temperature, top-k, top-p, min-p,
the exponential race); the output logprob rows (logprobs.py) are of the distribution each request's LogprobsMode
names, and a request with top-p replay gets the nucleus its token was drawn from (draw.nuclei).

The penalties need each request's tokens so far: they live per request slot (SlotPenalties). A slot's state
names the request it counts and how many of its tokens it holds, so a request that takes a slot anew (a new
request, or one resumed after a retract, with its output so far) has the slot's state started from its tokens
before it samples, and one that comes back to the slot it left finds its own state there.
"""

from dataclasses import dataclass

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows

from services.scheduler.request import Request
from services.scheduler.sampling.draw import Draw, SamplingBatch, nuclei, sample
from services.scheduler.sampling.grammar import ConstrainedRow, TokenMask
from services.scheduler.sampling.logit_adjust import AdjustedRow, SlotPenalties, adjust_logits
from services.scheduler.sampling.logprobs import StepDistributions


@dataclass
class Choice:
    """What a step's sampling rows chose."""

    tokens: torch.Tensor  # [B] next token per row
    output: LogprobRows[torch.Tensor] | None  # their logprob rows, when one of them asked
    constrained: list[ConstrainedRow]  # rows whose grammar advances by its token once it is on the host
    # Top-p replay: the nuclei (sizes, ids) of the rows whose request asked (draw.nuclei), in row order
    nuclei: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.device = device
        self.vocab_size = vocab_size
        self.penalties = SlotPenalties(num_slots, vocab_size, device)
        self.token_mask = TokenMask(num_slots, vocab_size, device)
        self._counted: list[tuple[Request, int] | None] = [None] * num_slots  # per slot: whose tokens, how many

    def choose(self, logits: torch.Tensor, requests: list[Request]) -> Choice:
        """The next token of each request from its row of float32 `logits` [B, V], and the logprob rows."""
        params = SamplingBatch.of([(i, r.sampling, r.generator(self.device)) for i, r in enumerate(requests)
                                   if not r.sampling.greedy])
        constrained = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
        draw, adjusted = self._draw(logits, requests, params, constrained)
        output = None
        if any(r.return_logprob for r in requests):
            output = StepDistributions(logits, adjusted, draw, params).output_rows(
                [r.logprobs_mode for r in requests], max(r.top_logprobs_num for r in requests),
                _padded_ids(requests, self.device))
        replayed = [i for i, r in enumerate(requests) if r.return_top_p_token_ids]
        return Choice(draw.tokens, output, constrained,
                      nuclei(draw, params, replayed, self.vocab_size) if replayed else None)

    def _draw(self, logits: torch.Tensor, requests: list[Request], params: SamplingBatch,
              constrained: list[ConstrainedRow]) -> tuple[Draw, torch.Tensor]:
        """Next tokens sampled from the logits as each request adjusts them, then as the `constrained` rows'
        grammars allow, and the logits so adjusted; raw logprobs are taken from the unadjusted `logits`."""
        adjusted = [AdjustedRow(i, r.slot, len(r.output_ids), r.adjustment) for i, r in enumerate(requests)
                    if r.adjustment is not None]
        counted = [a for a in adjusted if a.adjustment.counts_tokens]
        for row in counted:
            self._bind(requests[row.row])
        to_sample = adjust_logits(logits, adjusted, self.penalties)
        if constrained:  # masked in place: on a copy of `logits` unless the adjustments made one
            to_sample = self.token_mask.apply(to_sample if adjusted else logits.clone(), constrained)
        draw = sample(to_sample, params)
        if counted:
            self.penalties.add(torch.tensor([a.slot for a in counted], device=self.device),
                               draw.tokens[torch.tensor([a.row for a in counted], device=self.device)])
            for row in counted:
                request = requests[row.row]
                self._counted[request.slot] = (request, request.length + 1)  # with the token just drawn
        return draw, to_sample

    def _bind(self, request: Request) -> None:
        """The request's slot counts its tokens so far: started from them unless it already does."""
        held = self._counted[request.slot]
        if held is None or held[0] is not request or held[1] != request.length:
            assert request.adjustment is not None
            self.penalties.start(request.slot, request.adjustment, request.input_ids, request.output_ids)
            self._counted[request.slot] = (request, request.length)


def _padded_ids(requests: list[Request], device: torch.device) -> torch.Tensor:
    """token_ids_logprob of each row, zero-padded to the longest list: [B, n_max]."""
    width = max((len(r.token_ids_logprob) for r in requests), default=0)
    ids = np.zeros((len(requests), width), dtype=np.int64)
    for row, request in enumerate(requests):
        ids[row, :len(request.token_ids_logprob)] = request.token_ids_logprob
    return torch.from_numpy(ids).to(device)
