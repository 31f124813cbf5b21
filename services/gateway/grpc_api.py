"""flatwire's public gRPC API (protos/flatwire/v1/generate.proto).

Responses are written through GenerateResponsePacked, the bytes twin of the
published GenerateResponse: the top-k arrays go out as the raw little-endian
buffers the scheduler produced, while clients in other languages read them as
packed `repeated float` / `repeated sfixed32`.

The rollout-control methods go to every scheduler replica and answer per replica
(rollout.py); ADMIN_METHODS need the admin key when the gateway has one.
"""

import asyncio
from functools import cached_property

import grpc

from services.common.memory import BIG_REQUEST_BYTES, trim_soon
from services.common.pb import generate_pb2, scheduler_pb2
from services.gateway.http.generate import generate_input
from services.gateway.http.prompts import encode_checked
from services.gateway.pipeline import GenerateInput, PipelineClient, RequestError
from services.gateway.protocol.limits import LogprobFields, check_logprob_elements
from services.gateway.protocol.parse import InvalidRequest, ModelLimits, model_limits, parse_data, renamed
from services.gateway.protocol.sglang import GenerateRequest
from services.gateway.render.packed import packed_response
from services.gateway.rollout import control_response

SERVICE_NAME = "flatwire.v1.Generation"
ADMIN_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in (
    "UpdateWeightsFromDisk", "PushWeights", "PauseGeneration", "ContinueGeneration", "AbortAll",
    "UpdateWeightVersion"))
ERROR_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


# /generate's field names -> this API's (GenerateRequest has `sampling`, and stop & co. at the top).
GRPC_FIELDS = {"sampling_params": "sampling", "sampling_params.stop": "stop",
               "sampling_params.skip_special_tokens": "skip_special_tokens",
               "sampling_params.no_stop_trim": "no_stop_trim"}


def generate_fields(request: generate_pb2.GenerateRequest) -> dict:
    """The public GenerateRequest as /generate's JSON fields, defaults as the proto documents them."""
    sampling = request.sampling
    options = {"stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": sampling.ignore_eos,
               "stop": list(request.stop), "no_stop_trim": request.no_stop_trim}
    for name in ("max_new_tokens", "temperature", "top_p", "min_p", "seed"):  # unset: /generate's default
        if sampling.HasField(name):
            options[name] = getattr(sampling, name)
    if sampling.HasField("top_k") and sampling.top_k > 0:  # unset or <= 0: no limit
        options["top_k"] = sampling.top_k
    for name in ("frequency_penalty", "presence_penalty", "min_new_tokens"):
        if getattr(sampling, name):  # 0: off
            options[name] = getattr(sampling, name)
    if sampling.HasField("repetition_penalty"):
        options["repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        options["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias.items()}
    if constraint := sampling.WhichOneof("constraint"):  # json_schema, regex or ebnf
        options[constraint] = getattr(sampling, constraint)
    if request.HasField("skip_special_tokens"):
        options["skip_special_tokens"] = request.skip_special_tokens
    fields = {"sampling_params": options, "return_logprob": request.return_logprob,
              "top_logprobs_num": request.top_logprobs_num, "token_ids_logprob": list(request.token_ids_logprob),
              "stream": request.stream}
    if request.HasField("logprob_start_len"):
        fields["logprob_start_len"] = request.logprob_start_len
    if request.text:
        fields["text"] = request.text
    if request.input_ids:
        fields["input_ids"] = list(request.input_ids)
    return fields


LOGPROB_FIELDS = LogprobFields(top_k="top_logprobs_num", max_new_tokens="sampling.max_new_tokens",
                               token_ids="token_ids_logprob", prompt="the prompt from logprob_start_len")


def _refusal(exc: InvalidRequest) -> RequestError:
    """gRPC has no field of its own for the offending parameter: the details start with it."""
    exc = renamed(exc, GRPC_FIELDS)
    message = exc.message
    if exc.param and not message.startswith(f"{exc.param}:"):
        message = f"{exc.param}: {message}"
    return RequestError("invalid_argument", exc.param, message)


class GenerationService:
    def __init__(self, pipeline: PipelineClient):
        self.pipeline = pipeline

    @cached_property
    def limits(self) -> ModelLimits:
        return model_limits(self.pipeline.model_info, self.pipeline.config)

    def to_input(self, request: generate_pb2.GenerateRequest) -> GenerateInput:
        """Blocking (validation, tokenization): generate() runs it in a worker thread."""
        req = self.validate(request)
        input_ids = list(request.input_ids)
        if not input_ids:
            try:  # a text that cannot fit the context is refused before it is tokenized
                input_ids = encode_checked(self.pipeline.tokenizer, [request.text], self.limits.max_context,
                                           req.prompt_field, add_special_tokens=False)[0]
            except InvalidRequest as exc:
                raise _refusal(exc) from None
        return self.checked_input(req, input_ids)

    def validate(self, request: generate_pb2.GenerateRequest) -> GenerateRequest:
        """The request as /generate's model, through /generate's checks; errors name this API's fields."""
        try:
            return parse_data(GenerateRequest, generate_fields(request), self.limits)
        except InvalidRequest as exc:
            raise _refusal(exc) from None

    def checked_input(self, req: GenerateRequest, input_ids: list[int]) -> GenerateInput:
        """/generate's checks that need the tokens (lengths, logprob_start_len), then the scheduler's input."""
        try:
            inp = generate_input(req, 0, input_ids, self.limits)
            check_logprob_elements([inp], self.limits, LOGPROB_FIELDS)
        except InvalidRequest as exc:
            raise _refusal(exc) from None
        inp.fields = {"input_ids": req.prompt_field, "logprob": ""}  # `sampling` is this API's name too
        return inp

    async def generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            # Off the event loop: tokenizing a long text takes seconds that HTTP and other streams must not wait.
            inp = await asyncio.to_thread(self.to_input, request)
            prompt_tokens = len(inp.input_ids)
            completion_tokens = 0
            async for chunk in self.pipeline.generate(inp):
                completion_tokens += len(chunk.token_ids)
                if not request.stream and chunk.result is None:
                    continue
                # Without stream, the only chunk is the whole output (the pipeline wakes it once, at the end).
                yield packed_response(chunk, prompt_tokens, completion_tokens)
        except RequestError as exc:
            # The status, then a plain return: context.abort() would raise an AbortError chained to this
            # exception, whose traceback holds the request's frames (a 20 MB text), and grpc keeps the
            # AbortError in the call's state, a reference cycle that only the garbage collector frees.
            context.set_code(ERROR_CODES[exc.status])
            context.set_details(exc.message)
        finally:
            if len(request.text) + sum(map(len, request.stop)) + 4 * len(request.input_ids) >= BIG_REQUEST_BYTES:
                trim_soon()  # its decoded message and tokens are freed by now, or soon: hand the memory back

    async def get_model_info(self, request, context) -> scheduler_pb2.ModelInfo:
        info = scheduler_pb2.ModelInfo()
        info.CopyFrom(self.pipeline.model_info)
        info.model = self.pipeline.model_name
        info.weight_version = self.pipeline.schedulers.weight_version()
        return info

    async def abort(self, request: generate_pb2.AbortGenerationRequest, context) -> generate_pb2.ControlResponse:
        stopped = self.pipeline.abort(request.rid)
        return generate_pb2.ControlResponse(success=True, message="aborted" if stopped else
                                            f"no running request {request.rid!r} on this gateway")

    async def _everywhere(self, call) -> generate_pb2.ControlResponse:
        return control_response(await self.pipeline.schedulers.control(call))

    async def update_weights_from_disk(self, request, context) -> generate_pb2.ControlResponse:
        return await self._everywhere(lambda stub: stub.UpdateWeightsFromDisk(request))

    async def push_weights(self, request_iterator, context) -> generate_pb2.ControlResponse:
        return control_response(await self.pipeline.schedulers.push_weights(request_iterator))

    async def pause_generation(self, request, context) -> generate_pb2.ControlResponse:
        return await self._everywhere(lambda stub: stub.PauseGeneration(request))

    async def continue_generation(self, request, context) -> generate_pb2.ControlResponse:
        return await self._everywhere(lambda stub: stub.ContinueGeneration(request))

    async def abort_all(self, request, context) -> generate_pb2.ControlResponse:
        return await self._everywhere(lambda stub: stub.AbortAll(request))

    async def update_weight_version(self, request, context) -> generate_pb2.ControlResponse:
        return await self._everywhere(lambda stub: stub.UpdateWeightVersion(request))


def add_generation_service(server: grpc.aio.Server, pipeline: PipelineClient) -> None:
    service = GenerationService(pipeline)
    respond = generate_pb2.ControlResponse.SerializeToString

    def control(method, request_type) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(method, request_deserializer=request_type.FromString,
                                                   response_serializer=respond)

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.generate,
            request_deserializer=generate_pb2.GenerateRequest.FromString,
            response_serializer=generate_pb2.GenerateResponsePacked.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.get_model_info,
            request_deserializer=scheduler_pb2.ModelInfoRequest.FromString,
            response_serializer=scheduler_pb2.ModelInfo.SerializeToString),
        "Abort": control(service.abort, generate_pb2.AbortGenerationRequest),
        "UpdateWeightsFromDisk": control(service.update_weights_from_disk, scheduler_pb2.UpdateWeightsFromDiskRequest),
        "PushWeights": grpc.stream_unary_rpc_method_handler(
            service.push_weights, request_deserializer=scheduler_pb2.WeightsChunk.FromString,
            response_serializer=respond),
        "PauseGeneration": control(service.pause_generation, scheduler_pb2.PauseGenerationRequest),
        "ContinueGeneration": control(service.continue_generation, scheduler_pb2.ContinueGenerationRequest),
        "AbortAll": control(service.abort_all, scheduler_pb2.AbortAllRequest),
        "UpdateWeightVersion": control(service.update_weight_version, scheduler_pb2.UpdateWeightVersionRequest),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
