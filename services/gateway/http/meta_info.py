"""SGLang's meta_info fields that are not logprobs: id, token counts, finish_reason, latency, weight versions,
routed experts."""

import pybase64
from flatwire_wire.steps import FinishReason

from services.gateway.reply import Reply


def finish_reason(reply: Reply) -> dict | None:
    """SGLang's finish_reason object; None while the request runs."""
    ending = reply.ending
    if ending is None:  # every streamed event but the last
        return None
    match ending.reason:
        case FinishReason.LENGTH:
            return {"type": "length", "length": reply.completion_tokens}
        case FinishReason.STOP_TOKEN | FinishReason.STOP_STRING:
            return {"type": "stop", "matched": ending.matched_stop}
        case FinishReason.ABORT:
            return {"type": "abort", "message": ending.error}
    return None


def base_meta_info(reply: Reply) -> dict:
    """Of the request so far (at its end, on its last reply)."""
    return {
        "id": reply.rid,
        "finish_reason": finish_reason(reply),
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "cached_tokens": reply.cached_tokens,  # prompt tokens found in the prefix cache
        "e2e_latency": reply.e2e_latency,
        # As SGLang: the version that produced the last token, and the output ranges of each version.
        "weight_version": reply.weight_version,
        "weight_versions": [{"version": span.version, "start": span.start, "end": span.end}
                            for span in reply.weight_versions],
        **routed_experts(reply),
    }


def routed_experts(reply: Reply) -> dict:
    """SGLang's routed_experts (base64 of the int32 array, token-major) and its [tokens, layers, top_k] shape."""
    experts = reply.ending.routed_experts if reply.ending is not None else None
    if experts is None:
        return {}
    return {"routed_experts": pybase64.b64encode(experts.astype("<i4").tobytes()).decode(),
            "routed_experts_shape": list(experts.shape)}
