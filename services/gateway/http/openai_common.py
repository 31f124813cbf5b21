"""What the OpenAI routes share: model check, ids, finish reasons, usage, meta_info."""

import time
import uuid

from services.gateway.http.context import Gateway
from services.gateway.http.meta_info import base_meta_info
from services.gateway.protocol.openai import OpenAIRequest
from services.gateway.render.sglang_meta import LogprobFormat, logprob_meta_info
from services.gateway.render.top_p import top_p_meta_info
from services.gateway.reply import Reply


def check_model(gateway: Gateway, req: OpenAIRequest) -> None:
    """The served model (by any name /v1/models lists) or, when the schedulers serve LoRA adapters, one of them
    (OpenAIRequest.choose_model)."""
    info = gateway.engine.model_info
    req.choose_model(gateway.model_names, bool(info and info.max_loras_per_batch))


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chunk_head(gateway: Gateway, req: OpenAIRequest, kind: str, id_prefix: str) -> dict:
    """The fields every chunk of a stream carries; with include_usage, `usage` too, null until the last chunk
    (as OpenAI sends it)."""
    head = {"id": response_id(id_prefix), "object": kind, "created": int(time.time()),
            "model": req.response_model(gateway.engine.model_name)}
    return head | {"usage": None} if req.include_usage else head


def finish_fields(result: Reply) -> dict:
    """finish_reason ("stop" | "length" | "abort", as SGLang names them) and SGLang's matched_stop."""
    return {"finish_reason": result.finish_name,
            "matched_stop": result.ending.matched_stop if result.ending is not None else None}


def usage(prompt_tokens: int, results: list[Reply], n: int) -> dict:
    """OpenAI's usage of a response whose choice p * n + j is prompt p's j-th sample. A prompt's choices share
    it, so its cached tokens are its first choice's (the others found what that one computed), as SGLang."""
    completion_tokens = sum(result.completion_tokens for result in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(result.cached_tokens for result in results[::n])}}


def _meta_format(req: OpenAIRequest) -> LogprobFormat:
    return LogprobFormat(return_text_in_logprobs=True,
                         return_flat_raw_output_top_logprobs=req.return_flat_raw_output_top_logprobs,
                         return_flat_raw_top_logprobs_b64=req.return_flat_raw_top_logprobs_b64)


def choice_meta_info(gateway: Gateway, req: OpenAIRequest, result: Reply) -> dict:
    """SGLang's meta_info of one choice; with the flat flag, the output candidates live here, and with top-p
    replay the nuclei."""
    whole = result.whole
    return base_meta_info(result) | logprob_meta_info(whole, _meta_format(req), gateway.table) | \
        top_p_meta_info(whole.top_p, req.return_flat_raw_top_logprobs_b64)


class StreamedMetaInfo:
    """With return_meta_info, the meta_info of each choice's stream chunks: a chunk's own output logprob
    fields (the flat arrays hold its rows only; output_top_logprobs_offset is the index of the first) and
    nuclei (top_p_token_start, the index of the first), and SGLang's meta_info (id, finish reason, token
    counts, latency) with the last. Concatenated, a choice's arrays are the non-streamed response's."""

    def __init__(self, gateway: Gateway, req: OpenAIRequest, choices: int):
        self.gateway, self.req = gateway, req
        self.rows_sent = [0] * choices

    def chunk(self, index: int, reply: Reply) -> dict | None:
        if not self.req.return_meta_info:
            return None
        new = reply.new
        meta = {"id": reply.rid} | logprob_meta_info(new, _meta_format(self.req), self.gateway.table,
                                                     prompt_side=False)
        if new.output is not None and self.req.return_flat_raw_output_top_logprobs:
            meta["output_top_logprobs_offset"] = self.rows_sent[index]
        meta |= top_p_meta_info(new.top_p, self.req.return_flat_raw_top_logprobs_b64, self.rows_sent[index])
        self.rows_sent[index] += len(new.token_ids)
        return meta

    def last(self, result: Reply) -> dict | None:
        return base_meta_info(result) if self.req.return_meta_info else None


def openai_format(req: OpenAIRequest, logprobs: bool) -> str:
    """The label of the response's logprob format, for the bytes-sent metric."""
    if req.return_flat_raw_output_top_logprobs:
        return "openai_flat_b64" if req.return_flat_raw_top_logprobs_b64 else "openai_flat_json"
    return "openai" if logprobs else "text"
