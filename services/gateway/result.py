"""What the gateway accumulates for one request, and hands to the renderers.

Top-k arrays arrive as one small LogprobBlock slice per step; they are kept as
byte chunks and joined once, when the request finishes (or when a stream chunk is
rendered), so no per-element work happens while generating.
"""

from dataclasses import dataclass, field

import numpy as np

from services.common.arrays import F32, I32


@dataclass
class LogprobTrack:
    """One side (prompt or output) of a request's logprobs as flat arrays.

    n rows (positions). `null_prefix` positions before the first row have no
    logprob (the first prompt token). topk_values/topk_ids are [n, k] row-major;
    ids_logprobs is [n, len(token_ids_logprob)].
    """

    token_ids: np.ndarray  # [n] i4, the token at each row
    token_logprobs: np.ndarray  # [n] f4
    topk_values: np.ndarray  # [n, k] f4
    topk_ids: np.ndarray  # [n, k] i4
    ids_logprobs: np.ndarray  # [n, m] f4
    null_prefix: int = 0
    null_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=I32))  # [null_prefix]

    @property
    def k(self) -> int:
        return self.topk_values.shape[1]

    @classmethod
    def empty(cls, k: int = 0, m: int = 0) -> "LogprobTrack":
        return cls(
            token_ids=np.zeros(0, dtype=I32),
            token_logprobs=np.zeros(0, dtype=F32),
            topk_values=np.zeros((0, k), dtype=F32),
            topk_ids=np.zeros((0, k), dtype=I32),
            ids_logprobs=np.zeros((0, m), dtype=F32),
        )


@dataclass
class RequestResult:
    """A finished (or, for streaming, partial) request, ready to render."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str | None  # "length" | "stop" | "abort" | None while running
    matched_stop: int | str | None = None  # the stop token id or stop string
    output: LogprobTrack | None = None  # set when return_logprob
    prompt: LogprobTrack | None = None  # set when logprob_start_len >= 0
    token_ids_logprob: list[int] | None = None  # the ids of ids_logprobs columns
    e2e_latency: float = 0.0
    error: str | None = None  # set with finish_reason "abort" on a failure

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
