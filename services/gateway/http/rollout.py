"""SGLang's rollout-control routes, for RL trainers: weight updates (from disk, broadcast over a trainer's
torch.distributed group, or shared by a colocated trainer), miles' weight-update session, pause and continue,
abort, weight_version, releasing and resuming memory, slime's weights_checker and post_process_weights.

Each call goes to every scheduler replica (SchedulerPool.control) and is answered in SGLang's shape
(sglang/srt/entrypoints/http_server.py) plus `replicas`: each replica's own reply, by address.
They are admin routes (http/auth.py: --admin-api-key when set); /abort_request by rid is not.
What each does in a scheduler is in services/scheduler/engine/rollout.py and rollout_calls.py.

/update_weights_from_tensor's `serialized_named_tensors` are torch pickles (SGLang's MultiprocessingSerializer,
base64): the gateway decodes the base64 and forwards the bytes unread; each scheduler reads its rank's entry with
a restricted unpickler (services/scheduler/model/tensor_payload.py). A remote trainer pushes safetensors bytes
over the public gRPC API instead (Generation/PushWeights).
"""

import base64
import binascii
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, TypeVar

import orjson
from fastapi import APIRouter, Request, Response
from flatwire_wire import control
from flatwire_wire import scheduler as internal
from flatwire_wire.control import PauseMode
from flatwire_wire.public import ControlResponse
from flatwire_wire.scheduler import SchedulerClient
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from services.gateway.http.auth import require_admin
from services.gateway.http.context import Gateway, gateway_of
from services.gateway.http.errors import error_response
from services.gateway.http.guards import parse_body_off_loop
from services.gateway.http.openapi import request_body
from services.gateway.protocol.parse import InvalidRequest
from services.gateway.rollout import InitWeightsUpdateGroupInput, control_response, init_weights_update_group

router = APIRouter()
M = TypeVar("M", bound=BaseModel)
PAUSE_MODES = {"abort": PauseMode.ABORT, "in_place": PauseMode.IN_PLACE, "retract": PauseMode.RETRACT}
NO_POST_PROCESSING = ("Nothing to post-process: every served tensor keeps the checkpoint's layout (no quantized or "
                      "repacked weights here), so the weights are always loadable and ready once updated.")


def _selector(value: str) -> str:
    """miles' selector: which of the served model ("target") and its draft model an update is for."""
    if value == "draft":
        raise ValueError("'draft': this server serves no draft model ('all' and 'target' are the served model)")
    if value not in ("all", "target"):
        raise ValueError(f"{value!r} is not one of 'all', 'target', 'draft'")
    return value


Selector = Annotated[str, AfterValidator(_selector)]


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
    """SGLang's UpdateWeightsFromDistributedReqInput (with miles' selector). The prefix cache is flushed on every
    weight change (KV of older weights never serves a request), so flush_cache false flushes too."""

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
    selector: Selector = "all"


class UpdateWeightsFromTensorRequest(BaseModel):
    """SGLang's UpdateWeightsFromTensorReqInput (with miles' selector). serialized_named_tensors: one base64 torch
    pickle per tensor-parallel rank. load_format None and "direct" are the same here (the names are the
    checkpoint's, which the served model's parameters carry unfused); "flattened_bucket" is slime's, miles' and
    NeMo-RL's. flush_cache false flushes too (as every weight change); disable_draft_model has no draft model to
    leave out."""

    model_config = ConfigDict(extra="forbid")
    serialized_named_tensors: list[str]
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: Literal[False] = False
    selector: Selector = "all"

    def payloads(self) -> list[bytes]:
        decoded = []
        for i, text in enumerate(self.serialized_named_tensors):
            try:
                decoded.append(base64.b64decode(text, validate=True))
            except binascii.Error as exc:
                raise InvalidRequest(f"serialized_named_tensors[{i}]",
                                     f"serialized_named_tensors[{i}]: not base64 ({exc})") from None
        return decoded


class BeginWeightUpdateRequest(BaseModel):
    """miles' SGLang BeginWeightUpdateReqInput."""

    model_config = ConfigDict(extra="forbid")
    selector: Selector = "all"


class EndWeightUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_action(action: str) -> str:
    if action not in internal.CHECK_WEIGHTS_ACTIONS:
        raise ValueError(f"{action!r} is not one of {', '.join(internal.CHECK_WEIGHTS_ACTIONS)}"
                         + (" (miles' checksum layout is its SGLang fork's own)" if action == "checksum" else ""))
    return action


class WeightsCheckerRequest(BaseModel):
    """SGLang's CheckWeightsReqInput, with miles' fields. allow_quant_error: no weight is quantized here, so every
    comparison is exact either way."""

    model_config = ConfigDict(extra="forbid")
    action: Annotated[str, AfterValidator(_check_action)] = "checksum"  # SGLang's default, refused by name
    allow_quant_error: bool = False
    selector: Selector = "all"
    skip_tensor_list: list[str] | None = None


class PostProcessWeightsRequest(BaseModel):
    """SGLang's PostProcessWeightsReqInput (slime's quantized weights: Marlin repacking and back)."""

    model_config = ConfigDict(extra="forbid")
    restore_weights_before_load: bool = False
    post_process_quantization: bool = False


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = control.DEFAULT_GROUP


class MemoryOccupationRequest(BaseModel):
    """SGLang's Release/ResumeMemoryOccupationReqInput: tags of weights, kv_cache, cuda_graph, weights_drafter;
    none: all."""

    model_config = ConfigDict(extra="forbid")
    tags: list[Literal["weights", "kv_cache", "cuda_graph", "weights_drafter"]] | None = None


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


@router.post("/update_weights_from_tensor", openapi_extra=request_body(UpdateWeightsFromTensorRequest))
async def update_weights_from_tensor(request: Request) -> Response:
    """{success, message} (SGLang's; 400 unless every replica updated), weight_version, replicas."""
    gateway = gateway_of(request)
    req = await _parse(UpdateWeightsFromTensorRequest, request, gateway)
    message = internal.UpdateWeightsFromTensorRequest(
        serialized_named_tensors=req.payloads(), load_format=req.load_format or "",
        abort_all_requests=req.abort_all_requests, weight_version=req.weight_version)
    response = await _everywhere(gateway, lambda client: client.update_weights_from_tensor(message))
    return _success_body(response, weight_version=gateway.engine.schedulers.weight_version())


@router.post("/begin_weight_update", openapi_extra=request_body(BeginWeightUpdateRequest))
async def begin_weight_update(request: Request) -> Response:
    """miles' session: the updates until /end_weight_update are staged, then swapped in together."""
    gateway = gateway_of(request)
    await _parse(BeginWeightUpdateRequest, request, gateway)
    return _success_body(await _everywhere(gateway, lambda client: client.begin_weight_update()))


@router.post("/end_weight_update", openapi_extra=request_body(EndWeightUpdateRequest))
async def end_weight_update(request: Request) -> Response:
    gateway = gateway_of(request)
    await _parse(EndWeightUpdateRequest, request, gateway)
    response = await _everywhere(gateway, lambda client: client.end_weight_update())
    return _success_body(response, weight_version=gateway.engine.schedulers.weight_version())


@router.post("/weights_checker", openapi_extra=request_body(WeightsCheckerRequest))
async def weights_checker(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await _parse(WeightsCheckerRequest, request, gateway)
    message = internal.CheckWeightsRequest(action=req.action, skip_tensor_list=req.skip_tensor_list or [])
    return _success_body(await _everywhere(gateway, lambda client: client.check_weights(message)))


@router.post("/post_process_weights", openapi_extra=request_body(PostProcessWeightsRequest))
async def post_process_weights(request: Request) -> Response:
    """Answered here: no scheduler holds weights in a layout of their own (SGLang's, for an unquantized model, is
    the same no-op)."""
    gateway = gateway_of(request)
    await _parse(PostProcessWeightsRequest, request, gateway)
    return _json({"success": True, "message": NO_POST_PROCESSING})


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
