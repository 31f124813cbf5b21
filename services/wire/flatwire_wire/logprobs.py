"""The logprob layout: one concept in three forms, and the conversions between them.

A logprob *row* is what one token position carries: the logprob of the token there, the top-k (values
best first, and their ids) and the logprobs of the ids the request asked for. Logprobs are float32
log-probabilities of the distribution LogprobsMode names; -inf is a valid value.
Rows travel as:

- LogprobRows: rows of one width (k, m) as arrays of any array library: on the scheduler's device
  (torch tensors: what the sampler computes for a whole batch) or on the host (numpy: a request's rows,
  views of a step's host copy or of a message's bytes).
- LogprobBlock: the wire form (arrays.proto's LogprobBlock): several requests' rows, each request its own
  width, concatenated into four little-endian buffers. Every hop slices it per request or per owner with
  numpy and byte slicing; nothing loops over elements.
- RequestLogprobs: one request's rows (its prompt or its output) with the tokens they are for: what the
  gateway accumulates and renders, and what the client returns.
"""

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Generic, TypeVar

import numpy as np

from flatwire_wire.codec import register_codec
from flatwire_wire.lazy import lazy
from flatwire_wire.pb import arrays_pb2

F32 = np.dtype("<f4")
I32 = np.dtype("<i4")
DTYPES = (F32, F32, I32, F32)  # of a row's arrays: token logprob, top-k values, top-k ids, requested ids' logprobs
A = TypeVar("A")  # an array type: numpy.ndarray on the host, torch.Tensor on a device


class LogprobsMode(enum.IntEnum):
    """Which distribution output logprobs are of (arrays.proto documents each); JSON names them as vLLM does, and
    SGLang's `sglang_logprobs`."""

    UNSPECIFIED = arrays_pb2.LOGPROBS_MODE_UNSPECIFIED  # the API's default (arrays.proto)
    RAW = arrays_pb2.LOGPROBS_MODE_RAW  # the model's logits
    PROCESSED = arrays_pb2.LOGPROBS_MODE_PROCESSED  # what the sampler drew from (after every transform)
    SGLANG = arrays_pb2.LOGPROBS_MODE_SGLANG  # the adjusted logits at the temperature, before the cut (SGLang's)

    @property
    def api_name(self) -> str:
        return _MODE_NAMES[self]

    @classmethod
    def named(cls, name: str) -> "LogprobsMode":
        """The mode JSON calls `name` (MODE_NAMES); ValueError for any other."""
        for mode, mode_name in _MODE_NAMES.items():
            if name == mode_name and mode is not cls.UNSPECIFIED:
                return mode
        raise ValueError(f"unknown logprobs mode {name!r}: expected one of {', '.join(MODE_NAMES)}")


_MODE_NAMES = {LogprobsMode.UNSPECIFIED: "", LogprobsMode.RAW: "raw_logprobs",
               LogprobsMode.PROCESSED: "processed_logprobs", LogprobsMode.SGLANG: "sglang_logprobs"}
MODE_NAMES = tuple(name for name in _MODE_NAMES.values() if name)  # what a request or a flag may name


@dataclass
class LogprobRows(Generic[A]):
    """n rows of one width: top-k of k, m requested ids."""

    token_logprobs: A  # [n] float32
    topk_values: A  # [n, k] float32, best first
    topk_ids: A  # [n, k] int32
    ids_logprobs: A  # [n, m] float32

    @property
    def arrays(self) -> tuple[A, A, A, A]:
        return self.token_logprobs, self.topk_values, self.topk_ids, self.ids_logprobs

    @property
    def n(self) -> int:
        return self.topk_values.shape[0]  # type: ignore[attr-defined]

    @property
    def k(self) -> int:
        return self.topk_values.shape[1]  # type: ignore[attr-defined]

    @property
    def m(self) -> int:
        return self.ids_logprobs.shape[1]  # type: ignore[attr-defined]

    @classmethod
    def allocate(cls, n: int, k: int, m: int) -> "LogprobRows[np.ndarray]":
        """Host room for n rows, filled by put()."""
        return LogprobRows(np.empty(n, F32), np.empty((n, k), F32), np.empty((n, k), I32), np.empty((n, m), F32))

    @classmethod
    def of_flat(cls, token_logprobs: np.ndarray, topk_values: np.ndarray, topk_ids: np.ndarray,
                ids_logprobs: np.ndarray) -> "LogprobRows[np.ndarray]":
        """Rows from flat row-major arrays (one request's slice of a block), as [n, k] / [n, m] views."""
        n = len(token_logprobs)
        return LogprobRows(token_logprobs, topk_values.reshape(n, -1) if n else topk_values.reshape(0, 0),
                           topk_ids.reshape(n, -1) if n else topk_ids.reshape(0, 0),
                           ids_logprobs.reshape(n, -1) if n else ids_logprobs.reshape(0, 0))

    def put(self, at: int, rows: "LogprobRows") -> None:
        """Copy `rows` (of this width) in from row `at` on."""
        end = at + len(rows.token_logprobs)  # type: ignore[arg-type]
        self.token_logprobs[at:end] = rows.token_logprobs  # type: ignore[index]
        self.topk_values[at:end] = rows.topk_values  # type: ignore[index]
        self.topk_ids[at:end] = rows.topk_ids  # type: ignore[index]
        self.ids_logprobs[at:end] = rows.ids_logprobs  # type: ignore[index]

    @lazy
    def byte_views(self) -> tuple[memoryview, memoryview, memoryview, memoryview]:
        """The arrays' bytes (row-major, 4 per value), for copies of byte slices: a memoryview slice assignment
        costs a third of a numpy one."""
        return tuple(memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[attr-defined,return-value]
                     for array in self.arrays)

    def rows(self, start: int, end: int) -> "LogprobRows[A]":
        """Rows start..end-1 (views)."""
        return LogprobRows(self.token_logprobs[start:end], self.topk_values[start:end],  # type: ignore[index]
                           self.topk_ids[start:end], self.ids_logprobs[start:end])  # type: ignore[index]


@dataclass
class RequestLogprobs(LogprobRows[np.ndarray]):
    """One side (prompt or output) of one request: n rows, one per position, and the tokens at those positions.

    `null_prefix` positions before the first row have no logprob (a prompt's first token); their tokens are
    `null_token_ids`.
    """

    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, I32))  # [n] int32
    null_prefix: int = 0
    null_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, I32))  # [null_prefix] int32

    @classmethod
    def of(cls, rows: LogprobRows[np.ndarray], token_ids: np.ndarray, null_prefix: int = 0) -> "RequestLogprobs":
        return cls(*rows.arrays, token_ids=token_ids, null_prefix=null_prefix)

    @classmethod
    def allocate(cls, n: int, k: int, m: int) -> "RequestLogprobs":
        """Room for n rows (filled by put; view() gives the tokens)."""
        return cls.of(LogprobRows.allocate(n, k, m), np.zeros(0, I32))

    @classmethod
    def empty(cls, k: int = 0, m: int = 0) -> "RequestLogprobs":
        return cls.allocate(0, k, m)

    def view(self, start: int, end: int, token_ids: np.ndarray) -> "RequestLogprobs":
        """Rows start..end-1 (views), for the tokens `token_ids`."""
        return RequestLogprobs(self.token_logprobs[start:end], self.topk_values[start:end],
                               self.topk_ids[start:end], self.ids_logprobs[start:end], token_ids=token_ids)

    @classmethod
    def concatenate(cls, parts: list["RequestLogprobs"]) -> "RequestLogprobs | None":
        """A stream's chunks joined (the first one's null prefix)."""
        if not parts:
            return None
        token_logprobs, topk_values, topk_ids, ids_logprobs = (np.concatenate(arrays) for arrays in
                                                               zip(*(p.arrays for p in parts)))
        return cls(token_logprobs, topk_values, topk_ids, ids_logprobs,
                   token_ids=np.concatenate([p.token_ids for p in parts]), null_prefix=parts[0].null_prefix,
                   null_token_ids=parts[0].null_token_ids)


@dataclass
class LogprobBlock:
    """The wire form: the rows of several requests, request i owning rows[i] rows of width topk[i] and
    id_counts[i], each array the requests' slices concatenated in order (see arrays.proto)."""

    rows: list[int]
    null_prefix: list[int]  # per request: leading positions without a row
    topk: list[int]
    id_counts: list[int]
    token_logprobs: bytes  # <f4 [sum rows]
    topk_values: bytes  # <f4 [sum rows * topk]
    topk_ids: bytes  # <i4 [sum rows * topk]
    ids_logprobs: bytes  # <f4 [sum rows * id_counts]

    @classmethod
    def of_rows(cls, parts: list[LogprobRows[np.ndarray]], null_prefix: list[int] | None = None) -> "LogprobBlock":
        """One request per part, in order."""
        rows, topk, id_counts = [], [], []
        for part in parts:
            n, k = part.topk_values.shape
            rows.append(n)
            topk.append(k)
            id_counts.append(part.ids_logprobs.shape[1])
        pieces = [tuple(np.ascontiguousarray(array, dtype) for array, dtype in zip(part.arrays, DTYPES))
                  for part in parts]
        return cls.of_pieces(rows, topk, id_counts, pieces, null_prefix)  # type: ignore[arg-type]

    @classmethod
    def of_pieces(cls, rows: list[int], topk: list[int], id_counts: list[int], pieces: list[tuple[Any, Any, Any, Any]],
                  null_prefix: list[int] | None = None) -> "LogprobBlock":
        """The requests' shapes, and pieces that hold their rows in order: each the four arrays' bytes (contiguous
        F32, F32, I32, F32 buffers) of one request's rows, or of several consecutive requests' of one width. One
        copy per array, straight into the block's bytes (a concatenation, then tobytes, copies twice)."""
        token_logprobs, topk_values, topk_ids, ids_logprobs = (b"".join(buffers) for buffers in zip(*pieces)) \
            if pieces else (b"", b"", b"", b"")
        return cls(rows=rows, null_prefix=null_prefix or [0] * len(rows), topk=topk, id_counts=id_counts,
                   token_logprobs=token_logprobs, topk_values=topk_values, topk_ids=topk_ids,
                   ids_logprobs=ids_logprobs)

    @classmethod
    def of_request(cls, logprobs: RequestLogprobs) -> "LogprobBlock":
        """A one-request block (the public API's responses)."""
        return cls.of_rows([logprobs], [logprobs.null_prefix])

    def __len__(self) -> int:
        return len(self.rows)

    @lazy
    def _offsets(self) -> tuple[list[int], list[int], list[int]]:
        """Element offsets of each request's slice (n + 1 each, from 0): rows, top-k elements, id elements. Python
        ints: slicing by them is several times cheaper than by numpy scalars."""

        def starts(per_request: Iterable[int]) -> list[int]:
            return [0, *accumulate(per_request)]

        return (starts(self.rows), starts(n * k for n, k in zip(self.rows, self.topk)),
                starts(n * m for n, m in zip(self.rows, self.id_counts)))

    @lazy
    def _byte_offsets(self) -> tuple[list[int], list[int], list[int]]:
        """_offsets in bytes."""
        rows, topk, ids = self._offsets
        return [4 * n for n in rows], [4 * n for n in topk], [4 * n for n in ids]

    @lazy
    def _byte_views(self) -> tuple[memoryview, memoryview, memoryview, memoryview]:
        """The buffers as memoryviews (no copy), for byte slices."""
        return (memoryview(self.token_logprobs), memoryview(self.topk_values), memoryview(self.topk_ids),
                memoryview(self.ids_logprobs))

    @lazy
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The buffers as numpy views (no copy)."""
        return (np.frombuffer(self.token_logprobs, F32), np.frombuffer(self.topk_values, F32),
                np.frombuffer(self.topk_ids, I32), np.frombuffer(self.ids_logprobs, F32))

    def request(self, i: int) -> LogprobRows[np.ndarray]:
        """Request i's rows, as views of the block's bytes."""
        if len(self.rows) == 1:  # a response's block: the whole buffers
            n, k, m = self.rows[0], self.topk[0], self.id_counts[0]
            return LogprobRows(np.frombuffer(self.token_logprobs, F32),
                               np.frombuffer(self.topk_values, F32).reshape(n, k),
                               np.frombuffer(self.topk_ids, I32).reshape(n, k),
                               np.frombuffer(self.ids_logprobs, F32).reshape(n, m))
        rows, topk, ids = self._offsets
        token_logprobs, topk_values, topk_ids, ids_logprobs = self._arrays
        n, k, m = self.rows[i], self.topk[i], self.id_counts[i]
        return LogprobRows(token_logprobs[rows[i]:rows[i + 1]], topk_values[topk[i]:topk[i + 1]].reshape(n, k),
                           topk_ids[topk[i]:topk[i + 1]].reshape(n, k), ids_logprobs[ids[i]:ids[i + 1]].reshape(n, m))

    def copy_request(self, i: int, into: LogprobRows[np.ndarray], at: int) -> None:
        """Request i's rows copied into `into` (of its widths) from row `at` on: byte slice to byte slice, no
        view of the rows built (a gateway does this once per request per message)."""
        rows, topk, ids = self._byte_offsets
        token_logprobs, topk_values, topk_ids, ids_logprobs = self._byte_views
        into_logprobs, into_values, into_ids, into_id_logprobs = into.byte_views
        start = at * 4
        into_logprobs[start:start + rows[i + 1] - rows[i]] = token_logprobs[rows[i]:rows[i + 1]]
        start = at * 4 * self.topk[i]
        into_values[start:start + topk[i + 1] - topk[i]] = topk_values[topk[i]:topk[i + 1]]
        into_ids[start:start + topk[i + 1] - topk[i]] = topk_ids[topk[i]:topk[i + 1]]
        if ids[i + 1] > ids[i]:
            start = at * 4 * self.id_counts[i]
            into_id_logprobs[start:start + ids[i + 1] - ids[i]] = ids_logprobs[ids[i]:ids[i + 1]]

    def request_logprobs(self, i: int, token_ids: np.ndarray) -> RequestLogprobs:
        """Request i's rows with the tokens they are for."""
        return RequestLogprobs.of(self.request(i), token_ids, self.null_prefix[i] if self.null_prefix else 0)

    def select(self, keep: list[int]) -> "LogprobBlock":
        """The block restricted to requests `keep`, in that order, by byte slicing (itself when it keeps all)."""
        if keep == list(range(len(self.rows))):
            return self
        rows, topk, ids = self._byte_offsets
        token_logprobs, topk_values, topk_ids, ids_logprobs = self._byte_views

        def take(view: memoryview, starts: list[int]) -> bytes:
            return b"".join(view[starts[i]:starts[i + 1]] for i in keep)

        return LogprobBlock(rows=[self.rows[i] for i in keep],
                            null_prefix=[self.null_prefix[i] for i in keep] if self.null_prefix else [],
                            topk=[self.topk[i] for i in keep], id_counts=[self.id_counts[i] for i in keep],
                            token_logprobs=take(token_logprobs, rows), topk_values=take(topk_values, topk),
                            topk_ids=take(topk_ids, topk), ids_logprobs=take(ids_logprobs, ids))


def decode_block(message: Any) -> LogprobBlock:
    return LogprobBlock(rows=list(message.rows), null_prefix=list(message.null_prefix), topk=list(message.topk),
                        id_counts=list(message.id_counts), token_logprobs=message.token_logprobs,
                        topk_values=message.topk_values, topk_ids=message.topk_ids, ids_logprobs=message.ids_logprobs)


def write_block(target: arrays_pb2.LogprobBlock, block: LogprobBlock) -> None:
    """Fill a message's (empty) LogprobBlock field in place: protobuf copies a message given to a constructor or to
    CopyFrom once more, which for a large block costs more than the serialization."""
    target.rows.extend(block.rows)
    target.null_prefix.extend(block.null_prefix)
    target.topk.extend(block.topk)
    target.id_counts.extend(block.id_counts)
    target.token_logprobs = block.token_logprobs
    target.topk_values = block.topk_values
    target.topk_ids = block.topk_ids
    target.ids_logprobs = block.ids_logprobs


def encode_block(block: LogprobBlock) -> arrays_pb2.LogprobBlock:
    message = arrays_pb2.LogprobBlock()
    write_block(message, block)
    return message


register_codec(LogprobBlock, decode_block, encode_block)
