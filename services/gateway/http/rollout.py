"""SGLang's rollout-control routes, for RL trainers: weight updates (from disk, or broadcast over a trainer's
torch.distributed group), pause and continue, abort, weight_version, releasing and resuming memory.

Each call goes to every scheduler replica (SchedulerPool.control) and is answered in SGLang's shape
(sglang/srt/entrypoints/http_server.py) plus `replicas`: each replica's own reply, by address.
They are admin routes (http/auth.py: --admin-api-key when set); /abort_request by rid is not.
What each does in a scheduler is in services/scheduler/engine/rollout.py.

/update_weights_from_tensor is refused: SGLang's payload, `serialized_named_tensors`, is pickled
(torch's MultiprocessingSerializer), and unpickling a request body runs whatever code it names. The
same update goes as safetensors bytes over the public gRPC API (Generation/PushWeights), or as a
checkpoint on disk (/update_weights_from_disk).
"""

from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, TypeVar

import orjson
from fastapi import APIRouter, Request, Response
from flatwire_wire import control
from flatwire_wire.control import PauseMode
from flatwire_wire.public import ControlResponse
from flatwire_wire.scheduler import SchedulerClient
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.http.auth import require_admin
from services.gateway.http.context import Gateway, gateway_of
from services.gateway.http.errors import error_response
from services.gateway.http.guards import parse_body_off_loop
from services.gateway.http.openapi import request_body
from services.gateway.rollout import InitWeightsUpdateGroupInput, control_response, init_weights_update_group

router = APIRouter()
M = TypeVar("M", bound=BaseModel)
PAUSE_MODES = {"abort": PauseMode.ABORT, "in_place": PauseMode.IN_PLACE, "retract": PauseMode.RETRACT}
NO_PICKLE = ("update_weights_from_tensor is not supported: SGLang's serialized_named_tensors are pickled (torch's "
             "MultiprocessingSerializer), and unpickling a request body runs whatever code it names. Push the "
             "tensors as safetensors over gRPC instead (flatwire.v1.Generation/PushWeights; "
             "flatwire_client.FlatwireClient.push_weights), or save a checkpoint and POST /update_weights_from_disk.")


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput. Its other fields are taken at what flatwire does (a client that
    sends every field sends those), and refused by name otherwise: flush_cache as in the distributed update."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: Literal[False] = False
    torch_empty_cache: Literal[False] = False
    keep_pause: Literal[False] = False
    recapture_cuda_graph: Literal[False] = False
    token_step: Literal[0] = 0
    manifest: None = None


class UpdateWeightsFromDistributedRequest(BaseModel):
    """SGLang's UpdateWeightsFromDistributedReqInput. The prefix cache is flushed on every weight change (KV of
    older weights never serves a request), so flush_cache false flushes too."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: str = control.DEFAULT_GROUP
    load_format: Literal["flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: Literal[False] = False


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = control.DEFAULT_GROUP


class MemoryOccupationRequest(BaseModel):
    """SGLang's Release/ResumeMemoryOccupationReqInput: tags of weights, kv_cache; none: both."""

    model_config = ConfigDict(extra="forbid")
    tags: list[Literal["weights", "kv_cache"]] | None = None


class PauseGenerationRequest(BaseModel):
    """SGLang's PauseGenerationReqInput: abort, in_place (running requests keep their KV) or retract (they drop it,
    and are prefilled again on continue)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "in_place", "retract"] = "abort"


class ContinueGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateWeightVersionRequest(BaseModel):
    """SGLang's UpdateWeightVersionReqInput."""

    model_config = ConfigDict(extra="forbid")
    new_version: str
    abort_all_requests: bool = True


class AbortRequest(BaseModel):
    """SGLang's AbortReq: rid is a request's meta_info.id (the gateway's id for it)."""

    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False


Call = Callable[[SchedulerClient], Awaitable[control.ControlReply]]


def _json(data, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def _parse(model: type[M], request: Request, gateway: Gateway) -> M:
    """The body as `model`; an empty body is its defaults (SGLang's pause and continue take none)."""
    return await parse_body_off_loop(model, await request.body() or b"{}", gateway.limits)


async def _everywhere(gateway: Gateway, call: Call) -> ControlResponse:
    return control_response(await gateway.engine.schedulers.control(call))


def _replicas(response: ControlResponse) -> dict:
    return {address: {"success": reply.success, "message": reply.message,
                      "num_paused_requests": reply.num_paused_requests, "weight_version": reply.weight_version,
                      "aborted_requests": reply.aborted_requests}
            for address, reply in sorted(response.replicas.items())}


def _status_body(response: ControlResponse, done: str) -> Response:
    """SGLang's {"message", "status": "ok"} of pause and continue; a replica that failed: 503."""
    if not response.success:
        return error_response(503, response.message)
    return _json({"message": done, "status": "ok", "replicas": _replicas(response)})


@router.post("/update_weights_from_disk", openapi_extra=request_body(UpdateWeightsFromDiskRequest))
async def update_weights_from_disk(request: Request) -> Response:
    """{success, message, num_paused_requests} (SGLang's; 400 unless every replica updated), weight_version,
    replicas."""
    gateway = gateway_of(request)
    req = await _parse(UpdateWeightsFromDiskRequest, request, gateway)
    message = control.UpdateWeightsFromDiskRequest(
        model_path=req.model_path, load_format=req.load_format or "", abort_all_requests=req.abort_all_requests,
        weight_version=req.weight_version)
    response = await _everywhere(gateway, lambda client: client.update_weights_from_disk(message))
    return _json({"success": response.success, "message": response.message,
                  "num_paused_requests": sum(reply.num_paused_requests for reply in response.replicas.values()),
                  "weight_version": gateway.engine.schedulers.weight_version(), "replicas": _replicas(response)},
                 200 if response.success else 400)


def _success_body(response: ControlResponse, **fields) -> Response:
    """SGLang's {success, message} (400 unless every replica succeeded), replicas."""
    return _json({"success": response.success, "message": response.message, **fields,
                  "replicas": _replicas(response)}, 200 if response.success else 400)


@router.post("/init_weights_update_group", openapi_extra=request_body(InitWeightsUpdateGroupInput))
async def init_weights_update_group_route(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await _parse(InitWeightsUpdateGroupInput, request, gateway)
    return _success_body(await init_weights_update_group(gateway.engine.schedulers, req.message()))


@router.post("/update_weights_from_distributed", openapi_extra=request_body(UpdateWeightsFromDistributedRequest))
async def update_weights_from_distributed(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await _parse(UpdateWeightsFromDistributedRequest, request, gateway)
    message = control.UpdateWeightsFromDistributedRequest(
        names=req.names, dtypes=req.dtypes, shapes=[control.TensorShape(dims=shape) for shape in req.shapes],
        group_name=req.group_name, load_format=req.load_format or "", abort_all_requests=req.abort_all_requests,
        weight_version=req.weight_version)
    response = await _everywhere(gateway, lambda client: client.update_weights_from_distributed(message))
    return _success_body(response, weight_version=gateway.engine.schedulers.weight_version())


@router.post("/destroy_weights_update_group", openapi_extra=request_body(DestroyWeightsUpdateGroupRequest))
async def destroy_weights_update_group(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await _parse(DestroyWeightsUpdateGroupRequest, request, gateway)
    message = control.DestroyWeightsUpdateGroupRequest(group_name=req.group_name)
    return _success_body(await _everywhere(gateway, lambda client: client.destroy_weights_update_group(message)))


async def _memory_route(request: Request, call: Callable[[SchedulerClient, list[str]], Awaitable[control.ControlReply]]
                        ) -> Response:
    gateway = gateway_of(request)
    tags: list[str] = list((await _parse(MemoryOccupationRequest, request, gateway)).tags or [])
    return _success_body(await _everywhere(gateway, lambda client: call(client, tags)))


@router.get("/release_memory_occupation")  # a route per method (one operationId each), as /flush_cache
@router.post("/release_memory_occupation", openapi_extra=request_body(MemoryOccupationRequest))
async def release_memory_occupation(request: Request) -> Response:
    return await _memory_route(request, lambda client, tags: client.release_memory_occupation(
        control.ReleaseMemoryOccupationRequest(tags=tags)))


@router.get("/resume_memory_occupation")  # a route per method (one operationId each), as /flush_cache
@router.post("/resume_memory_occupation", openapi_extra=request_body(MemoryOccupationRequest))
async def resume_memory_occupation(request: Request) -> Response:
    return await _memory_route(request, lambda client, tags: client.resume_memory_occupation(
        control.ResumeMemoryOccupationRequest(tags=tags)))


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor() -> Response:
    return error_response(501, NO_PICKLE, "serialized_named_tensors", code="not_implemented")


@router.post("/pause_generation", openapi_extra=request_body(PauseGenerationRequest))
async def pause_generation(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await _parse(PauseGenerationRequest, request, gateway)
    message = control.PauseGenerationRequest(mode=PAUSE_MODES[req.mode])
    return _status_body(await _everywhere(gateway, lambda client: client.pause_generation(message)),
                        "Generation paused successfully.")


@router.post("/continue_generation", openapi_extra=request_body(ContinueGenerationRequest))
async def continue_generation(request: Request) -> Response:
    gateway = gateway_of(request)
    await _parse(ContinueGenerationRequest, request, gateway)
    return _status_body(await _everywhere(gateway, lambda client: client.continue_generation(
        control.ContinueGenerationRequest())), "Generation continued successfully.")


@router.post("/update_weight_version", openapi_extra=request_body(UpdateWeightVersionRequest))
async def update_weight_version(request: Request) -> Response:
    """{success, message, new_version} (SGLang's; 400 unless every replica took it), replicas."""
    gateway = gateway_of(request)
    req = await _parse(UpdateWeightVersionRequest, request, gateway)
    message = control.UpdateWeightVersionRequest(new_version=req.new_version, abort_all_requests=req.abort_all_requests)
    response = await _everywhere(gateway, lambda client: client.update_weight_version(message))
    return _json({"success": response.success, "message": response.message, "new_version": req.new_version,
                  "replicas": _replicas(response)}, 200 if response.success else 400)


@router.post("/abort_request", openapi_extra=request_body(AbortRequest))
async def abort_request(request: Request) -> Response:
    """Stop one request of this gateway (rid), or every running and waiting request of every replica (abort_all,
    an admin use). Each ends with finish_reason "abort" and the tokens it generated so far (with their
    logprobs). 200, as SGLang, also for a request that already ended; 503 when a replica did not answer."""
    gateway = gateway_of(request)
    req = await parse_body_off_loop(AbortRequest, await request.body(), gateway.limits)
    if req.abort_all:
        if (refusal := require_admin(request, gateway.access)) is not None:
            return refusal
        response = await _everywhere(gateway, lambda client: client.abort_all(control.AbortAllRequest()))
        if not response.success:
            return error_response(503, response.message)
    elif req.rid:
        gateway.engine.abort(req.rid)
    return Response(status_code=200)
