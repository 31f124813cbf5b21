"""OpenAI's (legacy) `POST /v1/completions`: prompts as text or ids, n choices each, echo, SSE."""

import asyncio
import time

from fastapi import APIRouter, Request, Response
from flatwire_wire.logprobs import RequestLogprobs

from services.gateway.http.context import Gateway, gateway_of
from services.gateway.http.guards import parse_body_off_loop
from services.gateway.http.openai_common import (
    StreamedMetaInfo,
    check_model,
    choice_meta_info,
    chunk_head,
    finish_fields,
    openai_format,
    response_id,
    usage,
)
from services.gateway.http.openapi import request_body
from services.gateway.http.sse import DONE, event, sse_response
from services.gateway.http.streams import Generations, unless_disconnected
from services.gateway.prompts import encode_texts
from services.gateway.protocol.cost import LogprobFields
from services.gateway.protocol.intake import generate_inputs
from services.gateway.protocol.openai import CompletionRequest, prompt_request
from services.gateway.render.openai_completions import completion_logprobs
from services.gateway.render.pieces import dumps
from services.gateway.render.vllm_logprobs import prompt_logprobs, top_k
from services.gateway.reply import Reply
from services.gateway.routing import routing_key

ENDPOINT = "/v1/completions"
LOGPROB_FIELDS = LogprobFields(top_k="logprobs", max_new_tokens="max_tokens", prompt="the prompt, with echo", n="n")

router = APIRouter()


@router.post(ENDPOINT, openapi_extra=request_body(CompletionRequest))
async def completions(request: Request) -> Response:
    gateway = gateway_of(request)
    started = time.perf_counter()
    gateway.metrics.requests.labels(ENDPOINT).inc()
    req = await parse_body_off_loop(CompletionRequest, await request.body(), gateway.limits)
    check_model(gateway, req.model)
    prompts = req.prompts()
    tokenizer = gateway.engine.tokenizer
    if isinstance(prompts[0], str):
        ids, texts = await encode_texts(tokenizer, prompts, gateway.limits.max_context, "prompt"), prompts
    else:
        # decoding millions of ids for echo is CPU work for a worker thread, not the event loop
        ids, texts = prompts, (await asyncio.to_thread(tokenizer.batch_decode, prompts) if req.echo
                               else [""] * len(prompts))
    prompt = prompt_request(req)  # choice p * n + j: prompt p's j-th sample
    inputs = generate_inputs([(prompt, prompt_ids) for prompt_ids in ids], gateway.limits,
                             req.logprob_fields(LOGPROB_FIELDS), req.n)
    echoes = [text for text in texts for _ in range(req.n)] if req.echo else [""] * len(inputs)
    choice_prompts = [inp.input_ids for inp in inputs] if req.return_token_ids else None  # per choice, as vLLM
    starting = Generations.start(gateway.engine, inputs, gateway.metrics, ENDPOINT, started,
                                 routing_key(request.headers))
    prompt_tokens = sum(map(len, ids))
    count_bytes = gateway.metrics.bytes_sent.labels(openai_format(req, req.logprobs is not None)).inc
    if req.stream:
        gens = await unless_disconnected(request, starting)
        return sse_response(_events(gateway, req, gens, echoes, prompt_tokens, choice_prompts), gens.close, count_bytes)
    results = await unless_disconnected(request, Generations.collect(starting))
    body = dumps({
        "id": response_id("cmpl"), "object": "text_completion", "created": int(time.time()),
        "model": gateway.engine.model_name,
        "choices": [_choice(gateway, req, i, result, echoes[i], choice_prompts) for i, result in enumerate(results)],
        "usage": usage(prompt_tokens, results, req.n),
    })
    count_bytes(len(body))
    return Response(body, media_type="application/json")


def _logprobs(gateway: Gateway, req: CompletionRequest, prompt: RequestLogprobs | None, output: RequestLogprobs | None,
              text_offset: int) -> dict | None:
    """Offsets count characters of the choice's `text` (the echoed prompt included)."""
    if req.logprobs is None:
        return None
    tracks = [track for track in ((prompt if req.echo else None), output) if track is not None]
    # The candidates asked for: none here when they are in meta_info; the rows hold prompt_logprobs' when larger.
    k = 0 if req.return_flat_raw_output_top_logprobs else req.logprobs
    return completion_logprobs([top_k(track, k) for track in tracks], gateway.table, text_offset)


def _token_ids(choice_prompts: list[list[int]] | None, index: int, token_ids) -> dict:
    """vLLM's return_token_ids fields of choice `index`: its prompt's ids (None: not asked) and its own."""
    return {} if choice_prompts is None else {"prompt_token_ids": choice_prompts[index], "token_ids": token_ids}


def _choice(gateway: Gateway, req: CompletionRequest, index: int, result: Reply, echo: str,
            choice_prompts: list[list[int]] | None) -> dict:
    whole = result.whole
    choice = {"index": index, "text": echo + whole.text,
              "logprobs": _logprobs(gateway, req, whole.prompt, whole.output, 0), **finish_fields(result),
              **_token_ids(choice_prompts, index, whole.token_ids)}
    if (k := req.prompt_top_k) is not None:
        assert whole.prompt is not None  # asked for: logprob_start_len 0
        choice["prompt_logprobs"] = prompt_logprobs(whole.prompt, k, gateway.table)
    if req.return_meta_info:
        choice["meta_info"] = choice_meta_info(gateway, req, result)
    return choice


async def _events(gateway: Gateway, req: CompletionRequest, gens: Generations, echoes: list[str],
                  prompt_tokens: int, choice_prompts: list[list[int]] | None):
    head = chunk_head(gateway, req, "text_completion", "cmpl")
    sent_chars = [0] * len(echoes)  # text already sent per choice, for text_offset
    metas = StreamedMetaInfo(gateway, req, len(echoes))
    ended: dict[int, Reply] = {}  # each choice's result, as it ends
    prompt_sent: set[int] = set()
    async for i, reply in gens.merged():
        new = reply.new
        text = new.text
        if sent_chars[i] == 0 and echoes[i]:
            text = echoes[i] + text
        if text or new.token_ids or new.prompt is not None:
            choice = {"index": i, "text": text,
                      "logprobs": _logprobs(gateway, req, new.prompt, new.output, sent_chars[i]),
                      "finish_reason": None}
            if choice_prompts is not None:  # the prompt's ids with a choice's first chunk only
                choice |= _token_ids(choice_prompts, i, new.token_ids) if i not in prompt_sent else {
                    "token_ids": new.token_ids}
                prompt_sent.add(i)
            if (meta := metas.chunk(i, reply)) is not None:
                choice["meta_info"] = meta
            sent_chars[i] += len(text)
            yield event(head | {"choices": [choice]})
        if reply.finished:
            ended[i] = reply
            last = {"index": i, "text": "", "logprobs": None, **finish_fields(reply)}
            if (meta := metas.last(reply)) is not None:
                last["meta_info"] = meta
            yield event(head | {"choices": [last]})
    if req.include_usage:
        choices = [ended[i] for i in range(len(echoes))]
        yield event(head | {"choices": [], "usage": usage(prompt_tokens, choices, req.n)})
    yield DONE
