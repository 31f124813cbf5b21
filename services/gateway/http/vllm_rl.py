"""vLLM's development-mode routes, which RL frameworks drive vLLM with (SkyRL's
skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py, prime-rl's prime_rl/utils/client.py, TRL's
trl/experimental/async_grpo/vllm_client.py), with vLLM's query parameters and answers (vllm/entrypoints/serve/dev/:
sleep, rlhf, cache). Each is made of the rollout-control calls that SGLang's routes
make (rollout.py; services/scheduler/engine/rollout.py says what each does in a scheduler), sent to every scheduler
replica; there is no state of their own.

- POST /pause?mode=abort|wait|keep (vLLM's default: abort; wait_for_inflight_requests=true, deprecated, is wait)
  &clear_cache=true|false (default true): abort ends every running and waiting request; wait admits nothing new
  while the running requests finish, and answers once they have; keep freezes them with their KV cache (pause
  in_place). clear_cache then empties the prefix cache (vLLM's route ignores it with keep, and so does this one).
  {"status": "paused"}.  POST /resume: {"status": "resumed"}.  GET /is_paused: {"is_paused"}.
- POST /sleep?level=0|1|2 (default 1)&mode=...: pauses as /pause does (keep, with the KV memory going: retract,
  the frozen requests are prefilled again after wake_up), then level 1 releases the KV cache and the weights,
  promising the same weights back (vLLM offloads them to the CPU), level 2 both with nothing kept (for weights a
  trainer replaces after wake_up: until an update brings them, requests are refused); level 0 only pauses.
- POST /wake_up?tags=weights&tags=kv_cache&tags=scheduling (none: all): takes back the memory of the tags given,
  then continues generation once no replica has memory released (vLLM resumes scheduling only when every
  allocation is back).  GET /is_sleeping: {"is_sleeping"}: paused or memory released (vLLM's).
- POST /reset_prefix_cache?reset_running_requests=false&reset_external=false (reset_running_requests also in a JSON
  body, as SkyRL's server takes it): {"success"}: false while requests run, unless reset_running_requests retracts
  them first (they are prefilled again). flatwire has no external (KV connector) cache: reset_external adds nothing.

- POST /update_weights {"weight_dir"}: prime-rl's (its vLLM server's own route of that path): every replica loads
  the checkpoint directory (SGLang's /update_weights_from_disk); {"status": "ok"}. vLLM's {"update_info"}, for its
  weight-transfer engine, is refused by name (UpdateWeightsBody says why).  GET /weight_info: {"weight_version"}.

The is_ routes answer for every replica (each one's state under `replicas`). A query parameter that vLLM's route
does not take, or a body (but reset_prefix_cache's), is refused by name; a replica that refuses answers 400 with
why, one that does not answer 503.
"""

import typing
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, TypeVar

import orjson
from fastapi import APIRouter, Request, Response
from flatwire_wire import control
from flatwire_wire.control import MEMORY_TAGS, FlushCacheRequest, PauseMode, WeightsRelease
from flatwire_wire.public import ControlResponse
from flatwire_wire.scheduler import SchedulerClient, SchedulerStats
from pydantic import Field, model_validator

from services.gateway.http.context import Gateway, gateway_of
from services.gateway.http.errors import error_response
from services.gateway.http.openapi import query_parameters, request_body
from services.gateway.protocol.parse import InvalidRequest, RequestModel, parse_body, parse_data
from services.gateway.rollout import control_response
from services.gateway.schedulers import unanswered_prefix

router = APIRouter()
VllmPauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = {"abort": PauseMode.ABORT, "wait": PauseMode.WAIT, "keep": PauseMode.IN_PLACE}
SLEEP_WEIGHTS = {1: WeightsRelease.OFFLOAD, 2: WeightsRelease.DISCARD}
SCHEDULING = "scheduling"  # vLLM's wake_up tag of the scheduler itself (level 0)
Call = Callable[[SchedulerClient], Awaitable[control.ControlReply]]
M = TypeVar("M", bound=RequestModel)


class PauseQuery(RequestModel):
    mode: VllmPauseMode = "abort"
    wait_for_inflight_requests: bool = False  # vLLM's deprecated spelling of mode wait
    clear_cache: bool = True


class SleepQuery(RequestModel):
    level: Annotated[int, Field(ge=0, le=2)] = 1
    mode: VllmPauseMode = "abort"


class WakeUpQuery(RequestModel):
    tags: list[Literal["weights", "kv_cache", "scheduling"]] = []


class ResetPrefixCacheQuery(RequestModel):
    reset_running_requests: bool | None = None  # None: false, or the body's
    reset_external: bool = False


class ResetPrefixCacheBody(RequestModel):
    """What SkyRL's vLLM server takes (and its client sends) instead of the query parameter."""

    reset_running_requests: bool = False


class NoQuery(RequestModel):
    pass


class _Failed(Exception):
    """A control call that did not succeed everywhere: the answer to give."""

    def __init__(self, response: Response):
        self.response = response


def _json(data) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


def _answering(route: Callable[[Request, Gateway], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The route with its gateway, answering a _Failed with its response."""
    async def answer(request: Request) -> Response:
        try:
            return await route(request, gateway_of(request))
        except _Failed as failed:
            return failed.response
    answer.__name__, answer.__doc__ = route.__name__, route.__doc__
    return answer


async def _query(model: type[M], request: Request, gateway: Gateway, body: bool = False) -> M:
    """The query parameters as `model` (a repeated one is a list only where the model takes one); a body is refused
    unless the route takes one (`body`)."""
    params = request.query_params
    data: dict = {}
    for name in params:
        values = params.getlist(name)
        field = model.model_fields.get(name)
        if field is not None and typing.get_origin(field.annotation) is list:
            data[name] = values
        elif len(values) > 1:
            raise InvalidRequest(name, f"{name}: given {len(values)} times; give it once")
        else:
            data[name] = values[0]
    if not body and (await request.body()).strip() not in (b"", b"{}", b"null"):
        raise InvalidRequest("body", f"{request.url.path} takes no body: its options are query parameters, as vLLM's")
    return parse_data(model, data, gateway.limits)


def _unanswered(response: ControlResponse) -> bool:
    """A replica did not answer (a fault), as opposed to refusing; or none is known."""
    return not response.replicas or any(reply.message.startswith(unanswered_prefix(address))
                                        for address, reply in response.replicas.items())


async def _everywhere(gateway: Gateway, call: Call) -> None:
    """`call` on every replica; _Failed (400: a replica refused, 503: one did not answer) unless all succeeded."""
    response = control_response(await gateway.engine.schedulers.control(call))
    if not response.success:
        raise _Failed(error_response(503 if _unanswered(response) else 400, response.message))


async def _states(gateway: Gateway) -> dict[str, SchedulerStats]:
    stats = await gateway.engine.schedulers.stats_now()
    if not stats:
        raise _Failed(error_response(503, "no scheduler replica is known"))
    if silent := [address for address, state in stats.items() if state is None]:
        raise _Failed(error_response(503, f"scheduler {silent[0]} did not answer"))
    return {address: state for address, state in stats.items() if state is not None}


def _state_body(key: str, states: dict[str, SchedulerStats], of: Callable[[SchedulerStats], bool]) -> Response:
    """vLLM's {key: bool}, true when it holds for every replica, and each replica's state."""
    return _json({key: all(map(of, states.values())),
                  "replicas": {address: {"paused": state.paused, "memory_released": state.memory_released}
                               for address, state in sorted(states.items())}})


async def _pause_all(gateway: Gateway, mode: PauseMode) -> None:
    await _everywhere(gateway, lambda client: client.pause_generation(control.PauseGenerationRequest(mode=mode)))


async def _continue_all(gateway: Gateway) -> None:
    await _everywhere(gateway, lambda client: client.continue_generation(control.ContinueGenerationRequest()))


@router.post("/pause", openapi_extra=query_parameters(PauseQuery))
@_answering
async def pause(request: Request, gateway: Gateway) -> Response:
    query = await _query(PauseQuery, request, gateway)
    mode = "wait" if query.wait_for_inflight_requests else query.mode
    await _pause_all(gateway, PAUSE_MODES[mode])
    if query.clear_cache and mode != "keep":  # no request runs now: nothing to retract
        flush = FlushCacheRequest(reset_running_requests=False)
        await _everywhere(gateway, lambda client: client.flush_cache(flush))
    return _json({"status": "paused"})


@router.post("/resume")
@_answering
async def resume(request: Request, gateway: Gateway) -> Response:
    await _query(NoQuery, request, gateway)
    await _continue_all(gateway)
    return _json({"status": "resumed"})


@router.get("/is_paused")
@_answering
async def is_paused(request: Request, gateway: Gateway) -> Response:
    await _query(NoQuery, request, gateway)
    return _state_body("is_paused", await _states(gateway), lambda state: state.paused)


@router.post("/sleep", openapi_extra=query_parameters(SleepQuery))
@_answering
async def sleep(request: Request, gateway: Gateway) -> Response:
    query = await _query(SleepQuery, request, gateway)
    mode = PAUSE_MODES[query.mode]
    if query.level >= 1 and mode is PauseMode.IN_PLACE:  # the KV memory goes: the frozen requests drop theirs
        mode = PauseMode.RETRACT
    await _pause_all(gateway, mode)
    if query.level >= 1:
        release = control.ReleaseMemoryOccupationRequest(tags=list(MEMORY_TAGS), weights=SLEEP_WEIGHTS[query.level])
        await _everywhere(gateway, lambda client: client.release_memory_occupation(release))
    return Response(status_code=200)


@router.post("/wake_up", openapi_extra=query_parameters(WakeUpQuery))
@_answering
async def wake_up(request: Request, gateway: Gateway) -> Response:
    query = await _query(WakeUpQuery, request, gateway)
    tags = [tag for tag in query.tags if tag != SCHEDULING] if query.tags else list(MEMORY_TAGS)
    if "kv_cache" in tags:  # vLLM's kv_cache is every allocation but the weights': the decode graphs' too
        tags.append("cuda_graph")
    if tags:
        resume_tags = control.ResumeMemoryOccupationRequest(tags=tags)
        await _everywhere(gateway, lambda client: client.resume_memory_occupation(resume_tags))
    if not any(state.memory_released for state in (await _states(gateway)).values()):
        await _continue_all(gateway)
    return Response(status_code=200)


@router.get("/is_sleeping")
@_answering
async def is_sleeping(request: Request, gateway: Gateway) -> Response:
    await _query(NoQuery, request, gateway)
    return _state_body("is_sleeping", await _states(gateway), lambda state: state.paused or bool(state.memory_released))


@router.post("/reset_prefix_cache",
             openapi_extra=query_parameters(ResetPrefixCacheQuery) | request_body(ResetPrefixCacheBody, False))
@_answering
async def reset_prefix_cache(request: Request, gateway: Gateway) -> Response:
    query = await _query(ResetPrefixCacheQuery, request, gateway, body=True)
    reset_running = query.reset_running_requests
    if (raw := await request.body()).strip():
        body = parse_body(ResetPrefixCacheBody, raw, gateway.limits)
        if reset_running is not None and body.reset_running_requests != reset_running:
            raise InvalidRequest("reset_running_requests", "reset_running_requests: the query and the body differ")
        reset_running = body.reset_running_requests
    flush = FlushCacheRequest(reset_running_requests=bool(reset_running))
    response = control_response(await gateway.engine.schedulers.control(lambda client: client.flush_cache(flush)))
    if not response.success and _unanswered(response):
        return error_response(503, response.message)
    return _json({"success": response.success, "message": response.message,
                  "replicas": {address: {"success": reply.success, "message": reply.message}
                               for address, reply in sorted(response.replicas.items())}})


class UpdateWeightsBody(RequestModel):
    """POST /update_weights: vLLM's takes {"update_info"} for its weight-transfer engine, which flatwire has not
    (refused by name: its NCCL engine joins vLLM's own StatelessProcessGroup and PyNccl communicator, not a
    torch.distributed group; its IPC engine passes CUDA handles); prime-rl's vLLM server (its own route of this path,
    prime_rl/inference/vllm/server.py) takes {"weight_dir"}, a checkpoint directory every worker loads: here
    SGLang's update from disk."""

    weight_dir: str | None = Field(None, min_length=1)
    update_info: typing.Any = None

    @model_validator(mode="after")
    def _weight_dir(self) -> "UpdateWeightsBody":
        if self.update_info is not None:
            raise InvalidRequest("update_info", "update_info: vLLM's weight-transfer engines are not served here "
                                 "(its NCCL engine's trainer joins vLLM's own StatelessProcessGroup, not a "
                                 "torch.distributed group); broadcast over one with /init_weights_update_group and "
                                 "/update_weights_from_distributed, or give weight_dir, a checkpoint directory")
        if self.weight_dir is None:
            raise InvalidRequest("weight_dir", "weight_dir: required (a checkpoint directory to load)")
        return self


@router.post("/update_weights", openapi_extra=request_body(UpdateWeightsBody))
@_answering
async def update_weights(request: Request, gateway: Gateway) -> Response:
    """prime-rl's filesystem weight update: {"status": "ok"} once every replica serves the checkpoint (400 with
    why where one refused, as /update_weights_from_disk)."""
    await _query(NoQuery, request, gateway, body=True)
    body = parse_body(UpdateWeightsBody, await request.body() or b"{}", gateway.limits)
    assert body.weight_dir is not None  # _weight_dir
    load = control.UpdateWeightsFromDiskRequest(model_path=body.weight_dir)
    await _everywhere(gateway, lambda client: client.update_weights_from_disk(load))
    return _json({"status": "ok"})


@router.get("/weight_info")
@_answering
async def weight_info(request: Request, gateway: Gateway) -> Response:
    """vLLM's {"weight_version"}: the version the replicas serve (null before any was set)."""
    await _query(NoQuery, request, gateway)
    return _json({"weight_version": gateway.engine.schedulers.weight_version() or None})
