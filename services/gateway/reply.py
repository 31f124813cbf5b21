"""What the gateway hands the renderers: a Reply per event of a request (mini-sglang's UserReply), from its
first to its last. `new` is what arrived since the previous event, `whole` the request's output so far (on the last
event, all of it): a stream's renderer asks for the one, a whole response's for the other; the request's counts,
weight versions and, on its last event, how it ended come with both. Everything stays typed (FinishReason, spans,
arrays) until a renderer writes it.

A request's logprobs are one RequestLogprobs per side (prompt, output): the per-request form of the logprob layout
(flatwire_wire.logprobs). Rows arrive as entries of each message's LogprobBlock and are copied into rows allocated
for the whole output (accumulator.py); the views hold numpy views of them, and the public gRPC API sends them as
one-request blocks.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from flatwire_wire.logprobs import RequestLogprobs
from flatwire_wire.nucleus import Nuclei
from flatwire_wire.public import WeightVersionSpan
from flatwire_wire.steps import Finish, FinishReason


@dataclass  # read-only by convention: frozen, its __init__ took 4x as long, on every streamed event
class Output:
    """A run of a request's output: its token ids, their text and, when asked, their logprob rows and nuclei; the
    prompt's rows with the run that brings them."""

    token_ids: list[int]
    text: str
    output: RequestLogprobs | None = None  # rows of token_ids, with return_logprob
    prompt: RequestLogprobs | None = None  # with logprob_start_len >= 0
    token_ids_logprob: list[int] | None = None  # the ids of the ids_logprobs columns, with token_ids_logprob
    top_p: Nuclei | None = None  # each token's nucleus, with top-p replay (return_top_p_token_ids)


@dataclass(frozen=True)
class Ending:
    """How a request ended (its last Reply's)."""

    reason: FinishReason  # LENGTH, STOP_TOKEN, STOP_STRING or ABORT
    matched_stop: int | str | None = None  # the stop token id (STOP_TOKEN) or stop string (STOP_STRING)
    error: str | None = None  # why, with ABORT
    cached_tokens: int = 0  # of the prompt's tokens, those the prefix cache held (their KV not computed again)
    routed_experts: np.ndarray | None = None  # int32 [tokens, layers, top_k], with return_routed_experts

    @classmethod
    def of(cls, finish: Finish) -> "Ending":
        matched = {FinishReason.STOP_TOKEN: finish.matched_token,
                   FinishReason.STOP_STRING: finish.matched_stop}.get(finish.reason)
        error = (finish.message or "aborted") if finish.reason == FinishReason.ABORT else None
        return cls(finish.reason, matched, error, finish.cached_tokens, finish.routed_experts_of())


@dataclass(eq=False)  # read-only by convention, as Output
class Reply:
    """One event of a request: what arrived since the previous one (`new`), and the request so far."""

    rid: str
    prompt_tokens: int
    new: Output
    completion_tokens: int  # output tokens so far
    # Which weights produced which output positions so far (none yet at its end: one empty span, the version then).
    weight_versions: list[WeightVersionSpan]
    e2e_latency: float  # seconds from the request's start to this event (to its end, on the last)
    ending: Ending | None = None  # on the last event
    # Builds `whole` (from the request's buffers, up to this event); None: `new` is all of it (a first event).
    so_far: Callable[[], Output] | None = field(default=None, repr=False)

    @cached_property
    def whole(self) -> Output:
        """The request's output so far, the prompt's rows with it."""
        return self.new if self.so_far is None else self.so_far()

    @property
    def finished(self) -> bool:
        return self.ending is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.ending.reason if self.ending is not None else None

    @property
    def finish_name(self) -> str | None:
        """"length", "stop" or "abort" (SGLang's and OpenAI's word), None while running."""
        return self.ending.reason.api_name if self.ending is not None else None

    @property
    def cached_tokens(self) -> int:
        """Known once the request ends: 0 until then."""
        return self.ending.cached_tokens if self.ending is not None else 0

    @property
    def weight_version(self) -> str | None:
        """The version of the weights that produced the last output token (SGLang's meta_info.weight_version)."""
        return self.weight_versions[-1].version if self.weight_versions else None
