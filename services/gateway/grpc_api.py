"""flatwire's public gRPC API (protos/flatwire/v1/generate.proto), in the wire layer's twins (flatwire_wire.public).

A request is checked by /generate's rules under this API's names (protocol/public.py) and becomes a generation
through the gateway's intake (protocol/intake.py), as /generate's prompts do. Responses go out as
GenerateResponsePacked, the bytes twin of the published GenerateResponse: the top-k arrays are the raw
little-endian buffers the scheduler produced, while clients in other languages read them as packed
`repeated float` / `repeated sfixed32`.

The rollout-control methods go to every scheduler replica and answer per replica
(rollout.py); ADMIN_METHODS need the admin key when the gateway has one.
"""

import asyncio
import dataclasses
from functools import cached_property

import grpc
from flatwire_wire import public
from flatwire_wire.control import (
    RL_CONTROL,
    SGLANG_FLUSH,
    AbortAllRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    Empty,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    ReleaseMemoryOccupationRequest,
    ResumeMemoryOccupationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
)

from services.common.memory import BIG_REQUEST_BYTES, trim_soon
from services.gateway.engine_client import EngineClient, RequestError
from services.gateway.prompts import encode_checked
from services.gateway.protocol.intake import GenerateInput, generate_inputs
from services.gateway.protocol.parse import InvalidRequest, ModelLimits, model_limits, parse_data
from services.gateway.protocol.public import LOGPROB_FIELDS, PublicGenerateRequest
from services.gateway.render.packed import packed_response
from services.gateway.rollout import InitWeightsUpdateGroupInput, control_response, init_weights_update_group
from services.gateway.routing import routing_key

SERVICE_NAME = public.GENERATION.name
ADMIN_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in (
    "UpdateWeightsFromDisk", "PushWeights", "PauseGeneration", "ContinueGeneration", "AbortAll",
    "UpdateWeightVersion", "FlushCache", *RL_CONTROL))
ERROR_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}


def _refusal(exc: InvalidRequest) -> RequestError:
    """gRPC has no field of its own for the offending parameter: the details start with it."""
    message = exc.message
    if exc.param and not message.startswith(f"{exc.param}:"):
        message = f"{exc.param}: {message}"
    return RequestError("invalid_argument", exc.param, message)


class GenerationService:
    def __init__(self, engine: EngineClient):
        self.engine = engine

    @cached_property
    def limits(self) -> ModelLimits:
        return model_limits(self.engine.model_info, self.engine.config)

    def to_input(self, request: public.GenerateRequest) -> GenerateInput:
        """The request checked as /generate checks its JSON (errors name this API's fields), tokenized, through the
        intake. Blocking (validation, tokenization): generate() runs it in a worker thread."""
        try:
            req = PublicGenerateRequest.of(request, self.limits)
            input_ids = req.input_ids
            if input_ids is None:  # a text that cannot fit the context is refused before it is tokenized
                input_ids = encode_checked(self.engine.tokenizer, [request.text], self.limits.max_context,
                                           req.prompt_field, add_special_tokens=False)[0]
            [inp] = generate_inputs([(req.prompt(), input_ids)], self.limits, LOGPROB_FIELDS)
        except InvalidRequest as exc:
            raise _refusal(exc) from None
        return inp

    async def generate(self, request: public.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            # Off the event loop: tokenizing a long text takes seconds that HTTP and other streams must not wait.
            inp = await asyncio.to_thread(self.to_input, request)
            inp.routing_key = routing_key(dict(context.invocation_metadata() or ()))
            async for reply in self.engine.generate(inp):
                # A stream's reply: what it brought; otherwise the only reply, at the end: the whole output.
                yield packed_response(reply, reply.new if request.stream else reply.whole)
        except RequestError as exc:
            # The status, then a plain return: context.abort() would raise an AbortError chained to this
            # exception, whose traceback holds the request's frames (a 20 MB text), and grpc keeps the
            # AbortError in the call's state, a reference cycle that only the garbage collector frees.
            context.set_code(ERROR_CODES[exc.status])
            context.set_details(exc.message)
        finally:
            if len(request.text) + sum(map(len, request.stop)) + 4 * len(request.input_ids) >= BIG_REQUEST_BYTES:
                trim_soon()  # its decoded message and tokens are freed by now, or soon: hand the memory back

    async def get_model_info(self, request: Empty, context) -> public.ModelInfo:
        info = self.engine.model_info
        assert info is not None, "the gateway serves once it knows the model"
        return public.ModelInfo(model=self.engine.model_name, vocab_size=info.vocab_size,
                                max_context=info.max_context, eos_token_ids=info.eos_token_ids,
                                max_top_logprobs=info.max_top_logprobs, device=info.device, dtype=info.dtype,
                                weight_version=self.engine.schedulers.weight_version())

    async def abort(self, request: public.AbortGenerationRequest, context) -> public.ControlResponse:
        stopped = self.engine.abort(request.rid)
        return public.ControlResponse(success=stopped, message="aborted" if stopped else
                                      f"no running request {request.rid!r} on this gateway")

    async def _everywhere(self, call) -> public.ControlResponse:
        return control_response(await self.engine.schedulers.control(call))

    async def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest, context) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.update_weights_from_disk(request))

    async def push_weights(self, chunks, context) -> public.ControlResponse:
        return control_response(await self.engine.schedulers.push_weights(chunks))

    async def pause_generation(self, request: PauseGenerationRequest, context) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.pause_generation(request))

    async def continue_generation(self, request: ContinueGenerationRequest, context) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.continue_generation(request))

    async def abort_all(self, request: AbortAllRequest, context) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.abort_all(request))

    async def update_weight_version(self, request: UpdateWeightVersionRequest, context) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.update_weight_version(request))

    async def flush_cache(self, request: Empty, context) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.flush_cache(SGLANG_FLUSH))

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest, context
                                        ) -> public.ControlResponse:
        # proto3's unset strings are absent fields to the checks: "" would pass as an address and fail as a backend
        fields = {name: value for name, value in dataclasses.asdict(request).items() if value != ""}
        try:
            join = parse_data(InitWeightsUpdateGroupInput, fields, self.limits)
        except InvalidRequest as exc:
            message = _refusal(exc).message
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(message)
            return public.ControlResponse(success=False, message=message)
        return await init_weights_update_group(self.engine.schedulers, join.message())

    async def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest, context
                                              ) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.update_weights_from_distributed(request))

    async def destroy_weights_update_group(self, request: DestroyWeightsUpdateGroupRequest, context
                                           ) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.destroy_weights_update_group(request))

    async def release_memory_occupation(self, request: ReleaseMemoryOccupationRequest, context
                                        ) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.release_memory_occupation(request))

    async def resume_memory_occupation(self, request: ResumeMemoryOccupationRequest, context
                                       ) -> public.ControlResponse:
        return await self._everywhere(lambda client: client.resume_memory_occupation(request))


def add_generation_service(server: grpc.aio.Server, engine: EngineClient) -> None:
    public.GENERATION.add_to(server, GenerationService(engine))
