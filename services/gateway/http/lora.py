"""LoRA adapters loaded and unloaded at run time: SGLang's routes (/load_lora_adapter, /unload_lora_adapter,
/load_lora_adapter_from_tensors; sglang/srt/entrypoints/http_server.py, their request classes in
sglang/srt/managers/io_struct.py) and vLLM's (/v1/load_lora_adapter, /v1/unload_lora_adapter;
vllm/entrypoints/openai/serving_models.py), in their shapes. Admin routes (http/auth.py). Each call goes to every
scheduler replica (services/gateway/lora.py); what it does there is services/scheduler/engine/lora_registry.py's.

An adapter is a PEFT directory on the schedulers' machine (lora_path), or its config and tensors in the request:
/load_lora_adapter_from_tensors takes them as the bytes of a safetensors file, base64 (`load_format:
"safetensors"`). SGLang's own payload there, what miles and AReaL send, is torch's MultiprocessingSerializer pickle
(`load_format` null or "flattened_bucket"): unpickling a request body runs whatever code it names, and its CUDA IPC
handles name another process's memory, so it is refused, naming serialized_tensors, as /update_weights_from_tensor
is.
"""

import orjson
import pybase64
from fastapi import APIRouter, Request, Response
from flatwire_wire.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.http.context import Gateway, gateway_of
from services.gateway.http.errors import error_response
from services.gateway.http.guards import parse_body_off_loop
from services.gateway.http.openapi import request_body
from services.gateway.lora import LoraOutcome, on_every_replica
from services.gateway.protocol.parse import InvalidRequest

router = APIRouter()
NO_PICKLE = ("serialized_tensors: SGLang's pickled tensors (torch's MultiprocessingSerializer, load_format null or "
             "flattened_bucket) are not accepted: unpickling a request body runs whatever code it names. Send the "
             "adapter's safetensors file, base64, with load_format \"safetensors\", or save it as a PEFT directory "
             "and POST /load_lora_adapter")


class LoadLoraAdapterInput(BaseModel):
    """SGLang's LoadLoRAAdapterReqInput (lora_id is SGLang's own, set by its tokenizer manager)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False
    lora_id: None = None


class UnloadLoraAdapterInput(BaseModel):
    """SGLang's UnloadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_id: None = None


class LoadLoraAdapterFromTensorsInput(BaseModel):
    """SGLang's LoadLoRAAdapterFromTensorsReqInput: serialized_tensors (0.5.8's name) or serialized_named_tensors
    (newer: one copy per tensor-parallel rank, all the same here), the base64 of a safetensors file."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    config_dict: dict
    serialized_tensors: str | None = None
    serialized_named_tensors: list[str] | None = Field(None, min_length=1)
    pinned: bool = False
    added_tokens_config: None = None  # new tokens: the vocabulary is the served model's
    lora_id: None = None
    load_format: str | None = None

    def safetensors(self) -> bytes:
        given = [name for name in ("serialized_tensors", "serialized_named_tensors") if getattr(self, name)]
        if len(given) != 1:
            raise InvalidRequest("serialized_tensors", "serialized_tensors: give it, or serialized_named_tensors")
        if self.load_format != "safetensors":
            raise InvalidRequest(given[0], NO_PICKLE.replace("serialized_tensors", given[0], 1))
        copies = [self.serialized_tensors] if self.serialized_tensors else self.serialized_named_tensors or []
        try:
            data = {pybase64.b64decode(copy, validate=True) for copy in copies}
        except ValueError:
            raise InvalidRequest(given[0], f"{given[0]}: not base64") from None
        if len(data) > 1:
            raise InvalidRequest(given[0], f"{given[0]}: the copies differ: every rank serves the same adapter")
        return data.pop()


class VllmLoadLoraAdapterInput(BaseModel):
    """vLLM's LoadLoRAAdapterRequest."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class VllmUnloadLoraAdapterInput(BaseModel):
    """vLLM's UnloadLoRAAdapterRequest (lora_int_id: vLLM's own id, which flatwire has no use for)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def _named(gateway: Gateway, name: str) -> None:
    if name == gateway.engine.model_name:
        raise InvalidRequest("lora_name", f"lora_name: the LoRA adapter name '{name}' is the served model's")


def _sglang(outcome: LoraOutcome) -> Response:
    """SGLang's LoRAUpdateOutput (400 unless every replica succeeded), with each replica's reply."""
    body = {"success": outcome.success, "error_message": None if outcome.success else outcome.message,
            "loaded_adapters": {info.name: {"lora_id": None, "lora_name": info.name, "lora_path": info.path or
                                            "__tensor__", "pinned": info.pinned} for info in outcome.loaded},
            "replicas": {address: {"success": reply.success, "message": reply.message}
                         for address, reply in outcome.replicas.items()}}
    return Response(orjson.dumps(body), status_code=200 if outcome.success else 400, media_type="application/json")


def _vllm(outcome: LoraOutcome, success: str) -> Response:
    """vLLM's answer: the success sentence as text, or its error (404 when there was no such adapter)."""
    if outcome.success:
        return Response(success, media_type="text/plain")
    return error_response(404 if outcome.not_found else 400, outcome.message, "lora_name")


async def _load(gateway: Gateway, message: LoadLoraAdapterRequest) -> LoraOutcome:
    _named(gateway, message.lora_name)
    return await on_every_replica(gateway.engine.schedulers, lambda client: client.load_lora_adapter(message))


async def _unload(gateway: Gateway, name: str) -> LoraOutcome:
    message = UnloadLoraAdapterRequest(lora_name=name)
    return await on_every_replica(gateway.engine.schedulers, lambda client: client.unload_lora_adapter(message))


@router.post("/load_lora_adapter", openapi_extra=request_body(LoadLoraAdapterInput))
async def load_lora_adapter(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await parse_body_off_loop(LoadLoraAdapterInput, await request.body(), gateway.limits)
    return _sglang(await _load(gateway, LoadLoraAdapterRequest(lora_name=req.lora_name, lora_path=req.lora_path,
                                                                pinned=req.pinned)))


@router.post("/load_lora_adapter_from_tensors", openapi_extra=request_body(LoadLoraAdapterFromTensorsInput))
async def load_lora_adapter_from_tensors(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await parse_body_off_loop(LoadLoraAdapterFromTensorsInput, await request.body(), gateway.limits)
    message = LoadLoraAdapterRequest(lora_name=req.lora_name, safetensors=req.safetensors(),
                                     config_json=orjson.dumps(req.config_dict).decode(), pinned=req.pinned)
    return _sglang(await _load(gateway, message))


@router.post("/unload_lora_adapter", openapi_extra=request_body(UnloadLoraAdapterInput))
async def unload_lora_adapter(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await parse_body_off_loop(UnloadLoraAdapterInput, await request.body(), gateway.limits)
    return _sglang(await _unload(gateway, req.lora_name))


@router.post("/v1/load_lora_adapter", openapi_extra=request_body(VllmLoadLoraAdapterInput))
async def vllm_load_lora_adapter(request: Request) -> Response:
    """vLLM's: a name already loaded is refused unless load_inplace, which replaces it (requests running on it end
    on its old weights; the new ones get the new)."""
    gateway = gateway_of(request)
    req = await parse_body_off_loop(VllmLoadLoraAdapterInput, await request.body(), gateway.limits)
    if not req.lora_name or not req.lora_path:
        raise InvalidRequest(None, "Both 'lora_name' and 'lora_path' must be provided.")
    outcome = await _load(gateway, LoadLoraAdapterRequest(lora_name=req.lora_name, lora_path=req.lora_path,
                                                          replace=req.load_inplace))
    return _vllm(outcome, f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=request_body(VllmUnloadLoraAdapterInput))
async def vllm_unload_lora_adapter(request: Request) -> Response:
    gateway = gateway_of(request)
    req = await parse_body_off_loop(VllmUnloadLoraAdapterInput, await request.body(), gateway.limits)
    if not req.lora_name:
        raise InvalidRequest("lora_name", "'lora_name' needs to be provided to unload a LoRA adapter.")
    outcome = await _unload(gateway, req.lora_name)
    return _vllm(outcome, f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
