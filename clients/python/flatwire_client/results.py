"""What the client returns: a Generation, its logprob rows as numpy arrays (-inf kept)."""

from dataclasses import dataclass, field

import numpy as np

from flatwire_client.pb import arrays_pb2, generate_pb2

F32, I32 = np.dtype("<f4"), np.dtype("<i4")
FINISH_NAMES = {
    arrays_pb2.FINISH_REASON_LENGTH: "length",
    arrays_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    arrays_pb2.FINISH_REASON_STOP_STRING: "stop",
    arrays_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass
class Logprobs:
    """One side (prompt or output) of a response: n rows, one per position."""

    token_ids: np.ndarray  # [n] int32: the token at each row
    token_logprobs: np.ndarray  # [n] float32
    topk_values: np.ndarray  # [n, k] float32, best first
    topk_ids: np.ndarray  # [n, k] int32
    ids_logprobs: np.ndarray  # [n, m] float32: the logprobs of the requested token_ids_logprob
    null_prefix: int = 0  # positions before the first row without a logprob (the prompt's first token)

    @classmethod
    def of_block(cls, block: arrays_pb2.LogprobBlock, token_ids: np.ndarray) -> "Logprobs | None":
        """A one-request LogprobBlock (as the APIs send it) as arrays, without copying; None when it is empty."""
        if not block.rows:
            return None
        n, k, m = block.rows[0], block.topk[0], block.id_counts[0]
        return cls(token_ids=token_ids, token_logprobs=np.frombuffer(block.token_logprobs, F32),
                   topk_values=np.frombuffer(block.topk_values, F32).reshape(n, k),
                   topk_ids=np.frombuffer(block.topk_ids, I32).reshape(n, k),
                   ids_logprobs=np.frombuffer(block.ids_logprobs, F32).reshape(n, m),
                   null_prefix=block.null_prefix[0] if block.null_prefix else 0)

    @classmethod
    def concatenate(cls, parts: list["Logprobs"]) -> "Logprobs | None":
        if not parts:
            return None
        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(part, name) for part in parts])
        return cls(token_ids=joined("token_ids"), token_logprobs=joined("token_logprobs"),
                   topk_values=joined("topk_values"), topk_ids=joined("topk_ids"),
                   ids_logprobs=joined("ids_logprobs"), null_prefix=parts[0].null_prefix)


@dataclass
class VersionSpan:
    """Output positions [start, end) were produced by the weights labelled `version`."""

    version: str
    start: int
    end: int


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


def generation(response: generate_pb2.GenerateResponsePacked, input_ids: list[int] | None) -> Generation:
    token_ids = np.frombuffer(response.token_ids, I32)
    prompt = Logprobs.of_block(response.prompt, np.zeros(0, I32))
    if prompt is not None and input_ids is not None:
        prompt.token_ids = np.asarray(input_ids[len(input_ids) - len(prompt.token_logprobs):], I32)
    matched: int | str | None = None
    if response.finish_reason == arrays_pb2.FINISH_REASON_STOP_TOKEN:
        matched = response.matched_token
    elif response.finish_reason == arrays_pb2.FINISH_REASON_STOP_STRING:
        matched = response.matched_stop
    return Generation(response.rid, token_ids, response.text, Logprobs.of_block(response.output, token_ids), prompt,
                      FINISH_NAMES.get(response.finish_reason), matched, response.prompt_tokens,
                      response.completion_tokens, response.weight_version,
                      [VersionSpan(span.version, span.start, span.end) for span in response.weight_versions])


class ChunkStream:
    """A stream's chunks, each a Generation of its new tokens and rows, kept as they are read; `result` is
    them all joined (the Generation the same request returns without streaming) once the stream has ended."""

    def __init__(self, input_ids: list[int] | None):
        self._input_ids = input_ids
        self.chunks: list[Generation] = []

    def _take(self, response: generate_pb2.GenerateResponsePacked) -> Generation:
        chunk = generation(response, self._input_ids)
        self.chunks.append(chunk)
        return chunk

    @property
    def result(self) -> Generation:
        last = self.chunks[-1]
        output = Logprobs.concatenate([c.output for c in self.chunks if c.output is not None])
        prompt = next((c.prompt for c in self.chunks if c.prompt is not None), None)
        return Generation(last.rid, np.concatenate([c.token_ids for c in self.chunks]),
                          "".join(c.text for c in self.chunks), output, prompt, last.finish_reason, last.matched_stop,
                          last.prompt_tokens, last.completion_tokens, last.weight_version, last.weight_versions)
