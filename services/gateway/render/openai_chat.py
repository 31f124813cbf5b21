"""OpenAI chat completions' `choices[].logprobs`: {"content": [{token, bytes, logprob, top_logprobs}]}.

`token` is decode([id]); `bytes` are the token's own bytes (a byte token that is half
of a UTF-8 character gives that one byte). top_logprobs is a list, so candidates whose
texts collide stay separate entries. With `candidates=False` (the flat flag: the
candidates travel in meta_info instead) every top_logprobs list is empty. The same
call renders a whole response or one stream chunk: pass that chunk's rows.
"""

import numpy as np
from flatwire_wire.logprobs import RequestLogprobs

from services.gateway.render.pieces import json_array, token_texts, value_texts
from services.gateway.token_table import TokenTable

_BYTE_TEXTS = [str(byte).encode() for byte in range(256)]


def chat_logprobs(track: RequestLogprobs, table: TokenTable, candidates: bool = True) -> dict:
    opens, nexts = _entry_heads(table)
    k = track.k if candidates else 0
    heads = nexts[track.topk_ids[:, :k]]
    heads[:, :1] = opens[track.topk_ids[:, :1]]
    content = json_array(
        len(track.token_ids),
        head=[opens[track.token_ids], value_texts(track.token_logprobs), b',"top_logprobs":['],
        items=[heads, value_texts(track.topk_values[:, :k])],
        k=k,
        tail=[b"}]}" if k else b"]}"],
    )
    return {"content": content}


def _entry_heads(table: TokenTable) -> tuple[np.ndarray, np.ndarray]:
    """[size] pieces up to each id's logprob: opening its entry (`{"token":..,"bytes":[..],"logprob":`),
    and closing the previous entry then opening it (`},{"token":...`)."""

    def build(t: TokenTable) -> tuple[np.ndarray, np.ndarray]:
        byte_lists = np.empty(t.size, dtype=object)
        byte_lists[:] = [b"[" + b",".join(map(_BYTE_TEXTS.__getitem__, raw)) + b"]" for raw in t.token_bytes]
        opens = b'{"token":' + token_texts(t) + b',"bytes":' + byte_lists + b',"logprob":'
        return opens, b"}," + opens

    return table.memo("openai.chat.heads", build)
