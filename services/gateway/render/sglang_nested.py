"""SGLang's nested logprob fields: `[logprob, token_id, text|null]` triples.

`*_token_logprobs`: one triple per position (null-prefix positions carry a null
logprob). `*_top_logprobs`: per position a list of k triples, null for null-prefix
positions. `*_token_ids_logprobs`: per position one triple per requested id. Text is
decode([id]) from the token table, only with return_text_in_logprobs.
"""

import numpy as np
import orjson
from flatwire_wire.logprobs import F32, I32, RequestLogprobs

from services.gateway.render.pieces import id_texts, json_array, token_texts, value_texts
from services.gateway.token_table import TokenTable

# Up to this many rows without a null prefix (a streamed event's), triples are joined in Python: less than the
# [rows, pieces] grid costs to set up.
FEW_ROWS = 32


def token_logprobs(track: RequestLogprobs, table: TokenTable, with_text: bool) -> orjson.Fragment:
    if not track.null_prefix and len(track.token_ids) <= FEW_ROWS:
        closes = _tails(table, with_text)[0][track.token_ids].tolist()
        values = value_texts(track.token_logprobs).tolist()
        return orjson.Fragment(b"[" + b",".join([b"[" + v + c for v, c in zip(values, closes)]) + b"]")
    ids = np.concatenate([track.null_token_ids, track.token_ids]).astype(I32, copy=False)
    values = np.concatenate([np.full(track.null_prefix, np.nan, dtype=F32), track.token_logprobs])
    closes, _ = _tails(table, with_text)
    return json_array(len(ids), head=[b"[", value_texts(values), closes[ids]])


def top_logprobs(track: RequestLogprobs, table: TokenTable, with_text: bool) -> orjson.Fragment:
    return _triple_rows(track, track.topk_values, track.topk_ids, table, with_text)


def token_ids_logprobs(
    track: RequestLogprobs, token_ids: list[int], table: TokenTable, with_text: bool
) -> orjson.Fragment:
    return _triple_rows(track, track.ids_logprobs, np.asarray(token_ids, dtype=I32), table, with_text)


def _triple_rows(track: RequestLogprobs, values: np.ndarray, ids: np.ndarray, table: TokenTable, with_text: bool):
    """Rows of triples: `[[v,id,t],[v,id,t]]`; ids is [rows, k], or [k] for the same ids on every row."""
    rows, k = values.shape
    if not k:
        return json_array(rows, head=[b"[]"], nulls=track.null_prefix)
    closes, nexts = _tails(table, with_text)
    tails = nexts[ids]
    tails[..., -1] = closes[ids[..., -1]]
    return json_array(rows, head=[b"[["], items=[value_texts(values), tails], k=k, tail=[b"]"], nulls=track.null_prefix)


def _tails(table: TokenTable, with_text: bool) -> tuple[np.ndarray, np.ndarray]:
    """[size] pieces following each id's logprob: closing its triple (`,id,"text"]`, or
    `,id,null]` without text) and closing it then opening the next (`...],[`)."""

    def build(t: TokenTable) -> tuple[np.ndarray, np.ndarray]:
        closes = b"," + id_texts(t.size) + (b"," + token_texts(t) + b"]" if with_text else b",null]")
        return closes, closes + b",["

    return table.memo(f"sglang.tails.{'text' if with_text else 'id'}", build)
