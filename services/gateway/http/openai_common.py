"""What the OpenAI routes share: model check, ids, finish reasons, usage, meta_info."""

import uuid

from services.gateway.http.context import Gateway
from services.gateway.http.meta_info import base_meta_info
from services.gateway.protocol.openai import OpenAIRequest
from services.gateway.protocol.parse import InvalidRequest
from services.gateway.render.sglang_meta import LogprobFormat, logprob_meta_info
from services.gateway.result import RequestResult


def check_model(gateway: Gateway, model: str) -> None:
    if model != gateway.pipeline.model_name:
        raise InvalidRequest("model", f"The model `{model}` does not exist; this server serves "
                                      f"`{gateway.pipeline.model_name}`", status=404, code="model_not_found")


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_fields(result: RequestResult) -> dict:
    """finish_reason ("stop" | "length" | "abort", as SGLang names them) and SGLang's matched_stop."""
    return {"finish_reason": result.finish_name, "matched_stop": result.matched_stop}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_meta_info(gateway: Gateway, req: OpenAIRequest, result: RequestResult) -> dict:
    """SGLang's meta_info of one choice; with the flat flag, the output candidates live here."""
    fmt = LogprobFormat(return_text_in_logprobs=True,
                        return_flat_raw_output_top_logprobs=req.return_flat_raw_output_top_logprobs,
                        return_flat_raw_top_logprobs_b64=req.return_flat_raw_top_logprobs_b64)
    return base_meta_info(result) | logprob_meta_info(result, fmt, gateway.table)


def openai_format(req: OpenAIRequest, logprobs: bool) -> str:
    """The label of the response's logprob format, for the bytes-sent metric."""
    if req.return_flat_raw_output_top_logprobs:
        return "openai_flat_b64" if req.return_flat_raw_top_logprobs_b64 else "openai_flat_json"
    return "openai" if logprobs else "text"
