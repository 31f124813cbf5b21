"""flatwire's public gRPC API (protos/flatwire/v1/generate.proto).

Responses are written through GenerateResponsePacked, the bytes twin of the
published GenerateResponse: the top-k arrays go out as the raw little-endian
buffers the scheduler produced, while clients in other languages read them as
packed `repeated float` / `repeated sfixed32`.
"""

import grpc
import numpy as np

from services.common.arrays import F32, I32
from services.common.pb import arrays_pb2, generate_pb2, scheduler_pb2
from services.gateway.engine import Engine, GenerateInput, RequestError
from services.gateway.result import LogprobTrack

SERVICE_NAME = "flatwire.v1.Generation"
DEFAULT_MAX_NEW_TOKENS = 128
ERROR_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}
FINISH_REASONS = {
    "length": arrays_pb2.FINISH_REASON_LENGTH,
    "abort": arrays_pb2.FINISH_REASON_ABORT,
}


def track_to_block(track: LogprobTrack) -> arrays_pb2.LogprobBlock:
    return arrays_pb2.LogprobBlock(
        rows=[len(track.token_ids)],
        null_prefix=[track.null_prefix],
        token_logprobs=np.ascontiguousarray(track.token_logprobs, dtype=F32).tobytes(),
        topk=[track.k],
        topk_values=np.ascontiguousarray(track.topk_values, dtype=F32).tobytes(),
        topk_ids=np.ascontiguousarray(track.topk_ids, dtype=I32).tobytes(),
        id_counts=[track.ids_logprobs.shape[1]],
        ids_logprobs=np.ascontiguousarray(track.ids_logprobs, dtype=F32).tobytes(),
    )


class GenerationService:
    def __init__(self, engine: Engine):
        self.engine = engine

    def to_input(self, request: generate_pb2.GenerateRequest) -> GenerateInput:
        if bool(request.text) == bool(request.input_ids):
            raise RequestError("invalid_argument", "text", "text: give exactly one of text and input_ids")
        input_ids = list(request.input_ids) or self.engine.tokenizer.encode(request.text, add_special_tokens=False)
        limit = self.engine.model_info.max_top_logprobs
        if request.top_logprobs_num > limit:
            raise RequestError("invalid_argument", "top_logprobs_num",
                               f"top_logprobs_num: {request.top_logprobs_num} is above the maximum {limit}")
        sampling = scheduler_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_new_tokens = sampling.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        return GenerateInput(
            input_ids=input_ids,
            sampling=sampling,
            logprob=scheduler_pb2.LogprobParams(
                return_logprob=request.return_logprob,
                top_logprobs_num=request.top_logprobs_num if request.return_logprob else 0,
                logprob_start_len=request.logprob_start_len if request.HasField("logprob_start_len") else -1,
                token_ids_logprob=request.token_ids_logprob if request.return_logprob else []),
            detokenize=scheduler_pb2.DetokenizeParams(
                skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
                spaces_between_special_tokens=True,
                stop=request.stop,
                no_stop_trim=request.no_stop_trim),
        )

    async def generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            inp = self.to_input(request)
            prompt_tokens = len(inp.input_ids)
            completion_tokens = 0
            async for chunk in self.engine.generate(inp):
                completion_tokens += len(chunk.token_ids)
                result = chunk.result
                if not request.stream and result is None:
                    continue
                response = generate_pb2.GenerateResponsePacked(
                    rid=chunk.rid, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
                if request.stream:
                    response.token_ids = np.asarray(chunk.token_ids, dtype=I32).tobytes()
                    response.text = chunk.text
                    output, prompt = chunk.output, chunk.prompt
                else:
                    response.token_ids = np.asarray(result.output_ids, dtype=I32).tobytes()
                    response.text = result.text
                    output, prompt = result.output, result.prompt
                if output is not None:
                    response.output.CopyFrom(track_to_block(output))
                if prompt is not None:
                    response.prompt.CopyFrom(track_to_block(prompt))
                if result is not None:
                    self._set_finish(response, result)
                yield response
        except RequestError as exc:
            await context.abort(ERROR_CODES[exc.status], exc.message)

    @staticmethod
    def _set_finish(response: generate_pb2.GenerateResponsePacked, result) -> None:
        if result.finish_reason == "stop":
            if isinstance(result.matched_stop, str):
                response.finish_reason = arrays_pb2.FINISH_REASON_STOP_STRING
                response.matched_stop = result.matched_stop
            else:
                response.finish_reason = arrays_pb2.FINISH_REASON_STOP_TOKEN
                response.matched_token = result.matched_stop or 0
        else:
            response.finish_reason = FINISH_REASONS[result.finish_reason]

    async def get_model_info(self, request, context) -> scheduler_pb2.ModelInfo:
        info = scheduler_pb2.ModelInfo()
        info.CopyFrom(self.engine.model_info)
        info.model = self.engine.model_name
        return info


def add_generation_service(server: grpc.aio.Server, engine: Engine) -> None:
    service = GenerationService(engine)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.generate,
            request_deserializer=generate_pb2.GenerateRequest.FromString,
            response_serializer=generate_pb2.GenerateResponsePacked.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.get_model_info,
            request_deserializer=scheduler_pb2.ModelInfoRequest.FromString,
            response_serializer=scheduler_pb2.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
