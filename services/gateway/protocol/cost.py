"""Limits on what one request may cost the servers: its stop strings and the size of its response.

- Stop strings: at each step the detokenizer looks for every stop string of every request in
  its new text, and for the longest partial match at its end (up to a call per character of
  each string): 20k strings of 200 characters made an unrelated request 16x slower. A request
  may give at most --max-stop-strings (32; OpenAI allows 4, SGLang has no limit) of at most
  --max-stop-length (256) characters each: at worst ~1 ms of detokenizer time per step for
  such a request, where 64 x 1024 would be 7.4 ms (measured on this 2-core machine).
- Logprob values: a request asks for positions x (top_logprobs_num + len(token_ids_logprob))
  values, where the positions are its max_new_tokens plus, with logprob_start_len >= 0, the
  prompt from there on. 13 KB of request (1000 prompt tokens from position 0, top 256, 1000
  ids) asks for 1.4M values: a 30 MB response. Summed over a request's generations (a batch,
  n), at most --max-logprob-elements (4Mi: a whole 4096-token context at top-256 and 768
  ids, or a batch of 32 such 128-token top-256 requests) are served.
"""

from dataclasses import dataclass

from flatwire_wire.scheduler import LogprobParams
from pydantic import ValidationInfo

from services.gateway.protocol.parse import InvalidRequest, limits_of


def check_stop(stop: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
    """AfterValidator of a request's `stop` (str or list of str)."""
    if not stop:
        return stop
    limits = limits_of(info)
    strings = [stop] if isinstance(stop, str) else stop
    if len(strings) > limits.max_stop_strings:
        raise ValueError(f"{len(strings)} stop strings; this server's maximum (max_stop_strings) is "
                         f"{limits.max_stop_strings}")
    longest = max(map(len, strings))
    if longest > limits.max_stop_length:
        raise ValueError(f"a stop string of {longest} characters; this server's maximum (max_stop_length) is "
                         f"{limits.max_stop_length}")
    return stop


@dataclass(frozen=True)
class LogprobFields:
    """How the client's API names the fields that size a response (for the error message)."""

    top_k: str  # top_logprobs_num, top_logprobs, logprobs
    max_new_tokens: str
    token_ids: str | None = None  # token_ids_logprob, where the API has it
    prompt: str | None = None  # what asks for prompt logprobs, where the API has them ("the prompt from ...")
    n: str | None = None  # n, where the API has it


def logprob_elements(prompt_len: int, max_new_tokens: int, logprob: LogprobParams) -> tuple[int, int]:
    """(positions, values per position) one generation asks logprobs for."""
    if not logprob.return_logprob:
        return 0, 0
    per_position = logprob.top_logprobs_num + len(logprob.token_ids_logprob)
    positions = max_new_tokens
    if logprob.logprob_start_len >= 0:  # the first prompt token has no logprob: nothing precedes it
        positions += max(prompt_len - max(logprob.logprob_start_len, 1), 0)
    return positions, per_position


def check_logprob_elements(inputs, limits, fields: LogprobFields) -> None:
    """Refuse a request whose generations (GenerateInputs) ask for more than limits.max_logprob_elements
    logprob values in all; the error names the fields that size it."""
    total, sizes = 0, []
    for inp in inputs:
        positions, per_position = logprob_elements(len(inp.input_ids), inp.sampling.max_new_tokens, inp.logprob)
        total += positions * per_position
        sizes.append((positions, per_position))
    limit = limits.max_logprob_elements
    if total <= limit:
        return
    uses_top_k = any(inp.logprob.top_logprobs_num for inp in inputs)
    param = fields.top_k if uses_top_k or not fields.token_ids else fields.token_ids
    if len(sizes) == 1:
        what = f"{sizes[0][0]} positions x {sizes[0][1]} values"
    else:
        what = f"{len(sizes)} generations"
    position_names = " + ".join(name for name in (fields.max_new_tokens, fields.prompt) if name)
    value_names = " + ".join(name for name in (fields.top_k, fields.token_ids and f"len({fields.token_ids})") if name)
    count = f" x {fields.n}" if fields.n else ""
    raise InvalidRequest(param, f"{param}: the response would carry {total} logprob values ({what}); this server's "
                                f"maximum (max_logprob_elements) is {limit}. It counts positions ({position_names}) x "
                                f"values per position ({value_names}){count}")
