"""Top-p replay in meta_info (flatwire_wire.nucleus): each output token's nucleus as slime reads it.

`top_p_token_ids`: the nuclei's ids, flat; `top_p_token_offsets`: tokens + 1 offsets into them, from 0 (token i's
nucleus is ids[offsets[i]:offsets[i + 1]]); JSON lists of ints, or with the flat base64 flag
(return_flat_raw_top_logprobs_b64) `top_p_token_ids_b64` and `top_p_token_offsets_b64`, base64 of little-endian
int32, as the flat top-k formats write theirs. An event that carries only its own tokens' nuclei (a flat or OpenAI
stream's) says where they start: `top_p_token_start`, the index of its first token.
"""

import orjson
from flatwire_wire.logprobs import I32
from flatwire_wire.nucleus import Nuclei

from services.gateway.render.pieces import NUMPY, json_values
from services.gateway.render.sglang_flat import b64_text


def top_p_meta_info(nuclei: Nuclei | None, b64: bool, start: int | None = None) -> dict:
    """The fields of `nuclei` (none when the request did not ask); `start`: the index of their first token, for an
    event that carries part of the output."""
    if nuclei is None:
        return {}
    if b64:
        fields = {"top_p_token_ids_b64": b64_text(nuclei.token_ids, I32),
                  "top_p_token_offsets_b64": b64_text(nuclei.offsets, I32),
                  "top_p_token_ids_b64_dtype": "int32", "top_p_token_offsets_b64_dtype": "int32"}
    else:
        fields = {"top_p_token_ids": json_values(nuclei.token_ids),
                  "top_p_token_offsets": json_values(nuclei.offsets)}
    return fields if start is None else fields | {"top_p_token_start": start}


class CumulativeTopP:
    """A /generate stream's nuclei so far as JSON lists (SGLang's cumulative events), each event's appended to the
    JSON already written: an event's work does not grow with the output so far."""

    def __init__(self) -> None:
        self._ids = bytearray()  # the elements so far: "i1,i2,..."
        self._offsets = bytearray(b"0")
        self._total = 0  # ids so far

    def add(self, nuclei: Nuclei) -> dict:
        """The fields of the output so far, with `nuclei` (the new tokens') appended."""
        if ids := orjson.dumps(nuclei.token_ids, option=NUMPY)[1:-1]:
            self._ids += b"," + ids if self._ids else ids
        if nuclei.tokens:
            self._offsets += b"," + orjson.dumps(nuclei.offsets[1:] + self._total, option=NUMPY)[1:-1]
        self._total += len(nuclei.token_ids)
        return {"top_p_token_ids": orjson.Fragment(b"[" + self._ids + b"]"),
                "top_p_token_offsets": orjson.Fragment(b"[" + self._offsets + b"]")}
