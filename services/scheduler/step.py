"""One step as the engine sees it: what it runs on (a StepRunner: the model, or the synthetic stand-in) and what
it returns (StepResult, the step's host arrays)."""

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows

from services.scheduler.model.kv_cache import SlotPool
from services.scheduler.request import Request


@dataclass
class StepResult:
    """What one step over `decode` then `prefill` rows produced, on the host."""

    next_ids: np.ndarray  # [rows] the token each row sampled
    # [rows] logprob rows at the widest requesting row's width (k, m); None when no row asked for logprobs
    output: LogprobRows[np.ndarray] | None = None
    # per prefill row that owes prompt logprobs, in row order: its rows for positions [prompt_logprob_start, L)
    prompt: list[LogprobRows[np.ndarray]] = field(default_factory=list)


class StepRunner(Protocol):
    """What the engine runs steps on: the model (model/runner.py) or a stand-in (model/synthetic.py)."""

    max_context: int
    vocab_size: int
    eos_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype

    @property
    def cache(self) -> SlotPool:  # read-only here, so that the model's SlotKVCache qualifies
        ...

    def step(self, decode: list[Request], prefill: list[Request]) -> StepResult:
        """One step: a token for each of `decode` (running) and `prefill` (just admitted) rows."""
        ...
