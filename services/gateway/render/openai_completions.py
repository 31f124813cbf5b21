"""OpenAI (legacy) completions' `choices[].logprobs`: tokens, token_logprobs, top_logprobs, text_offset.

Tracks are rendered in order as one sequence: with echo, the prompt track then the
output track. Null-prefix positions (the first prompt token) have a null logprob and
null top_logprobs. top_logprobs rows are {text: logprob} objects holding the top-k
candidates and the row's own token (sampled, or echoed), as OpenAI documents: up to
logprobs + 1 entries, and the token alone with logprobs=0 (SGLang leaves it out when it is not
a candidate). Candidates whose texts
collide would be duplicate keys: only the best of them is kept, as OpenAI does (use
chat logprobs or the SGLang formats to see every candidate). text_offset is each
token's character offset, counted from `text_offset`, in the text the tokens decode to.
"""

import codecs
from collections.abc import Sequence

import numpy as np
from flatwire_wire.logprobs import F32, I32, RequestLogprobs

from services.gateway.render.pieces import json_array, json_values, token_texts, value_texts
from services.gateway.token_table import TokenTable


def completion_logprobs(tracks: Sequence[RequestLogprobs], table: TokenTable, text_offset: int = 0) -> dict:
    """tracks: [output], or [prompt, output] with echo (or one stream chunk's rows)."""
    first = tracks[0]
    if any(track.null_prefix for track in tracks[1:]):
        raise ValueError("only the first track may start with null positions")
    ids = np.concatenate([first.null_token_ids, *(t.token_ids for t in tracks)]).astype(I32, copy=False)
    values = np.concatenate([np.full(first.null_prefix, np.nan, dtype=F32), *(t.token_logprobs for t in tracks)])
    top_values = np.concatenate([t.topk_values for t in tracks])
    top_ids = np.concatenate([t.topk_ids for t in tracks])
    return {
        "tokens": json_array(len(ids), head=[token_texts(table)[ids]]),
        "token_logprobs": json_values(values),
        # Each row's own token is a candidate too (a duplicate of one in the top-k is dropped with the collisions).
        "top_logprobs": _top_rows(np.concatenate([top_values, values[first.null_prefix:, None]], axis=1),
                                  np.concatenate([top_ids, ids[first.null_prefix:, None]], axis=1),
                                  first.null_prefix, table),
        "text_offset": json_values(_text_offsets(ids, table, text_offset)),
    }


_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
# A lead byte that makes the decoder wait for n continuation bytes (2-, 3- and 4-byte forms that take any).
_LEAD_FOR_CONTINUATIONS = {1: b"\xc2", 2: b"\xe1", 3: b"\xf1"}


def _text_offsets(ids: np.ndarray, table: TokenTable, start: int) -> np.ndarray:
    """Each token's offset in characters, from `start`. Byte-level BPE splits some multi-byte characters over
    tokens: such a character counts once its last byte has come, as the detokenized text grows (OpenAI's and
    vLLM's offsets, and this server's streams), not as a replacement character per piece."""
    lengths = table.text_lengths[ids]
    partial = table.memo("utf8.partial", _partial_tokens)[ids]
    if not partial.any():
        return start + np.cumsum(lengths) - lengths
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pieces = table.token_bytes[ids]
    # A stream's chunk may start inside a character whose first bytes came (and were held back) before it.
    head = b"".join(pieces[:4])[:3]
    if waiting := len(head) - len(head.lstrip(_CONTINUATION_BYTES)):
        decoder.decode(_LEAD_FOR_CONTINUATIONS[waiting])
    offsets = np.empty(len(ids), dtype=np.int64)
    position = start
    for i, (piece, length, broken) in enumerate(zip(pieces, lengths.tolist(), partial.tolist())):
        offsets[i] = position
        position += len(decoder.decode(piece)) if broken or decoder.getstate()[0] else length
    return offsets


def _partial_tokens(table: TokenTable) -> np.ndarray:
    """[size] bool: the token's bytes are not whole UTF-8 characters (a piece of one, split by byte-level BPE)."""
    def broken(piece: bytes) -> bool:
        try:
            piece.decode()
        except UnicodeDecodeError:
            return True
        return False

    return np.fromiter(map(broken, table.token_bytes), dtype=bool, count=table.size)


def _top_rows(values: np.ndarray, ids: np.ndarray, nulls: int, table: TokenTable):
    rows, k = values.shape
    firsts, nexts = _keys(table)
    keep = _best_per_text(table.memo("text.class", _text_classes)[ids], values)
    keys = nexts[ids]
    first_kept = keep.argmax(axis=1)  # every row keeps its best candidate
    keys[np.arange(rows), first_kept] = firsts[ids[np.arange(rows), first_kept]]
    texts = value_texts(values)
    keys[~keep] = texts[~keep] = b""
    return json_array(rows, items=[keys, texts], k=k, tail=[b"}"], nulls=nulls)


def _best_per_text(classes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[rows, k] mask of the candidates to keep: the highest logprob of each text in its row."""
    order = np.lexsort((-values, classes))  # per row: by text, then best first
    grouped = np.take_along_axis(classes, order, axis=-1)
    first = np.ones_like(grouped, dtype=bool)
    first[:, 1:] = grouped[:, 1:] != grouped[:, :-1]
    keep = np.empty_like(first)
    np.put_along_axis(keep, order, first, axis=-1)
    return keep


def _text_classes(table: TokenTable) -> np.ndarray:
    """[size] int: equal for ids with equal text (the last id having that text)."""
    last_with_text = dict(zip(table.texts, range(table.size)))
    return np.fromiter(map(last_with_text.__getitem__, table.texts), dtype=np.int64, count=table.size)


def _keys(table: TokenTable) -> tuple[np.ndarray, np.ndarray]:
    """[size] pieces before each id's logprob in a row object: `{"text":` and `,"text":`."""
    return table.memo("openai.completions.keys", lambda t: (b"{" + token_texts(t) + b":", b"," + token_texts(t) + b":"))
