"""The packed protobuf response (GenerateResponsePacked, protos/flatwire/v1/generate.proto): raw
little-endian arrays, no JSON. The public gRPC API sends it; /generate sends it too to a client that
accepts application/x-protobuf, one message per chunk, length-delimited when streaming."""

import numpy as np
from flatwire_wire.logprobs import I32, LogprobBlock
from flatwire_wire.public import GenerateResponse
from flatwire_wire.steps import FinishReason

from services.gateway.engine_client import Chunk

MEDIA_TYPE = "application/x-protobuf"


def packed_response(chunk: Chunk, prompt_tokens: int, completion_tokens: int) -> GenerateResponse:
    """One chunk (a stream's, or the whole output) with the request's token counts so far."""
    response = GenerateResponse(
        rid=chunk.rid, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, text=chunk.text,
        token_ids=np.asarray(chunk.token_ids, dtype=I32).tobytes(), weight_versions=chunk.weight_versions,
        weight_version=chunk.weight_versions[-1].version if chunk.weight_versions else "",
        output=LogprobBlock.of_request(chunk.output) if chunk.output is not None else None,
        prompt=LogprobBlock.of_request(chunk.prompt) if chunk.prompt is not None else None)
    if chunk.prompt is not None:
        response.prompt_token_ids = np.concatenate([chunk.prompt.null_token_ids, chunk.prompt.token_ids]).astype(
            I32, copy=False).tobytes()
    if (result := chunk.result) is not None and result.finish_reason is not None:
        response.finish_reason = result.finish_reason
        response.cached_tokens = result.cached_tokens
        if result.routed_experts is not None:
            response.routed_experts = result.routed_experts.astype(I32).tobytes()
            response.routed_experts_shape = list(result.routed_experts.shape)
        if result.finish_reason is FinishReason.STOP_STRING:
            response.matched_stop = str(result.matched_stop)
        elif result.finish_reason is FinishReason.STOP_TOKEN:
            response.matched_token = int(result.matched_stop or 0)
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
