"""One step as the engine sees it: what it computes (a Batch of rows, from the scheduling policy), what it runs on
(a StepRunner: the model, or the synthetic stand-in) and what it returns (StepResult, the step's host arrays)."""

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows
from flatwire_wire.nucleus import Nuclei

from services.scheduler.model.lora import LoraLayers
from services.scheduler.model.routed_experts import ExpertRouting
from services.scheduler.request import Request


@dataclass
class BatchRow:
    """Positions [start, end) of the request's sequence: one token while it decodes, a chunk of its prompt (and,
    after a retract, its output so far) while it prefills. A row that reaches the end of the sequence samples
    the next token (`samples`, as of when the row was made: the sequence grows by that token)."""

    request: Request
    start: int
    end: int
    samples: bool = field(init=False)

    def __post_init__(self):
        self.samples = self.end == self.request.length

    @property
    def prompt_positions(self) -> range:
        """The prompt positions whose logprob rows this row computes: position q's row comes from the hidden
        state at q - 1, which this row holds for q - 1 in [start, end); none when the request owes none."""
        request = self.request
        if not request.owes_prompt_logprobs:
            return range(0)
        return range(max(self.start + 1, request.prompt_logprob_start), min(self.end + 1, request.prompt_len))


@dataclass
class Batch:
    """A step's rows: the decoding rows (one token each) first, then the prefill chunks."""

    rows: list[BatchRow]

    @property
    def sampling(self) -> list[BatchRow]:
        return [row for row in self.rows if row.samples]

    def __bool__(self) -> bool:
        return bool(self.rows)


@dataclass
class StepResult:
    """What one step produced, on the host."""

    next_ids: np.ndarray  # per sampling row (Batch.sampling, in order): its token
    # per sampling row, at the widest requesting row's width (k, m); None when no such row asked for logprobs
    output: LogprobRows[np.ndarray] | None = None
    # per row with prompt positions (BatchRow.prompt_positions), in row order: their rows
    prompt: list[LogprobRows[np.ndarray]] = field(default_factory=list)
    # per sampling row whose request asked for top-p replay, in order: its token's nucleus; None when none asked
    top_p: Nuclei | None = None


class LaunchedStep(Protocol):
    """A step launched on the device; `result` waits for it."""

    def result(self) -> StepResult:
        ...


@dataclass
class DoneStep:
    """A step computed in full when launched (the synthetic stand-in)."""

    value: StepResult

    def result(self) -> StepResult:
        return self.value


class StepRunner(Protocol):
    """What the engine runs steps on: the model (model/runner.py) or a stand-in (model/synthetic.py)."""

    max_context: int
    vocab_size: int
    eos_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype
    num_pages: int  # of the KV memory, page 0 (padding) included
    page_size: int
    kv_windows: tuple[int, ...]  # each layer group's sliding window (0: full attention): kv/specs.py
    state_slots: tuple[int, int] | None  # linear-attention state slots (running, checkpoints); None: no such layers
    state_bytes: int  # one state slot over every linear-attention layer (0: none)
    kv_layers: str  # what the model's layers keep, for logs and /get_server_info
    expert_routing: ExpertRouting | None  # what a MoE model's routers chose, with --enable-return-routed-experts
    lora: LoraLayers | None  # the model's LoRA targets, with --enable-lora

    def step(self, batch: Batch) -> StepResult:
        """One step: the KV of every row's tokens, and a token for each row that samples."""
        ...

    def launch(self, batch: Batch) -> LaunchedStep:
        """The same step, its results waited for by the caller (the overlap schedule)."""
        ...

    def memory_moved(self) -> None:
        """The weights' or the KV memory's tensors were replaced: nothing may keep their old addresses."""
        ...
