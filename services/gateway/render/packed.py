"""The packed protobuf response (GenerateResponsePacked, protos/flatwire/v1/generate.proto): raw
little-endian arrays, no JSON. The public gRPC API sends it; /generate sends it too to a client that
accepts application/x-protobuf, one message per chunk, length-delimited when streaming."""

import numpy as np

from services.common.arrays import I32
from services.common.pb import generate_pb2
from services.gateway.pipeline import Chunk

MEDIA_TYPE = "application/x-protobuf"


def packed_response(chunk: Chunk, prompt_tokens: int, completion_tokens: int) -> generate_pb2.GenerateResponsePacked:
    """One chunk (a stream's, or the whole output) with the request's token counts so far."""
    response = generate_pb2.GenerateResponsePacked(
        rid=chunk.rid, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, text=chunk.text,
        token_ids=np.asarray(chunk.token_ids, dtype=I32).tobytes(),
        weight_versions=[generate_pb2.WeightVersionSpan(version=span.version, start=span.start, end=span.end)
                         for span in chunk.weight_versions])
    if chunk.weight_versions:
        response.weight_version = chunk.weight_versions[-1].version
    if chunk.output is not None:
        response.output.CopyFrom(chunk.output.to_block())
    if chunk.prompt is not None:
        response.prompt.CopyFrom(chunk.prompt.to_block())
    if (result := chunk.result) is not None and result.finish_reason is not None:
        response.finish_reason = result.finish_reason
        if isinstance(result.matched_stop, str):  # STOP_STRING
            response.matched_stop = result.matched_stop
        elif isinstance(result.matched_stop, int):  # STOP_TOKEN
            response.matched_token = result.matched_stop
    return response


def delimited(message: generate_pb2.GenerateResponsePacked) -> bytes:
    """The message after its length as a base-128 varint: protobuf's delimited framing (Java's
    writeDelimitedTo, C++'s SerializeDelimitedToOstream), for a stream of messages over HTTP."""
    data = message.SerializeToString()
    size, prefix = len(data), bytearray()
    while size >= 0x80:
        prefix.append(size & 0x7F | 0x80)
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + data
