"""What the client returns: a Generation, its logprob rows as numpy arrays (-inf kept).

A side's rows (prompt or output) are the wire layer's RequestLogprobs (flatwire_wire.logprobs), exported here as
`Logprobs`: token_ids [n], token_logprobs [n], topk_values / topk_ids [n, k], ids_logprobs [n, m], null_prefix.
Top-p replay's nuclei are the wire layer's Nuclei (flatwire_wire.nucleus): offsets [n + 1] into token_ids.
"""

from dataclasses import dataclass, field

import numpy as np
from flatwire_wire.logprobs import RequestLogprobs as Logprobs
from flatwire_wire.nucleus import Nuclei
from flatwire_wire.public import GenerateResponse
from flatwire_wire.public import WeightVersionSpan as VersionSpan
from flatwire_wire.steps import FinishReason


@dataclass
class Generation:
    """A response: the whole result, or one chunk of a stream (its new tokens and rows only)."""

    rid: str
    token_ids: np.ndarray  # int32
    text: str
    output: Logprobs | None  # rows of token_ids, when logprobs were asked for
    prompt: Logprobs | None  # prompt rows from logprob_start_len (in a stream: the first chunk)
    finish_reason: str | None  # "length", "stop" or "abort"; None until the last chunk
    matched_stop: int | str | None  # the stop token id or stop string that ended it
    prompt_tokens: int
    completion_tokens: int  # so far
    weight_version: str = ""  # of the weights that produced the last token so far ("": none yet)
    weight_versions: list[VersionSpan] = field(default_factory=list)  # which weights produced which positions
    cached_tokens: int = 0  # of prompt_tokens, those the prefix cache held (set on a stream's last chunk)
    # int32 [tokens, layers, top_k]: the experts each token was routed to (return_routed_experts; last chunk)
    routed_experts: np.ndarray | None = None
    top_p: Nuclei | None = None  # each token's nucleus (return_top_p_token_ids)


def generation(response: GenerateResponse) -> Generation:
    matched: int | str | None = None
    if response.finish_reason == FinishReason.STOP_TOKEN:
        matched = response.matched_token
    elif response.finish_reason == FinishReason.STOP_STRING:
        matched = response.matched_stop
    finish = response.finish_reason.api_name if response.finish_reason != FinishReason.UNSPECIFIED else None
    return Generation(response.rid, response.tokens, response.text, response.output_logprobs(),
                      response.prompt_logprobs(), finish, matched, response.prompt_tokens,
                      response.completion_tokens, response.weight_version, response.weight_versions,
                      response.cached_tokens, _routed_experts(response), response.top_p())


def _routed_experts(response: GenerateResponse) -> np.ndarray | None:
    if not response.routed_experts_shape:
        return None
    return np.frombuffer(response.routed_experts, dtype="<i4").reshape(response.routed_experts_shape)


class ChunkStream:
    """A stream's chunks, each a Generation of its new tokens and rows, kept as they are read; `result` is
    them all joined (the Generation the same request returns without streaming) once the stream has ended."""

    def __init__(self) -> None:
        self.chunks: list[Generation] = []

    def _take(self, response: GenerateResponse) -> Generation:
        chunk = generation(response)
        self.chunks.append(chunk)
        return chunk

    @property
    def ended(self) -> bool:
        """The last chunk read carries a finish_reason: the server ended the stream."""
        return bool(self.chunks) and self.chunks[-1].finish_reason is not None

    @property
    def result(self) -> Generation:
        last = self.chunks[-1]
        output = Logprobs.concatenate([c.output for c in self.chunks if c.output is not None])
        prompt = next((c.prompt for c in self.chunks if c.prompt is not None), None)
        nuclei = [c.top_p for c in self.chunks if c.top_p is not None]
        return Generation(last.rid, np.concatenate([c.token_ids for c in self.chunks]),
                          "".join(c.text for c in self.chunks), output, prompt, last.finish_reason, last.matched_stop,
                          last.prompt_tokens, last.completion_tokens, last.weight_version, last.weight_versions,
                          last.cached_tokens, last.routed_experts, Nuclei.concatenate(nuclei) if nuclei else None)
