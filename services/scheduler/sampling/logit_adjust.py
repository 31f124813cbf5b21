"""What a request changes in the logits its next token is chosen from: logit_bias, min_new_tokens, and
the repetition, frequency and presence penalties (SGLang's and OpenAI's fields, with vLLM's result: bias,
then repetition, then frequency and presence; min_new_tokens' -inf goes last, which no penalty changes).

Everything runs on the model's device over the step's adjusted rows at once. The penalties need each
request's tokens: they live per KV slot as [slots, vocab] tensors of the penalties themselves (SlotPenalties),
set when a request takes the slot and updated with a few scatters per step for the tokens just sampled, so no
step reads a request's output on the host. The logprobs a request gets back are not adjusted: they stay the model's raw
distribution (sampler.py).
"""

from dataclasses import dataclass

import numpy as np
import torch
from flatwire_wire.sampling import SamplingOptions

# A bias beyond this works as this: the token is always (or never) chosen. Bounded so that the biased logit,
# divided by the smallest temperature that is sampled (flatwire_wire.sampling.GREEDY_BELOW_TEMPERATURE), stays a
# finite float32: a token biased to +inf would turn softmax's every probability into NaN and sample token 0.
MAX_BIAS = 1e30


@dataclass(frozen=True)
class LogitAdjustment:
    """One request's adjustments (its options' penalties, min_new_tokens and logit_bias) as the device applies them;
    a request without any has none (Request.adjustment is None)."""

    options: SamplingOptions
    blocked_early: np.ndarray  # int64 token ids not sampled before min_new_tokens (eos, stop_token_ids)
    bias_ids: np.ndarray  # int64
    bias_values: np.ndarray  # float32, added to the logits of bias_ids

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty depends on the tokens seen so far."""
        options = self.options
        return options.frequency_penalty != 0 or options.presence_penalty != 0 or options.repetition_penalty != 1

    @classmethod
    def of(cls, options: SamplingOptions, stop_ids: frozenset[int]) -> "LogitAdjustment | None":
        """The adjustment of a request with these options and stop tokens, or None when its options ask for none."""
        bias = options.logit_bias
        adjustment = cls(options, blocked_early=np.array(sorted(stop_ids), dtype=np.int64),
                         bias_ids=np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
                         bias_values=np.clip(np.fromiter(bias.values(), dtype=np.float64, count=len(bias)),
                                             -MAX_BIAS, MAX_BIAS).astype(np.float32))
        if adjustment.counts_tokens or options.min_new_tokens > 0 or bias:
            return adjustment
        return None


class SlotPenalties:
    """Per KV slot, the penalties of the request that holds it, kept up to date as it samples (SGLang's
    cumulated penalties), so that applying them is one or two passes over a row:

    - `subtract` [slots, V]: frequency_penalty x occurrences + presence_penalty x (occurs), over the output;
    - `scale` [slots, V]: repetition_penalty at the tokens of the prompt or the output, 1 elsewhere;
    - `occurrences` [slots, V]: output counts, for the presence term.

    Allocated on first use (three float32 [slots, vocab]): servers that never see a penalty pay nothing.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.shape = (num_slots, vocab_size)
        self.device = device
        self.occurrences: torch.Tensor | None = None
        self.subtract: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        # The slot's request's penalties, for add() to read on the device.
        self.frequency = torch.zeros(num_slots, device=device)
        self.presence = torch.zeros(num_slots, device=device)
        self.repetition = torch.ones(num_slots, device=device)

    def start(self, slot: int, adjustment: LogitAdjustment, prompt: np.ndarray, output: list[int]) -> None:
        """A request with a penalty takes `slot` (anew, after a retract, with its output so far): forget the
        slot's previous owner, count the request's tokens."""
        if self.occurrences is None or self.subtract is None or self.scale is None:
            self.occurrences, self.subtract, self.scale = (
                torch.zeros(self.shape, dtype=torch.float32, device=self.device) for _ in range(3))
        options = adjustment.options
        self.frequency[slot] = options.frequency_penalty
        self.presence[slot] = options.presence_penalty
        self.repetition[slot] = options.repetition_penalty
        self.occurrences[slot].zero_()
        self.scale[slot].fill_(1.0)
        seen = np.concatenate([prompt, np.asarray(output, dtype=np.int64)])
        self.scale[slot, torch.from_numpy(seen).to(self.device)] = options.repetition_penalty
        if output:
            tokens = torch.tensor(output, dtype=torch.long, device=self.device)
            self.occurrences[slot].index_put_((tokens,), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        occurrences = self.occurrences[slot]
        self.subtract[slot] = (options.frequency_penalty * occurrences
                               + options.presence_penalty * occurrences.clamp(max=1))

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each slot's newly sampled token (one per slot) into its penalties."""
        assert self.occurrences is not None and self.subtract is not None and self.scale is not None, \
            "start() comes first"
        first = self.occurrences[slots, tokens] == 0
        self.occurrences.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        self.subtract.index_put_((slots, tokens), self.frequency[slots] + self.presence[slots] * first,
                                 accumulate=True)
        self.scale.index_put_((slots, tokens), self.repetition[slots])


@dataclass
class AdjustedRow:
    row: int  # in the step's logits
    slot: int
    output_len: int  # tokens generated before this step's
    adjustment: LogitAdjustment


def adjust_logits(logits: torch.Tensor, rows: list[AdjustedRow], penalties: SlotPenalties) -> torch.Tensor:
    """A copy of float32 logits [B, V] with each row's adjustment applied (`logits` itself when none)."""
    if not rows:
        return logits
    adjusted = logits.clone()
    _add_sparse(adjusted, [(r.row, r.adjustment.bias_ids, r.adjustment.bias_values) for r in rows])
    penalised = [r for r in rows if r.adjustment.counts_tokens]
    if penalised:
        adjusted.index_copy_(0, _tensor([r.row for r in penalised], logits.device, torch.long),
                             _penalise(adjusted, penalised, penalties))
    # Last, so that every penalty above works on finite logits; a penalty keeps -inf anyway.
    early = [r for r in rows if r.output_len < r.adjustment.options.min_new_tokens]
    _add_sparse(adjusted, [(r.row, r.adjustment.blocked_early, np.full(len(r.adjustment.blocked_early), -np.inf,
                                                                       dtype=np.float32)) for r in early])
    return adjusted


def _tensor(values: list, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _penalise(logits: torch.Tensor, rows: list[AdjustedRow], penalties: SlotPenalties) -> torch.Tensor:
    """The penalised logits of `rows` [R, V]: repetition (on prompt and output tokens), then frequency and
    presence (on output tokens)."""
    assert penalties.subtract is not None and penalties.scale is not None, "the slots were started"
    device = logits.device
    slots = _tensor([r.slot for r in rows], device, torch.long)
    values = logits.index_select(0, _tensor([r.row for r in rows], device, torch.long))
    options = [r.adjustment.options for r in rows]
    if any(o.repetition_penalty != 1 for o in options):
        # logit / p where positive, logit * p otherwise (p is 1 at unseen tokens), in float arithmetic.
        scale = penalties.scale.index_select(0, slots)
        values = values.clamp(min=0) / scale + values.clamp(max=0) * scale
    if any(o.frequency_penalty or o.presence_penalty for o in options):
        values = values - penalties.subtract.index_select(0, slots)
    return values


def _add_sparse(logits: torch.Tensor, entries: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
    """logits[row, ids] += values for each (row, ids, values), in one scatter."""
    entries = [entry for entry in entries if len(entry[1])]
    if not entries:
        return
    rows = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, ids, _ in entries])
    ids = np.concatenate([ids for _, ids, _ in entries])
    values = np.concatenate([values for _, _, values in entries])
    device = logits.device
    logits.index_put_((torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device)),
                      torch.from_numpy(values).to(device), accumulate=True)
