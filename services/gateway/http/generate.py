"""SGLang's `POST /generate`: text or input_ids, single or batch, streaming or not."""

import time

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from services.gateway.http.accept import prefers
from services.gateway.http.context import ROUTER_UNNAMED_MODEL, Gateway, gateway_of
from services.gateway.http.guards import parse_body_off_loop
from services.gateway.http.meta_info import base_meta_info
from services.gateway.http.openapi import request_body
from services.gateway.http.sse import DONE, event, sse_response
from services.gateway.http.streams import Generations, unless_disconnected
from services.gateway.prompts import encode_texts
from services.gateway.protocol.cost import LogprobFields
from services.gateway.protocol.intake import GenerateInput, generate_inputs
from services.gateway.protocol.parse import InvalidRequest, is_id_lists
from services.gateway.protocol.sglang import GenerateRequest
from services.gateway.render import packed as packed_format
from services.gateway.render.sglang_meta import LogprobFormat, logprob_meta_info
from services.gateway.render.top_p import CumulativeTopP, top_p_meta_info
from services.gateway.reply import Output, Reply
from services.gateway.routing import routing_key

ENDPOINT = "/generate"
LOGPROB_FIELDS = LogprobFields(top_k="top_logprobs_num", max_new_tokens="sampling_params.max_new_tokens",
                               token_ids="token_ids_logprob", prompt="the prompt from logprob_start_len")

router = APIRouter()


@router.post(ENDPOINT, openapi_extra=request_body(GenerateRequest))
async def generate(request: Request) -> Response:
    gateway = gateway_of(request)
    started = time.perf_counter()
    gateway.metrics.requests.labels(ENDPOINT).inc()
    req = await parse_body_off_loop(GenerateRequest, await request.body(), gateway.limits)
    _check_model(gateway, req.model)
    packed = prefers(request.headers.get("accept"), packed_format.MEDIA_TYPE)
    if packed and req.returns_list:
        raise InvalidRequest(req.prompt_field if req.is_batch else "sampling_params.n",
                             f"a batch cannot be answered as {packed_format.MEDIA_TYPE}: send one prompt and n=1 "
                             "per request")
    inputs = await _inputs(gateway, req)
    starting = Generations.start(gateway.engine, inputs, gateway.metrics, ENDPOINT, started,
                                 routing_key(request.headers) or req.routing_key)
    if req.stream:
        gens = await unless_disconnected(request, starting)
        if packed:
            return StreamingResponse(_packed_messages(gens), media_type=packed_format.MEDIA_TYPE,
                                     background=BackgroundTask(gens.close))
        return sse_response(_events(gateway, req, gens), gens.close,
                            gateway.metrics.bytes_sent.labels(logprob_format(req)).inc)
    results = await unless_disconnected(request, Generations.collect(starting))
    if packed:
        message = packed_format.packed_response(results[0], results[0].whole)
        return Response(message.to_bytes(), media_type=packed_format.MEDIA_TYPE)
    bodies = [_body(gateway, req, result) for result in results]
    body = orjson.dumps(bodies if req.returns_list else bodies[0], option=orjson.OPT_SERIALIZE_NUMPY)
    gateway.metrics.bytes_sent.labels(logprob_format(req)).inc(len(body))
    return Response(body, media_type="application/json")


def _check_model(gateway: Gateway, model: str | None) -> None:
    """SGLang ignores /generate's `model`; here it selects (Gateway.model_named), and absent, null or a router's
    placeholder for none is the served model."""
    if model not in (None, ROUTER_UNNAMED_MODEL) and gateway.model_named(model) is None:
        raise InvalidRequest("model", f"model: this server serves {', '.join(map(repr, gateway.model_names))}, "
                                      f"not {model!r}")


async def _inputs(gateway: Gateway, req: GenerateRequest) -> list[GenerateInput]:
    prompts = req.prompts()
    if is_id_lists(prompts):  # input_ids (text prompts are strings, and a batch is never empty)
        ids = prompts
    else:
        ids = await encode_texts(gateway.engine.tokenizer, prompts, gateway.limits.max_context, req.prompt_field)
    return generate_inputs([(req.prompt(i), prompt_ids) for i, prompt_ids in enumerate(ids)], gateway.limits,
                           LOGPROB_FIELDS, req.samples_per_prompt)


def _logprob_meta(gateway: Gateway, req: GenerateRequest, part: Output, prompt_side: bool = True) -> dict:
    fmt = LogprobFormat(
        return_text_in_logprobs=req.return_text_in_logprobs,
        return_flat_raw_top_logprobs=req.return_flat_raw_top_logprobs,
        return_flat_raw_output_top_logprobs=req.return_flat_raw_output_top_logprobs,
        return_flat_raw_top_logprobs_b64=req.return_flat_raw_top_logprobs_b64)
    return logprob_meta_info(part, fmt, gateway.table, prompt_side)


def _body(gateway: Gateway, req: GenerateRequest, result: Reply) -> dict:
    whole = result.whole
    meta = base_meta_info(result) | _logprob_meta(gateway, req, whole) | \
        top_p_meta_info(whole.top_p, req.return_flat_raw_top_logprobs_b64)
    if whole.output is not None:  # it asked for logprobs
        meta["output_token_logprobs_length"] = result.completion_tokens  # SGLang's, which RL clients read
    return {"text": whole.text, "output_ids": whole.token_ids, "meta_info": meta}


class _StreamState:
    """One prompt's stream. SGLang sends text, output_ids and logprobs cumulatively (or, with
    --incremental-streaming-output, only what is new in each event).

    Each reply's new rows are rendered once and their JSON appended to what was rendered
    before (the renderers return finished JSON fragments); the prompt's fields come
    with the first reply and are repeated as they are. Flat top-k arrays are the
    exception: each event carries only its own rows (`output_top_logprobs_offset` is
    the index of the first), and the flat prompt arrays come once, in the first event,
    so that a long stream's bytes stay those of the non-streamed response. The top-p
    replay nuclei follow the same rule: cumulative JSON lists, or each event's own in
    base64 (with `top_p_token_start`, the index of its first token).
    """

    def __init__(self, wants_logprob: bool):
        self.wants_logprob = wants_logprob
        self.prompt_fields: dict = {}
        self.output_items: dict[str, bytearray] = {}  # each output list's elements so far, as JSON: "e1,e2,..."
        self.rows_sent = 0  # flat output rows sent in earlier events
        self.top_p = CumulativeTopP()
        self.top_p_sent = 0  # tokens whose nuclei earlier events sent

    def payload(self, gateway: Gateway, req: GenerateRequest, reply: Reply) -> dict:
        incremental = gateway.config.incremental_streaming_output
        if incremental:  # each event: what is new since the previous one (the counts stay cumulative)
            self.output_items.clear()
        new = reply.new
        meta = base_meta_info(reply)
        flat_output, flat_prompt = req.return_flat_raw_output_top_logprobs, req.return_flat_raw_top_logprobs
        prompt_side = new.prompt is not None or not self.prompt_fields  # else the first event's, repeated
        logprob_meta = _logprob_meta(gateway, req, new, prompt_side) if self.wants_logprob else {}
        for key, value in logprob_meta.items():
            if flat_output and key.startswith("output_top_logprobs_"):  # this event's rows only
                meta[key] = value
            elif key.startswith("output_"):
                elements, items = orjson.dumps(value)[1:-1], self.output_items.setdefault(key, bytearray())
                if elements:  # appended, never joined again: an event's work does not grow with the output so far
                    items += b"," + elements if items else elements
                meta[key] = orjson.Fragment(b"[" + items + b"]")
            elif flat_prompt and key.startswith("input_top_logprobs_"):  # once, with the prompt
                if new.prompt is not None:
                    meta[key] = value
            elif new.prompt is not None or key not in self.prompt_fields:
                self.prompt_fields[key] = value
        if flat_output and new.output is not None:
            meta["output_top_logprobs_offset"] = self.rows_sent
            self.rows_sent += len(new.output.token_logprobs)
        for key, items in self.output_items.items():  # an event without new rows (an abort's last) repeats them
            meta.setdefault(key, orjson.Fragment(b"[" + items + b"]"))
        meta |= self.prompt_fields | self._top_p(req, new, incremental)
        if self.wants_logprob:
            meta["output_token_logprobs_length"] = reply.completion_tokens  # all told, in both modes (as SGLang)
        shown = new if incremental else reply.whole
        return {"text": shown.text, "output_ids": shown.token_ids, "meta_info": meta}


    def _top_p(self, req: GenerateRequest, new: Output, incremental: bool) -> dict:
        """The nuclei fields of an event: so far (SGLang's cumulative lists), or its own (incremental, base64)."""
        if new.top_p is None:
            return {}
        if incremental or req.return_flat_raw_top_logprobs_b64:
            start, self.top_p_sent = self.top_p_sent, self.top_p_sent + new.top_p.tokens
            return top_p_meta_info(new.top_p, req.return_flat_raw_top_logprobs_b64, start)
        return self.top_p.add(new.top_p)


async def _events(gateway: Gateway, req: GenerateRequest, gens: Generations):
    states = [_StreamState(inp.logprob.return_logprob) for inp in gens.inputs]
    indexed = req.returns_list
    async for i, reply in gens.merged():
        payload = states[i].payload(gateway, req, reply)
        if indexed:
            payload["index"] = i
        yield event(payload)
    yield DONE


async def _packed_messages(gens: Generations):
    """A stream as length-delimited GenerateResponsePacked messages, the last with its finish_reason. A fault
    mid-way cuts the connection (there is no error message in this format): a client that got no message with
    a finish_reason knows its stream is incomplete."""
    async for _, reply in gens.merged():
        yield packed_format.delimited(packed_format.packed_response(reply, reply.new))


def logprob_format(req: GenerateRequest) -> str:
    """The label of the response's logprob format, for the bytes-sent metric."""
    if not req.any_logprob:
        return "text"
    if req.return_flat_raw_top_logprobs or req.return_flat_raw_output_top_logprobs:
        return "flat_b64" if req.return_flat_raw_top_logprobs_b64 else "flat_json"
    return "nested"
