"""OpenAI's `POST /v1/chat/completions`: messages (and tools) through the chat template, n choices, SSE;
each choice's text split into reasoning, content and tool calls (agents/)."""

import time

from fastapi import APIRouter, Request, Response
from flatwire_wire.logprobs import RequestLogprobs

from services.gateway.agents.reasoning import ThinkBlock, prompt_closes_block
from services.gateway.agents.tool_calls import (
    ForcedCalls,
    ToolCallParser,
    ToolCallParserName,
    template_tool_call_parser,
    tool_call_parser,
)
from services.gateway.agents.turn import AssistantTurn
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
from services.gateway.prompts import encode_chat
from services.gateway.protocol.cost import LogprobFields
from services.gateway.protocol.intake import generate_inputs
from services.gateway.protocol.openai import ChatCompletionRequest, prompt_request
from services.gateway.protocol.parse import InvalidRequest
from services.gateway.render import assistant
from services.gateway.render.openai_chat import chat_logprobs
from services.gateway.render.pieces import dumps
from services.gateway.render.vllm_logprobs import prompt_logprobs, top_k
from services.gateway.reply import Reply
from services.gateway.routing import routing_key

ENDPOINT = "/v1/chat/completions"

router = APIRouter()


@router.post(ENDPOINT, openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    gateway = gateway_of(request)
    started = time.perf_counter()
    gateway.metrics.requests.labels(ENDPOINT).inc()
    req = await parse_body_off_loop(ChatCompletionRequest, await request.body(), gateway.limits)
    check_model(gateway, req.model)
    if req.tool_choice_name == "auto" and _tool_call_parser(gateway) is None:
        raise InvalidRequest("tool_choice" if req.tool_choice else "tools",
                             "tool_choice auto (the default with tools) needs a server started with "
                             "--tool-call-parser; give tool_choice required, a function's name, or none")
    ids = await encode_chat(gateway.engine.tokenizer, req.messages, gateway.limits.max_context,
                            req.template_tools(), req.template_kwargs())
    inputs = generate_inputs([(prompt_request(req), ids)], gateway.limits, req.logprob_fields(
        LogprobFields(top_k="top_logprobs", max_new_tokens=req.max_tokens_field, n="n")), req.n)
    starting = Generations.start(gateway.engine, inputs, gateway.metrics, ENDPOINT, started,
                                 routing_key(request.headers) or req.prompt_cache_key)
    if req.stream:
        gens = await unless_disconnected(request, starting)
        return sse_response(_events(gateway, req, gens, ids), gens.close,
                            gateway.metrics.bytes_sent.labels(openai_format(req, req.logprobs)).inc)
    results = await unless_disconnected(request, Generations.collect(starting))
    body = dumps({
        "id": response_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
        "model": gateway.engine.model_name,
        "choices": [_choice(gateway, req, i, result, ids) for i, result in enumerate(results)],
        "usage": usage(len(ids), results, req.n),
        **({"prompt_token_ids": ids} if req.return_token_ids else {}),
        **_prompt_logprobs(gateway, req, results[0].whole.prompt),
    })
    gateway.metrics.bytes_sent.labels(openai_format(req, req.logprobs)).inc(len(body))
    return Response(body, media_type="application/json")


def _logprobs(gateway: Gateway, req: ChatCompletionRequest, track: RequestLogprobs | None) -> dict | None:
    if not req.logprobs or track is None:
        return None
    # The rows hold prompt_logprobs' candidates when that asks for more.
    return chat_logprobs(top_k(track, req.output_top_k), gateway.table,
                         candidates=not req.return_flat_raw_output_top_logprobs)


def _prompt_logprobs(gateway: Gateway, req: ChatCompletionRequest, track: RequestLogprobs | None) -> dict:
    """vLLM's top-level prompt_logprobs, when asked for (the choices share the prompt)."""
    if (k := req.prompt_top_k) is None:
        return {}
    assert track is not None  # asked for: logprob_start_len 0
    return {"prompt_logprobs": prompt_logprobs(track, k, gateway.table)}


def _tool_call_parser(gateway: Gateway) -> ToolCallParserName | None:
    """The server's --tool-call-parser, else the one the model's chat template's call format names."""
    template = gateway.engine.tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the one transformers renders tools with
        template = template.get("tool_use", template.get("default"))
    return gateway.config.tool_call_parser or template_tool_call_parser(template)


def _turn(gateway: Gateway, req: ChatCompletionRequest, prompt_ids: list[int]) -> AssistantTurn:
    """A choice's parsers: the server's reasoning parser unless the request keeps reasoning in the content,
    and with tools the server's tool-call parser (auto) or the forced calls' JSON (required, a function); calls
    stream piece by piece when the request streams."""
    config = gateway.config
    forced = req.tool_choice_name in ("required", "function")
    think = None
    if config.reasoning_parser and req.separate_reasoning:
        # A forced call's output is the grammar's JSON from its first token: none of it is in a block that the
        # prompt opened (deepseek-r1's, Qwen3.5's), as if the prompt had closed it.
        after_block = forced or prompt_closes_block(gateway.engine.tokenizer, prompt_ids)
        think = ThinkBlock(config.reasoning_parser, after_block)
    tools: ToolCallParser | None = None
    parser = _tool_call_parser(gateway)
    if forced:
        tools = ForcedCalls(req.function_names, req.forced_function, stream=req.stream)
    elif req.tool_choice_name == "auto" and parser is not None:
        schemas = {tool.function.name: tool.function.parameters for tool in req.tools or []}
        tools = tool_call_parser(parser, schemas, stream=req.stream)
    return AssistantTurn(think, tools, stream_reasoning=req.stream_reasoning,
                         max_calls=None if req.parallel_tool_calls else 1)


def _finish(req: ChatCompletionRequest, result: Reply, turn: AssistantTurn) -> dict:
    """OpenAI's finish_reason "tool_calls" for a turn that stopped after calling tools; "stop" still where the
    request named the function to call (OpenAI's, and vLLM's since its PR 25054)."""
    fields = finish_fields(result)
    if turn.calls and fields["finish_reason"] == "stop" and req.forced_function is None:
        fields["finish_reason"] = "tool_calls"
    return fields


def _choice(gateway: Gateway, req: ChatCompletionRequest, index: int, result: Reply,
            prompt_ids: list[int]) -> dict:
    turn = _turn(gateway, req, prompt_ids)
    output = result.whole
    whole = turn.feed(output.text)
    whole.extend(turn.end())
    choice = {"index": index, "message": assistant.message(whole, turn.separates_reasoning),
              "logprobs": _logprobs(gateway, req, output.output), **_finish(req, result, turn)}
    if req.return_token_ids:
        choice["token_ids"] = output.token_ids
    if req.return_meta_info:
        choice["meta_info"] = choice_meta_info(gateway, req, result)
    return choice


async def _events(gateway: Gateway, req: ChatCompletionRequest, gens: Generations, prompt_ids: list[int]):
    head = chunk_head(gateway, req, "chat.completion.chunk", "chatcmpl")

    metas = StreamedMetaInfo(gateway, req, req.n)

    def chunk_event(index: int, delta: dict, logprobs: dict | None = None, finish: dict | None = None,
                    meta: dict | None = None, token_ids=None, extra: dict | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, **(finish or {"finish_reason": None})}
        if meta is not None:
            choice["meta_info"] = meta
        if req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return event(head | {"choices": [choice]} | (extra or {}))

    turns = [_turn(gateway, req, prompt_ids) for _ in range(req.n)]
    for i in range(req.n):  # the prompt's ids once, with the first chunk (as vLLM)
        yield chunk_event(i, {"role": "assistant", "content": ""},
                          extra={"prompt_token_ids": prompt_ids} if req.return_token_ids and i == 0 else None)
    ended: dict[int, Reply] = {}  # each choice's result, as it ends
    async for i, reply in gens.merged():
        new = reply.new
        if new.token_ids or new.text:
            piece, logprobs = turns[i].feed(new.text), _logprobs(gateway, req, new.output)
            meta = metas.chunk(i, reply)
            # Text the parsers hold (a tag, a call's text before its name) makes no event of its own unless the
            # reply carries more (as vLLM: OpenAI never sends an empty delta).
            if not assistant.is_empty(piece) or logprobs is not None or meta is not None or req.return_token_ids:
                yield chunk_event(i, assistant.delta(piece), logprobs, meta=meta, token_ids=new.token_ids)
        if reply.finished:
            ended[i] = reply
            if not assistant.is_empty(rest := turns[i].end()):  # what the parsers held to the end
                yield chunk_event(i, assistant.delta(rest))
            yield chunk_event(i, {}, finish=_finish(req, reply, turns[i]), meta=metas.last(reply))
    if req.include_usage:
        yield event(head | {"choices": [], "usage": usage(len(prompt_ids), [ended[i] for i in range(req.n)], req.n)})
    yield DONE
