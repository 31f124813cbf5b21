"""vLLM's token-in/token-out route, `POST /inference/v1/generate` (protocol/vllm_generate.py has its request): the
prompt's ids in, each sample's ids out, with vLLM's output logprobs and prompt_logprobs (render/vllm_logprobs.py),
finish reasons and usage, streamed as vLLM's chunks with stream true. It goes through the intake and the engine
as every other route; the LoRA adapter is `model` (vLLM's way), the session key SkyRL's X-Session-ID header.
"""

import time
import uuid

from fastapi import APIRouter, Request, Response

from services.gateway.http.context import ROUTER_UNNAMED_MODEL, Gateway, gateway_of
from services.gateway.http.guards import parse_body_off_loop
from services.gateway.http.openai_common import usage
from services.gateway.http.openapi import request_body
from services.gateway.http.sse import DONE, event, sse_response
from services.gateway.http.streams import Generations, unless_disconnected
from services.gateway.protocol.intake import generate_inputs
from services.gateway.protocol.openai import model_adapter
from services.gateway.protocol.vllm_generate import LOGPROB_FIELDS, InferenceGenerateRequest
from services.gateway.render.pieces import dumps
from services.gateway.render.vllm_logprobs import generate_logprobs, prompt_logprobs, top_k
from services.gateway.reply import Output, Reply
from services.gateway.routing import routing_key

ENDPOINT = "/inference/v1/generate"
# What vLLM's response carries that flatwire has no part of (multimodal, disaggregation, per-request metrics).
ABSENT_FIELDS = ("prompt_token_id_logprobs", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params")
ABSENT_CHOICE_FIELDS = ("routed_experts", "sampling_mask", "weight_versions")

router = APIRouter()


def _adapter(gateway: Gateway, model: str | None) -> str:
    """The LoRA adapter `model` names ("": the served model, also when absent, as vLLM's)."""
    if model in (None, ROUTER_UNNAMED_MODEL):
        return ""
    info = gateway.engine.model_info
    return model_adapter(model, gateway.model_names, bool(info and info.max_loras_per_batch))


@router.post(ENDPOINT, openapi_extra=request_body(InferenceGenerateRequest))
async def inference_generate(request: Request) -> Response:
    gateway = gateway_of(request)
    started = time.perf_counter()
    gateway.metrics.requests.labels(ENDPOINT).inc()
    req = await parse_body_off_loop(InferenceGenerateRequest, await request.body(), gateway.limits)
    adapter = _adapter(gateway, req.model)
    inputs = generate_inputs([(req.prompt_request(adapter), req.token_ids)], gateway.limits, LOGPROB_FIELDS,
                             req.sampling_params.n)
    starting = Generations.start(gateway.engine, inputs, gateway.metrics, ENDPOINT, started,
                                 routing_key(request.headers))
    request_id = req.request_id or uuid.uuid4().hex
    count_bytes = gateway.metrics.bytes_sent.labels("vllm_tokens").inc
    if req.stream:
        gens = await unless_disconnected(request, starting)
        return sse_response(_events(req, gens, request_id), gens.close, count_bytes)
    results = await unless_disconnected(request, Generations.collect(starting))
    prompt = results[0].whole.prompt
    body = dumps({
        "request_id": request_id, "model": req.model if adapter else gateway.engine.model_name,
        "created": int(time.time()), "usage": usage(len(req.token_ids), results, req.sampling_params.n),
        "prompt_logprobs": None if req.prompt_top_k is None or prompt is None
        else prompt_logprobs(prompt, req.prompt_top_k, gateway.table),
        "prompt_token_ids": req.token_ids if req.return_token_ids else None,
        **dict.fromkeys(ABSENT_FIELDS), "output_mode": "tokens",
        "choices": [_choice(req, i, result.whole, result.finish_name) | dict.fromkeys(ABSENT_CHOICE_FIELDS)
                    for i, result in enumerate(results)],
    })
    count_bytes(len(body))
    return Response(body, media_type="application/json")


def _choice(req: InferenceGenerateRequest, index: int, output: Output, finish_reason: str | None) -> dict:
    k = req.output_top_k
    return {"index": index, "finish_reason": finish_reason, "token_ids": output.token_ids,
            "logprobs": None if k is None or output.output is None else generate_logprobs(top_k(output.output, k), k)}


async def _events(req: InferenceGenerateRequest, gens: Generations, request_id: str):
    """vLLM's chunks: each sample's new ids (its finish_reason with its last), the prompt's ids with the first
    chunk when asked; with include_usage, a last chunk of usage alone."""
    ended: dict[int, Reply] = {}
    prompt_sent = not req.return_token_ids
    async for i, reply in gens.merged():
        if not reply.new.token_ids and not reply.finished:
            continue
        chunk: dict = {"request_id": request_id, "output_mode": "tokens",
                       "choices": [_choice(req, i, reply.new, reply.finish_name)]}
        if not prompt_sent:
            chunk["prompt_token_ids"], prompt_sent = req.token_ids, True
        yield event(chunk)
        if reply.finished:
            ended[i] = reply
    if req.include_usage:
        results = [ended[i] for i in range(len(ended))]
        yield event({"request_id": request_id, "output_mode": "tokens", "choices": [],
                     "usage": usage(len(req.token_ids), results, req.sampling_params.n)})
    yield DONE
