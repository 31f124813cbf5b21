"""A request's output since it last shipped: what its next StepOutput entry carries.

A request ships its tokens every `interval` tokens (1 while streaming) and when it
ends, so a client that waits for the whole output costs the hops one entry per
interval instead of one per token. Logprob rows are copied out of each step's host
arrays into the request's own buffers (sized for one interval), so no step's arrays
outlive the step.
"""

from dataclasses import dataclass, field

import numpy as np

from services.common.arrays import F32, I32


@dataclass
class PendingOutput:
    interval: int
    k: int  # top-k width of each row (0: none)
    m: int  # logprobs of requested ids per row
    with_logprobs: bool
    first_position: int = 0  # of token_ids[0] in the request's output
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: np.ndarray = field(init=False)  # [interval] f4
    topk_values: np.ndarray = field(init=False)  # [interval, k] f4
    topk_ids: np.ndarray = field(init=False)  # [interval, k] i4
    ids_logprobs: np.ndarray = field(init=False)  # [interval, m] f4

    def __post_init__(self):
        rows = self.interval if self.with_logprobs else 0
        self.token_logprobs = np.empty(rows, dtype=F32)
        self.topk_values = np.empty((rows, self.k), dtype=F32)
        self.topk_ids = np.empty((rows, self.k), dtype=I32)
        self.ids_logprobs = np.empty((rows, self.m), dtype=F32)

    @property
    def count(self) -> int:
        return len(self.token_ids)

    @property
    def due(self) -> bool:
        return self.count >= self.interval

    def add(self, token: int, host: dict[str, np.ndarray], row: int) -> None:
        """The token of step row `row`, with its logprob row when the request asked for logprobs."""
        if self.with_logprobs:
            at = self.count
            self.token_logprobs[at] = host["token_logprobs"][row]
            self.topk_values[at] = host["topk_values"][row, :self.k]
            self.topk_ids[at] = host["topk_ids"][row, :self.k]
            self.ids_logprobs[at] = host["ids_logprobs"][row, :self.m]
        self.token_ids.append(token)

    def shipped(self) -> None:
        """Its entry was built: start the next one."""
        self.first_position += self.count
        self.token_ids = []
