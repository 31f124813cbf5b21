"""SGLang's native endpoints besides /generate, and OpenAI's GET /v1/models (/{model}).

/get_model_info (/model_info), /get_server_info (/server_info), /flush_cache, /health_generate,
/tokenize and /detokenize (also under /v1/). Shapes as SGLang 0.5.x sends them
(sglang/srt/entrypoints/http_server.py, openai/serving_tokenize.py). /abort_request and the other
rollout-control routes are in rollout.py.
"""

import asyncio
import functools
import importlib.metadata
import logging
from contextlib import aclosing

import orjson
from fastapi import APIRouter, Request, Response
from flatwire_wire.control import SGLANG_FLUSH
from flatwire_wire.scheduler import LogprobParams, ModelInfo, SamplingParams, SchedulerStats
from flatwire_wire.steps import DetokenizeParams, FinishReason
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from services.gateway.engine_client import RequestError
from services.gateway.http.context import Gateway, gateway_of
from services.gateway.http.errors import error_response
from services.gateway.http.guards import parse_body_off_loop
from services.gateway.http.openapi import request_body
from services.gateway.lora import adapters
from services.gateway.prompts import encode_checked
from services.gateway.protocol.intake import GenerateInput
from services.gateway.protocol.parse import InvalidRequest, check_batch_size, check_token_ids, is_id_lists
from services.gateway.rollout import control_response

log = logging.getLogger("flatwire.gateway")
router = APIRouter()

# How long /health_generate waits for its one-token generation (SGLang's HEALTH_CHECK_TIMEOUT is 20 s).
HEALTH_GENERATE_TIMEOUT_S = 20.0
# SGLang's answer (sglang/srt/entrypoints/http_server.py), with each replica's.
FLUSH_CACHE_NOTE = "(When there are running or waiting requests, the operation will not be performed.)"


@functools.cache  # reading the installed metadata takes most of a ms
def flatwire_version() -> str:
    try:
        return importlib.metadata.version("flatwire")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def _json(data, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _check_model(gateway: Gateway, model: str | None) -> None:
    if model is not None and gateway.model_named(model) is None:
        raise InvalidRequest("model", f"model: this server serves {gateway.engine.model_name!r}, not {model!r}",
                             status=404, code="model_not_found")


# -- models ----------------------------------------------------------------------------------------------


def model_card(gateway: Gateway, name: str, adapter: bool = False) -> dict:
    """The served model under `name`, or its LoRA adapter `name`, as OpenAI's model object (GET /v1/models lists one
    per name and adapter, GET /v1/models/{model} returns it), with vLLM's `root` and, for an adapter, `parent` (the
    served model). An adapter's `root` is its own name: where it lies on the schedulers' machine is not disclosed.
    owned_by is the server's name, as vLLM's and SGLang's say theirs."""
    served = gateway.engine.model_name
    card = {"id": name, "object": "model", "created": gateway.created, "owned_by": "flatwire",
            "root": name if adapter else served, "max_model_len": gateway.limits.max_context}
    return card | {"parent": served} if adapter else card


async def adapter_cards(gateway: Gateway) -> list[dict]:
    """The LoRA adapters the schedulers serve, as model objects (none without --enable-lora)."""
    info = gateway.engine.model_info
    if info is None or not info.max_loras_per_batch:
        return []
    return [model_card(gateway, adapter.name, adapter=True) for adapter in await adapters(gateway.engine.schedulers)]


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    gateway = gateway_of(request)
    return _json({"object": "list", "data": [*(model_card(gateway, name) for name in gateway.model_names),
                                             *await adapter_cards(gateway)]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    gateway = gateway_of(request)
    if gateway.model_named(model) is not None:
        return _json(model_card(gateway, model))
    if card := next((card for card in await adapter_cards(gateway) if card["id"] == model), None):
        return _json(card)
    return error_response(404, f"The model `{model}` does not exist.", "model", "model_not_found")


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> Response:
    """SGLang's model info; model_path is the served model name (the checkpoint's location is not disclosed)."""
    engine = gateway_of(request).engine
    name = engine.model_name
    return _json({"model_path": name, "tokenizer_path": name, "is_generation": True,
                  "preferred_sampling_params": None, "weight_version": engine.schedulers.weight_version()})


@router.get("/get_weight_version")
async def weight_version(request: Request) -> Response:
    """SGLang's: the version of the served weights (slime reads it after an update)."""
    return _json({"weight_version": gateway_of(request).engine.schedulers.weight_version()})


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> Response:
    """The settings SGLang clients read: its ServerArgs' names where flatwire has the same setting, and
    scheduler_info's token capacity. bench_serving reads internal_states[0].get("avg_spec_accept_length")."""
    gateway = gateway_of(request)
    info, config, engine = gateway.engine.model_info, gateway.config, gateway.engine
    assert info is not None  # fetched when the pipeline starts, before the server listens
    name = engine.model_name
    return _json({
        "version": flatwire_version(),
        "model_path": name,
        "tokenizer_path": name,
        "served_model_name": name,
        "weight_version": engine.schedulers.weight_version(),
        "replica_weight_versions": {address: replica.weight_version
                                    for address, replica in engine.schedulers.replicas.items()},
        "is_generation": True,
        "host": config.host,
        "port": config.port,
        "grpc_port": config.grpc_port,
        "api_key_required": bool(config.api_key),
        "stream_interval": config.stream_interval,
        "device": info.device,
        "dtype": info.dtype,
        "context_length": info.max_context,
        "max_req_input_len": info.max_context - 1,  # a prompt leaves room for at least one new token
        "vocab_size": info.vocab_size,
        "eos_token_ids": list(info.eos_token_ids),
        "max_top_logprobs": info.max_top_logprobs,
        "max_running_requests": info.max_running_requests,  # per scheduler replica
        "max_total_num_tokens": info.max_total_tokens,  # of each replica's KV memory
        "page_size": info.page_size,
        "kv_layers": info.kv_layers,  # what the model's layers keep
        # A linear-attention model's state: what one request holds whatever its length, and the checkpoints of it
        # the prefix cache keeps (at page boundaries).
        "state_bytes_per_request": info.state_bytes_per_request,
        "state_checkpoints": info.state_checkpoints,
        # Each replica's KV memory now (from its last health round): pages held, cached, free; the prefix cache.
        "kv_memory": {address: _kv_memory(replica.stats) for address, replica in engine.schedulers.replicas.items()},
        "scheduler_replicas": len(engine.schedulers.replicas),
        "detokenizers": len(engine.detokenizers.addresses),
        "max_batch_size": config.max_batch_size,
        "max_outstanding_requests": engine.admission_limit,
        "disable_radix_cache": not info.prefix_cache,
        "logprobs_mode": info.logprobs_mode.api_name,  # the OpenAI routes' default (the scheduler's --logprobs-mode)
        # /generate's and the public gRPC API's default: raw_logprobs (true) or SGLang's sglang_logprobs
        "return_original_logprob": config.return_original_logprob,
        "routing_policy": config.routing_policy.value,
        "gateway_id": engine.owner,  # this gateway process's (one of several behind one port: --reuse-port)
        # Its token table and per-format pieces are built (a thread at startup that shares the CPU until then).
        "renderers_ready": gateway.renderers_ready,
        "speculative_algorithm": None,
        "internal_states": [{"avg_spec_accept_length": None}],
        **sglang_server_args(info, len(engine.schedulers.replicas)),
    })


def sglang_server_args(info: ModelInfo, replicas: int) -> dict:
    """SGLang's ServerArgs that slime and miles compare with what they would have launched when they attach to a
    running engine (--rollout-external: slime/backends/sglang_utils/sglang_engine.py, and miles' of that name), each
    with flatwire's true value. Each scheduler replica is one engine on one node, its model cut over --tp-size
    devices (no pipeline or expert parallelism), as SGLang's data-parallel ranks are; a setting flatwire has no such
    thing for is SGLang's default only where that default is true here (no prefill/decode disaggregation, no indexer
    top-k)."""
    return {
        "nnodes": 1, "node_rank": 0,
        "tp_size": info.tp_size, "pp_size": 1, "ep_size": 1, "dp_size": replicas,
        # The device the (first) replica computes on; SGLang's 0 on a CPU, as SGLang itself reports it there.
        "base_gpu_id": int(info.device.partition(":")[2] or 0), "gpu_id_step": 1,
        # release_memory_occupation frees the model's memory (SGLang needs --enable-memory-saver for that).
        "enable_memory_saver": info.releases_memory,
        "enable_return_routed_experts": info.return_routed_experts,
        "enable_return_indexer_topk": False,
        "enable_lora": info.max_loras_per_batch > 0,
        "load_format": info.load_format,
        "disaggregation_mode": "null",
        "encoder_only": False,
        "enable_metrics": True,  # /metrics is always served
    }


def _kv_memory(stats: SchedulerStats | None) -> dict | None:
    if stats is None:
        return None
    return {"pages": stats.kv_pages_total, "page_size": stats.page_size, "pages_used": stats.kv_pages_used,
            "pages_cached": stats.kv_pages_cached, "tokens_used": stats.kv_tokens_used,
            "running": stats.running, "waiting": stats.waiting, "prefill_tokens": stats.prefill_tokens,
            "cached_prompt_tokens": stats.cached_prompt_tokens, "retractions": stats.retractions}


# -- cache and health ------------------------------------------------------------------------------------


@router.get("/flush_cache")  # a route per method: one route with both gives /openapi.json one operationId twice
@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """SGLang's: empty every replica's prefix cache; 400 when one refuses (requests run or wait) or does not
    answer. An admin route (http/auth.py)."""
    gateway = gateway_of(request)
    response = control_response(await gateway.engine.schedulers.control(
        lambda client: client.flush_cache(SGLANG_FLUSH)))
    lines = [f"{address}: {reply.message}" for address, reply in sorted(response.replicas.items())]
    text = "\n".join(["Cache flushed." if response.success else "Cache not flushed.", *lines, FLUSH_CACHE_NOTE, ""])
    return Response(text, status_code=200 if response.success else 400, media_type="text/plain")


def _health_input() -> GenerateInput:
    return GenerateInput(input_ids=[0], sampling=SamplingParams(max_new_tokens=1, temperature=0),
                         logprob=LogprobParams(logprob_start_len=-1),
                         detokenize=DetokenizeParams())


async def _one_token(gateway: Gateway) -> None:
    async with aclosing(gateway.engine.generate(_health_input())) as replies:
        async for reply in replies:
            if (ending := reply.ending) is not None:
                if ending.reason == FinishReason.ABORT:
                    raise RequestError("unavailable", None, ending.error or "aborted")
                return
    raise RequestError("unavailable", None, "the generation ended without a result")


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token generation went through the whole engine, 503 when it failed or took longer
    than HEALTH_GENERATE_TIMEOUT_S (SGLang's body: none)."""
    gateway = gateway_of(request)
    try:
        await asyncio.wait_for(_one_token(gateway), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return error_response(503, f"health_generate: no token within {HEALTH_GENERATE_TIMEOUT_S:g} s")
    except RequestError as exc:
        return error_response(503, f"health_generate: {exc.message}")
    return Response(status_code=200)


# -- tokenizer -------------------------------------------------------------------------------------------


class TokenizeRequest(BaseModel):
    """SGLang's TokenizeRequest."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _count(cls, value: str | list[str], info: ValidationInfo) -> str | list[str]:
        if isinstance(value, list):
            check_batch_size("prompt", len(value), "its prompts", info)
        return value


class DetokenizeRequest(BaseModel):
    """SGLang's DetokenizeRequest: one list of ids, or a list of them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value: list[int] | list[list[int]], info: ValidationInfo) -> list[int] | list[list[int]]:
        if is_id_lists(value):
            check_batch_size("tokens", len(value), "its token lists", info)
            for ids in value:
                check_token_ids(ids, info)
        else:
            check_token_ids(value, info)
        return value


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
@router.post("/v1/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    """{"tokens", "count", "max_model_len"}: tokens a list of ids (a list of lists for a list of prompts).
    The body's size is bounded (--max-request-mb); tokenization runs in a worker thread."""
    gateway = gateway_of(request)
    req = await parse_body_off_loop(TokenizeRequest, await request.body(), gateway.limits)
    _check_model(gateway, req.model)
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    ids = await asyncio.to_thread(encode_checked, gateway.engine.tokenizer, texts, None, "prompt",
                                  req.add_special_tokens) if texts else []
    if isinstance(req.prompt, str):
        body = {"tokens": ids[0], "count": len(ids[0])}
    else:
        body = {"tokens": ids, "count": [len(one) for one in ids]}
    return _json(body | {"max_model_len": gateway.limits.max_context})


def _decode(tokenizer, lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
    return tokenizer.batch_decode(lists, skip_special_tokens=skip_special_tokens)


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
@router.post("/v1/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    """{"text": str} for a list of ids, {"text": [str, ...]} for a list of lists."""
    gateway = gateway_of(request)
    req = await parse_body_off_loop(DetokenizeRequest, await request.body(), gateway.limits)
    _check_model(gateway, req.model)
    tokenizer, skip = gateway.engine.tokenizer, req.skip_special_tokens
    if is_id_lists(req.tokens):
        return _json({"text": await asyncio.to_thread(_decode, tokenizer, req.tokens, skip)})
    texts = await asyncio.to_thread(_decode, tokenizer, [req.tokens], skip)
    return _json({"text": texts[0]})

