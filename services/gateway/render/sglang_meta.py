"""The logprob part of a /generate response's meta_info, in the format the request asked for."""

from dataclasses import dataclass

from flatwire_wire.logprobs import RequestLogprobs

from services.gateway.render import sglang_flat, sglang_nested
from services.gateway.reply import Output
from services.gateway.token_table import TokenTable


@dataclass(frozen=True)
class LogprobFormat:
    """SGLang's request flags that shape the logprob fields (same names)."""

    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False  # prompt top-k as flat arrays
    return_flat_raw_output_top_logprobs: bool = False  # output top-k as flat arrays
    return_flat_raw_top_logprobs_b64: bool = False  # flat arrays as base64, not JSON lists


def logprob_meta_info(part: Output, fmt: LogprobFormat, table: TokenTable, prompt_side: bool = True) -> dict:
    """input/output token logprobs, top logprobs (nested or flat) and token-ids logprobs of a part of a request's
    output: the whole (Reply.whole), or a streamed event's (Reply.new).

    Empty when the request did not ask for logprobs. A missing prompt track renders as
    empty prompt fields, as SGLang does. `prompt_side=False` leaves the input fields out
    (a stream's later events repeat those of its first).
    """
    output = part.output
    if output is None:
        return {}
    ids = part.token_ids_logprob
    text = fmt.return_text_in_logprobs
    fields = {}
    sides = [("output", output, fmt.return_flat_raw_output_top_logprobs)]
    if prompt_side:
        prompt = part.prompt or RequestLogprobs.empty(output.k, len(ids or ()))
        sides.insert(0, ("input", prompt, fmt.return_flat_raw_top_logprobs))
    for side, track, flat in sides:
        fields[f"{side}_token_logprobs"] = sglang_nested.token_logprobs(track, table, text)
        if track.k:
            if flat:
                fields |= sglang_flat.flat_top_logprobs(side, track, fmt.return_flat_raw_top_logprobs_b64)
            else:
                fields[f"{side}_top_logprobs"] = sglang_nested.top_logprobs(track, table, text)
        if ids is not None:
            fields[f"{side}_token_ids_logprobs"] = sglang_nested.token_ids_logprobs(track, ids, table, text)
    return fields
