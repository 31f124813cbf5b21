"""What the gateway gathers for one request, and hands to the renderers.

A request's logprobs are one LogprobTrack per side (prompt, output): the per-request
form of the LogprobBlock struct of arrays (services/common/arrays.py, the wire form
of many requests). Rows arrive as entries of each message's block and are copied into
a track allocated for the whole output (accumulator.py); renderers get views of it,
the public gRPC API and its client convert it to and from one-request blocks.
"""

from dataclasses import dataclass, field

import numpy as np

from services.common.arrays import F32, I32, LogprobArrays, encode_block
from services.common.pb import arrays_pb2
from services.common.pb.arrays_pb2 import FinishReason

# How SGLang and OpenAI name a finish reason: the renderers' words for the FinishReason they are given.
FINISH_NAMES = {
    FinishReason.FINISH_REASON_LENGTH: "length",
    FinishReason.FINISH_REASON_STOP_TOKEN: "stop",
    FinishReason.FINISH_REASON_STOP_STRING: "stop",
    FinishReason.FINISH_REASON_ABORT: "abort",
}


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
    def of_request(cls, rows: LogprobArrays, token_ids: np.ndarray, k: int, m: int) -> "LogprobTrack":
        """One request's rows of a decoded block (arrays.request_slice), as views shaped [n, k] / [n, m]."""
        n = len(rows.token_logprobs)
        return cls(token_ids=token_ids, token_logprobs=rows.token_logprobs, topk_values=rows.topk_values.reshape(n, k),
                   topk_ids=rows.topk_ids.reshape(n, k), ids_logprobs=rows.ids_logprobs.reshape(n, m),
                   null_prefix=int(rows.null_prefix[0]) if len(rows.null_prefix) else 0)

    def to_block(self) -> arrays_pb2.LogprobBlock:
        """A one-request block (the public gRPC API's packed response)."""
        one = np.ones(1, dtype=np.int64)
        return encode_block(LogprobArrays(
            rows=one * len(self.token_logprobs), null_prefix=one * self.null_prefix,
            token_logprobs=self.token_logprobs, topk=one * self.k, topk_values=self.topk_values.reshape(-1),
            topk_ids=self.topk_ids.reshape(-1), id_counts=one * self.ids_logprobs.shape[1],
            ids_logprobs=self.ids_logprobs.reshape(-1)))

    @classmethod
    def allocate(cls, n: int, k: int, m: int) -> "LogprobTrack":
        """Room for n rows (filled by put); token_ids stays empty: view() supplies them."""
        return cls(token_ids=np.zeros(0, dtype=I32), token_logprobs=np.empty(n, dtype=F32),
                   topk_values=np.empty((n, k), dtype=F32), topk_ids=np.empty((n, k), dtype=I32),
                   ids_logprobs=np.empty((n, m), dtype=F32))

    def put(self, at: int, rows: LogprobArrays) -> None:
        """Copy one request's rows (of a decoded LogprobBlock) in, from row `at` on."""
        n = len(rows.token_logprobs)
        self.token_logprobs[at:at + n] = rows.token_logprobs
        self.topk_values[at:at + n] = rows.topk_values.reshape(n, self.k)
        self.topk_ids[at:at + n] = rows.topk_ids.reshape(n, self.k)
        self.ids_logprobs[at:at + n] = rows.ids_logprobs.reshape(n, self.ids_logprobs.shape[1])

    def view(self, start: int, end: int, token_ids: np.ndarray) -> "LogprobTrack":
        """Rows start..end-1 (views, no copy), for the tokens `token_ids`."""
        return LogprobTrack(token_ids=token_ids, token_logprobs=self.token_logprobs[start:end],
                            topk_values=self.topk_values[start:end], topk_ids=self.topk_ids[start:end],
                            ids_logprobs=self.ids_logprobs[start:end])

    @classmethod
    def empty(cls, k: int = 0, m: int = 0) -> "LogprobTrack":
        return cls.allocate(0, k, m)


@dataclass
class VersionSpan:
    """Output positions [start, end) of a request were produced by the weights labelled `version`."""

    version: str
    start: int
    end: int


def version_spans(spans: list[VersionSpan], version: str, start: int, count: int) -> None:
    """Record that `count` tokens from position `start` on were made by `version` (runs of one version merge)."""
    if spans and spans[-1].version == version and spans[-1].end == start:
        spans[-1].end = start + count
    else:
        spans.append(VersionSpan(version, start, start + count))


@dataclass
class RequestResult:
    """A finished (or, for streaming, partial) request, ready to render."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: FinishReason | None  # LENGTH, STOP_TOKEN, STOP_STRING or ABORT; None while running
    matched_stop: int | str | None = None  # the stop token id (STOP_TOKEN) or stop string (STOP_STRING)
    output: LogprobTrack | None = None  # set when return_logprob
    prompt: LogprobTrack | None = None  # set when logprob_start_len >= 0
    token_ids_logprob: list[int] | None = None  # the ids of ids_logprobs columns
    e2e_latency: float = 0.0
    error: str | None = None  # why, with finish_reason ABORT
    # Which weights produced which output positions (no token yet: one empty span, the version then in force).
    weight_versions: list[VersionSpan] = field(default_factory=list)

    @property
    def weight_version(self) -> str | None:
        """The version of the weights that produced the last output token (SGLang's meta_info.weight_version)."""
        return self.weight_versions[-1].version if self.weight_versions else None

    @property
    def finish_name(self) -> str | None:
        """"length", "stop" or "abort" (SGLang's and OpenAI's word), None while running."""
        return FINISH_NAMES[self.finish_reason] if self.finish_reason is not None else None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
