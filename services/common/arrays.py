"""numpy <-> LogprobBlock codecs: the flat arrays on every hop.

Floats are little-endian float32 and ids little-endian int32 everywhere
(docs/architecture.md, wire rules). Decoding is zero-copy (`np.frombuffer` over the message's
bytes); encoding is one `tobytes` per array. Nothing here loops over elements.
"""

from dataclasses import dataclass

import numpy as np

from services.common.pb import arrays_pb2

F32 = np.dtype("<f4")
I32 = np.dtype("<i4")


@dataclass
class LogprobArrays:
    """A LogprobBlock as numpy arrays; see protos/flatwire/v1/arrays.proto."""

    rows: np.ndarray  # [n] rows per request
    null_prefix: np.ndarray  # [n]
    token_logprobs: np.ndarray  # [sum rows] f4
    topk: np.ndarray  # [n] k per request
    topk_values: np.ndarray  # [sum rows*topk] f4
    topk_ids: np.ndarray  # [sum rows*topk] i4
    id_counts: np.ndarray  # [n]
    ids_logprobs: np.ndarray  # [sum rows*id_counts] f4


@dataclass
class BlockOffsets:
    """Element offsets of each request's slice (length n+1, starting at 0)."""

    rows: np.ndarray
    topk: np.ndarray
    ids: np.ndarray


def block_offsets(rows, topk, id_counts) -> BlockOffsets:
    rows = np.asarray(rows, dtype=np.int64)

    def starts(per_request):
        out = np.zeros(len(per_request) + 1, dtype=np.int64)
        np.cumsum(per_request, out=out[1:])
        return out

    return BlockOffsets(
        rows=starts(rows),
        topk=starts(rows * np.asarray(topk, dtype=np.int64)),
        ids=starts(rows * np.asarray(id_counts, dtype=np.int64)),
    )


def request_slice(arrays: LogprobArrays, offsets: BlockOffsets, i: int) -> LogprobArrays:
    """Request i's part of a block (views, no copy); `offsets` from block_offsets."""
    return LogprobArrays(
        rows=arrays.rows[i:i + 1],
        null_prefix=arrays.null_prefix[i:i + 1],
        token_logprobs=arrays.token_logprobs[offsets.rows[i]:offsets.rows[i + 1]],
        topk=arrays.topk[i:i + 1],
        topk_values=arrays.topk_values[offsets.topk[i]:offsets.topk[i + 1]],
        topk_ids=arrays.topk_ids[offsets.topk[i]:offsets.topk[i + 1]],
        id_counts=arrays.id_counts[i:i + 1],
        ids_logprobs=arrays.ids_logprobs[offsets.ids[i]:offsets.ids[i + 1]],
    )


def encode_block(arrays: LogprobArrays) -> arrays_pb2.LogprobBlock:
    return arrays_pb2.LogprobBlock(
        rows=arrays.rows.tolist(),
        null_prefix=arrays.null_prefix.tolist(),
        token_logprobs=np.ascontiguousarray(arrays.token_logprobs, dtype=F32).tobytes(),
        topk=arrays.topk.tolist(),
        topk_values=np.ascontiguousarray(arrays.topk_values, dtype=F32).tobytes(),
        topk_ids=np.ascontiguousarray(arrays.topk_ids, dtype=I32).tobytes(),
        id_counts=arrays.id_counts.tolist(),
        ids_logprobs=np.ascontiguousarray(arrays.ids_logprobs, dtype=F32).tobytes(),
    )


def decode_block(block: arrays_pb2.LogprobBlock) -> LogprobArrays:
    # list() first: numpy converts a protobuf repeated field element by element, a list at once.
    return LogprobArrays(
        rows=np.array(list(block.rows), dtype=np.int64),
        null_prefix=np.array(list(block.null_prefix), dtype=np.int64),
        token_logprobs=np.frombuffer(block.token_logprobs, dtype=F32),
        topk=np.array(list(block.topk), dtype=np.int64),
        topk_values=np.frombuffer(block.topk_values, dtype=F32),
        topk_ids=np.frombuffer(block.topk_ids, dtype=I32),
        id_counts=np.array(list(block.id_counts), dtype=np.int64),
        ids_logprobs=np.frombuffer(block.ids_logprobs, dtype=F32),
    )


def select_requests(block: arrays_pb2.LogprobBlock, keep: list[int]) -> arrays_pb2.LogprobBlock:
    """The block restricted to requests `keep` (in that order), by byte slicing.

    Used to route one step's arrays to several owners without touching elements.
    """
    if len(keep) == len(block.rows) and keep == list(range(len(keep))):
        return block
    offsets = block_offsets(block.rows, block.topk, block.id_counts)

    def take(data: bytes, starts: np.ndarray) -> bytes:
        view = memoryview(data)
        return b"".join(view[starts[i] * 4:starts[i + 1] * 4] for i in keep)

    return arrays_pb2.LogprobBlock(
        rows=[block.rows[i] for i in keep],
        null_prefix=[block.null_prefix[i] for i in keep] if len(block.null_prefix) else [],
        token_logprobs=take(block.token_logprobs, offsets.rows),
        topk=[block.topk[i] for i in keep],
        topk_values=take(block.topk_values, offsets.topk),
        topk_ids=take(block.topk_ids, offsets.topk),
        id_counts=[block.id_counts[i] for i in keep],
        ids_logprobs=take(block.ids_logprobs, offsets.ids),
    )
