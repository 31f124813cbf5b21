"""SGLang's meta_info fields that are not logprobs: id, token counts, finish_reason, latency, weight versions,
routed experts."""

import pybase64
from flatwire_wire.steps import FinishReason

from services.gateway.result import RequestResult


def finish_reason(result: RequestResult) -> dict | None:
    """SGLang's finish_reason object; None while the request runs."""
    if result.finish_reason is None:  # every streamed event but the last
        return None
    match result.finish_reason:
        case FinishReason.LENGTH:
            return {"type": "length", "length": result.completion_tokens}
        case FinishReason.STOP_TOKEN | FinishReason.STOP_STRING:
            return {"type": "stop", "matched": result.matched_stop}
        case FinishReason.ABORT:
            return {"type": "abort", "message": result.error or "aborted"}
    return None


def base_meta_info(result: RequestResult) -> dict:
    return {
        "id": result.rid,
        "finish_reason": finish_reason(result),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,  # prompt tokens found in the prefix cache
        "e2e_latency": result.e2e_latency,
        # As SGLang: the version that produced the last token, and the output ranges of each version.
        "weight_version": result.weight_version,
        "weight_versions": [{"version": span.version, "start": span.start, "end": span.end}
                            for span in result.weight_versions],
        **routed_experts(result),
    }


def routed_experts(result: RequestResult) -> dict:
    """SGLang's routed_experts (base64 of the int32 array, token-major) and its [tokens, layers, top_k] shape."""
    if result.routed_experts is None:
        return {}
    return {"routed_experts": pybase64.b64encode(result.routed_experts.astype("<i4").tobytes()).decode(),
            "routed_experts_shape": list(result.routed_experts.shape)}
