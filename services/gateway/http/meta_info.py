"""SGLang's meta_info fields that are not logprobs: id, token counts, finish_reason, latency."""

from services.gateway.result import RequestResult


def finish_reason(result: RequestResult) -> dict | None:
    """SGLang's finish_reason object; None while the request runs."""
    if result.finish_reason == "length":
        return {"type": "length", "length": result.completion_tokens}
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.matched_stop}
    if result.finish_reason == "abort":
        return {"type": "abort", "message": result.error or "aborted"}
    return None


def base_meta_info(result: RequestResult) -> dict:
    return {
        "id": result.rid,
        "finish_reason": finish_reason(result),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "e2e_latency": result.e2e_latency,
    }
