"""JSON built from byte pieces: the shared machinery of the renderers.

A response with 1000 positions x 128 candidates has 128k candidates; as Python dicts
and tuples they cost more to build and serialize than everything else in the gateway.
Instead, every per-id part of the JSON (a token's quoted text, its bytes list, its id)
is rendered once per vocabulary into an object array of bytes, values are formatted by
orjson straight from the float32 array, and a response list is one `b"".join` over a
[rows, pieces] object grid filled by numpy slicing. The result is embedded in the
response dict as an `orjson.Fragment`, so serialize responses with `dumps` (orjson).

Values: float32 in its shortest round-trip form (parses back to the same float32);
-inf and NaN, which JSON cannot carry, become null.
"""

from collections.abc import Sequence
from json.encoder import encode_basestring

import numpy as np
import orjson
from flatwire_wire.logprobs import F32, I32

from services.gateway.token_table import TokenTable

NUMPY = orjson.OPT_SERIALIZE_NUMPY

# A piece spec: one bytes for every row/item, or an object array of bytes broadcast to
# [rows] (row pieces) or [rows, k] / [k] (item pieces).
Piece = bytes | np.ndarray


def dumps(obj) -> bytes:
    """Serialize a rendered response (dicts holding Fragments and numpy arrays)."""
    return orjson.dumps(obj, option=NUMPY)


def json_values(values: np.ndarray) -> orjson.Fragment:
    """A flat JSON array of float32 or int32 values (row-major), null for -inf/NaN."""
    return orjson.Fragment(orjson.dumps(np.ascontiguousarray(values).ravel(), option=NUMPY))


def value_texts(values: np.ndarray, dtype=F32) -> np.ndarray:
    """Each value's JSON text as its own bytes, in an object array of values' shape."""
    flat = np.ascontiguousarray(values, dtype=dtype).ravel()
    out = np.empty(flat.size, dtype=object)
    if flat.size:
        # orjson's array text "[a,b,...]": numbers never contain commas.
        out[:] = orjson.dumps(flat, option=NUMPY)[1:-1].split(b",")
    return out.reshape(np.shape(values))


def id_texts(size: int) -> np.ndarray:
    """[size] object array: the decimal text of every id 0..size-1."""
    return value_texts(np.arange(size, dtype=I32), I32)


def token_texts(table: TokenTable) -> np.ndarray:
    """[size] object array: each id's text as a JSON string literal (quoted, escaped)."""

    def build(t: TokenTable) -> np.ndarray:
        # JSON string text never holds a raw newline (it is escaped), so one join,
        # encode and split turns the whole vocabulary at once (8x faster than per-text calls).
        out = np.empty(t.size, dtype=object)
        out[:] = "\n".join(map(encode_basestring, t.texts.tolist())).encode().split(b"\n")
        return out

    return table.memo("json.texts", build)


def json_array(
    rows: int,
    head: Sequence[Piece] = (),
    items: Sequence[Piece] = (),
    k: int = 0,
    tail: Sequence[Piece] = (),
    nulls: int = 0,
) -> orjson.Fragment:
    """A JSON array of `nulls` nulls then `rows` elements, each written as its head
    pieces, k items of `items` pieces, then its tail pieces."""
    per_item = len(items)
    start = 1 + len(head)
    stop = start + k * per_item
    grid = np.empty((rows, stop + len(tail)), dtype=object)
    grid[:, 0] = b","  # the separator before each element
    for column, piece in enumerate(head, 1):
        grid[:, column] = piece
    for column, piece in enumerate(items, start):
        grid[:, column:stop:per_item] = piece
    for column, piece in enumerate(tail, stop):
        grid[:, column] = piece
    if rows:
        grid[0, 0] = b"," if nulls else b""
    pieces = grid.ravel().tolist()
    pieces.insert(0, b"[" + b",".join([b"null"] * nulls))
    pieces.append(b"]")
    return orjson.Fragment(b"".join(pieces))
