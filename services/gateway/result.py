"""What the gateway gathers for one request, and hands to the renderers.

A request's logprobs are one RequestLogprobs per side (prompt, output): the per-request form of the logprob
layout (flatwire_wire.logprobs). Rows arrive as entries of each message's LogprobBlock and are copied into rows
allocated for the whole output (accumulator.py); renderers get views of them, and the public gRPC API sends them
as one-request blocks.
"""

from dataclasses import dataclass, field

import numpy as np
from flatwire_wire.logprobs import RequestLogprobs
from flatwire_wire.public import WeightVersionSpan
from flatwire_wire.steps import FinishReason


def version_spans(spans: list[WeightVersionSpan], version: str, start: int, count: int) -> None:
    """Record that `count` tokens from position `start` on were made by `version` (runs of one version merge)."""
    if spans and spans[-1].version == version and spans[-1].end == start:
        spans[-1].end = start + count
    else:
        spans.append(WeightVersionSpan(version, start, start + count))


@dataclass
class RequestResult:
    """A finished (or, for streaming, partial) request, ready to render."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: FinishReason | None  # LENGTH, STOP_TOKEN, STOP_STRING or ABORT; None while running
    matched_stop: int | str | None = None  # the stop token id (STOP_TOKEN) or stop string (STOP_STRING)
    output: RequestLogprobs | None = None  # set when return_logprob
    prompt: RequestLogprobs | None = None  # set when logprob_start_len >= 0
    token_ids_logprob: list[int] | None = None  # the ids of ids_logprobs columns
    e2e_latency: float = 0.0
    cached_tokens: int = 0  # of prompt_tokens, those the prefix cache held (their KV not computed again)
    error: str | None = None  # why, with finish_reason ABORT
    routed_experts: np.ndarray | None = None  # int32 [tokens, layers, top_k], with return_routed_experts
    # Which weights produced which output positions (no token yet: one empty span, the version then in force).
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)

    @property
    def weight_version(self) -> str | None:
        """The version of the weights that produced the last output token (SGLang's meta_info.weight_version)."""
        return self.weight_versions[-1].version if self.weight_versions else None

    @property
    def finish_name(self) -> str | None:
        """"length", "stop" or "abort" (SGLang's and OpenAI's word), None while running."""
        return self.finish_reason.api_name if self.finish_reason is not None else None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
