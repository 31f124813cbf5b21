"""Response renderers: pure functions from a Reply (reply.py) and its views' flat arrays to JSON-ready dicts.

One module per client format. Large lists come back as `orjson.Fragment`s (JSON built
from per-id pieces, see pieces.py): serialize responses with `dumps` or any orjson
call. Candidate text comes from a TokenTable, built on first use.
"""

from services.gateway.render.openai_chat import chat_logprobs
from services.gateway.render.openai_completions import completion_logprobs
from services.gateway.render.pieces import dumps
from services.gateway.render.sglang_meta import LogprobFormat, logprob_meta_info

__all__ = ["LogprobFormat", "chat_logprobs", "completion_logprobs", "dumps", "logprob_meta_info"]
