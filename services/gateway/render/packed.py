"""The packed protobuf response (GenerateResponsePacked, protos/flatwire/v1/generate.proto): raw
little-endian arrays, no JSON. The public gRPC API sends it; /generate sends it too to a client that
accepts application/x-protobuf, one message per streamed reply, length-delimited."""

import numpy as np
from flatwire_wire.logprobs import I32, LogprobBlock
from flatwire_wire.public import GenerateResponse
from flatwire_wire.steps import FinishReason

from services.gateway.reply import Output, Reply

MEDIA_TYPE = "application/x-protobuf"


def packed_response(reply: Reply, part: Output) -> GenerateResponse:
    """`part` of the reply's output (a stream's event: Reply.new; a whole response: Reply.whole), with the request's
    counts so far and, on its last reply, how it ended."""
    response = GenerateResponse(
        rid=reply.rid, prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens, text=part.text,
        token_ids=np.asarray(part.token_ids, dtype=I32).tobytes(), weight_versions=reply.weight_versions,
        weight_version=reply.weight_version or "",
        output=LogprobBlock.of_request(part.output) if part.output is not None else None,
        prompt=LogprobBlock.of_request(part.prompt) if part.prompt is not None else None)
    if part.top_p is not None:
        response.top_p_token_ids = part.top_p.token_ids.astype(I32, copy=False).tobytes()
        response.top_p_token_offsets = part.top_p.offsets.astype(I32, copy=False).tobytes()
    if part.prompt is not None:
        response.prompt_token_ids = np.concatenate([part.prompt.null_token_ids, part.prompt.token_ids]).astype(
            I32, copy=False).tobytes()
    if (ending := reply.ending) is not None:
        response.finish_reason = ending.reason
        response.cached_tokens = ending.cached_tokens
        if ending.routed_experts is not None:
            response.routed_experts = ending.routed_experts.astype(I32).tobytes()
            response.routed_experts_shape = list(ending.routed_experts.shape)
        if ending.reason is FinishReason.STOP_STRING:
            response.matched_stop = str(ending.matched_stop)
        elif ending.reason is FinishReason.STOP_TOKEN:
            response.matched_token = int(ending.matched_stop or 0)
    return response


def delimited(response: GenerateResponse) -> bytes:
    """The message after its length as a base-128 varint: protobuf's delimited framing (Java's
    writeDelimitedTo, C++'s SerializeDelimitedToOstream), for a stream of messages over HTTP."""
    data = response.to_bytes()
    size, prefix = len(data), bytearray()
    while size >= 0x80:
        prefix.append(size & 0x7F | 0x80)
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + data
