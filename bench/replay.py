"""Replay benchmark (issue 4, item 1): step outputs through the real detokenizer and gateway code.

A request's generation is replayed as the scheduler sends it: a request that does not
stream ships 50 tokens per entry (its --output-interval), one that streams a token per
message (ids of a real English + CJK paragraph in the Qwen3.5 vocabulary of the default
model; random sorted logprobs for the top-k, the chosen token first). Each stage runs
the services' own code in process, without sockets:

- detokenize: the detokenizer's work per message: StepOutput.FromString,
  DetokenizerManager.process (incremental decode, stop strings), Router.publish (the
  owner's slice) and SerializeToString of what goes to the gateway.
- accumulate: the gateway's EngineClient._dispatch of every message, the replies a request's
  generator takes (EngineClient._reply: one per message when streaming, else one at the
  end), _finish, and the last reply's whole output.
- build / serialize: the response in each client format from the last Reply's whole
  output (the renderers the HTTP and gRPC routes call), then orjson /
  SerializeToString.
- client: parse the body (stdlib json and orjson) and turn the top-k into numpy arrays.

Per response at B=1 (the request alone in every step) and B=32 (32 requests share each
step, per-response cost = total / 32). Beside them the floor, in the same run: copying
the top-k bytes and base64-encoding them. Timings are CPU time of this process
(time.process_time), in interleaved rounds, medians: the machine is shared, and
wall time would count other processes' turns on the cores.

    python -m bench.replay        # writes bench/out/replay.{md,json}
"""

import argparse
import base64
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import orjson
import pybase64
from flatwire_wire.logprobs import F32, I32, LogprobBlock, LogprobRows, RequestLogprobs
from flatwire_wire.public import GenerateResponse
from flatwire_wire.scheduler import LogprobParams, SamplingParams
from flatwire_wire.steps import (
    DetokenizeParams,
    Finish,
    FinishReason,
    RequestStart,
    StepMessage,
    decode_step,
    encode_step,
)
from transformers import AutoTokenizer

from bench.common import Interleaved, Progress, Table, fmt_bytes, fmt_ratio, fmt_time, write_results
from services.common.model_store import resolve_model
from services.detokenizer.batch_decode import batch_decoder
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.router import Router
from services.gateway.accumulator import Accumulator
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EngineClient, GenerationState
from services.gateway.http.meta_info import base_meta_info
from services.gateway.protocol.intake import GenerateInput
from services.gateway.render import LogprobFormat, chat_logprobs, dumps, logprob_meta_info
from services.gateway.render.packed import packed_response
from services.gateway.reply import Reply
from services.gateway.token_table import TokenTable

SHAPES = [(160, 128), (1000, 32), (1000, 128)]
SWEEP_K = (0, 8, 32, 64, 128)  # at 1000 tokens, for the plots
SWEEP_TOKENS = (125, 250, 500, 1000)  # at k=128
TOPK_PART = ("SGLang flat base64", "gRPC raw (GenerateResponsePacked)")  # also timed at k=0: the top-k's share
BATCHES = (1, 32)
INTERVAL = 50  # tokens per entry of a request that does not stream (the scheduler's --output-interval)
STREAMED_SHAPE = (1000, 128)  # also replayed a token per message, as a streaming request ships
OWNER = "gw-bench"
SCHEDULER = "127.0.0.1:30010"
# SGLang's table from issue 4 (Qwen3.5 tokenizer, CPU replay, median of 5):
# detokenize, build response, serialize (ms), body (MB), client parse+decode (ms).
SGLANG = {
    (160, 128, "nested"): (42.7, 70.4, 323.9, 2.62, 40.3),
    (160, 128, "flat b64"): (1.4, 0.8, 5.0, 0.24, 0.8),
    (1000, 32, "nested"): (70.0, 110.7, 906.3, 4.22, 67.5),
    (1000, 32, "flat b64"): (3.9, 3.7, 20.0, 0.50, 2.7),
    (1000, 128, "nested"): (261.5, 895.4, 2598.3, 16.39, 297.6),
    (1000, 128, "flat b64"): (8.5, 4.7, 30.5, 1.52, 4.7),
}
PARAGRAPH = (
    "The committee met on Tuesday to review the quarterly results, and most members agreed that the new "
    "pricing had worked better than expected, although shipping delays in the northern region still worried "
    "several of them. 会议在星期二召开，委员会审查了季度业绩。大多数成员认为新的定价策略效果好于预期，"
    "但北方地区的运输延误仍然让其中几位感到担忧。They asked for a short report before the next meeting, "
    "with figures for each warehouse and a plan for the holiday season. 他们要求在下次会议之前提交一份简短的报告，"
    "列出每个仓库的数据以及假日季节的计划。"
)


# ---- the workload: what the scheduler sends ----

@dataclass
class Workload:
    tokens: int
    k: int
    batch: int
    rids: list[str]
    steps: list[bytes]  # serialized StepOutputs as the scheduler sends them
    interval: int  # tokens per entry


def paragraph_ids(tokenizer, tokens: int) -> np.ndarray:
    ids = tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    return np.resize(np.asarray(ids, dtype=I32), tokens)  # repeated to length


def scheduler_steps(ids: np.ndarray, k: int, batch: int, vocab: int, interval: int = INTERVAL,
                    seed: int = 0) -> Workload:
    """The messages of `batch` requests generating `ids`, `interval` tokens per entry (1: streaming)."""
    tokens = len(ids)
    rng = np.random.default_rng(seed)
    values = -np.sort(rng.exponential(1.5, (tokens, batch, k)).astype(F32), axis=2)
    topk_ids = rng.integers(0, vocab, (tokens, batch, k), dtype=I32)
    if k:
        topk_ids[:, :, 0] = ids[:, None]  # greedy: the chosen token is the best candidate
    chosen = values[:, :, 0] if k else -rng.exponential(1.5, (tokens, batch)).astype(F32)
    rids = [f"{i:032x}" for i in range(batch)]
    detokenize = DetokenizeParams(skip_special_tokens=True, spaces_between_special_tokens=True)
    steps = []
    for n in range(0, tokens, interval):
        count = min(interval, tokens - n)
        request_major = slice(n, n + count)  # [count, batch, ...] -> each request's rows, one request after another
        started = [RequestStart(rid=rid, owner=OWNER, detokenize=detokenize, prompt_tokens=8) for rid in rids]
        finished = [Finish(rid=rid, reason=FinishReason.LENGTH, output_tokens=tokens) for rid in rids]
        message = StepMessage(
            step=n, rids=rids, token_ids=np.tile(ids[request_major], batch).tolist(), positions=[n] * batch,
            counts=[count] * batch, started=started if n == 0 else [],
            finished=finished if n + count == tokens else [],
            output=LogprobBlock.of_rows([
                LogprobRows(chosen[request_major, b], values[request_major, b], topk_ids[request_major, b],
                            np.zeros((count, 0), F32)) for b in range(batch)]))
        steps.append(message.encoded)
    return Workload(tokens, k, batch, rids, steps, interval)


# ---- the stages, each the services' own code ----

def detokenize(tokenizer, workload: Workload) -> list[bytes]:
    """The detokenizer process's work on every step; returns what it sends the gateway."""
    manager, router = DetokenizerManager(batch_decoder(tokenizer)), Router()
    queue = router.subscribe(OWNER)
    sent = []
    for data in workload.steps:
        owned, _ = manager.process(decode_step(data), SCHEDULER)
        router.publish(owned)
        sent.append(encode_step(queue.get_nowait()))
    return sent


def accumulate(engine: EngineClient, workload: Workload, received: list[bytes]) -> list[Reply]:
    """The gateway's receiving side: dispatch every message and take the replies a request's generator would
    (streaming: one per message; otherwise one, the whole output, at the end); the last ones' whole outputs."""
    stream = workload.interval == 1
    inp = GenerateInput(input_ids=list(range(8)), sampling=SamplingParams(max_new_tokens=workload.tokens),
                        logprob=LogprobParams(return_logprob=True, top_logprobs_num=workload.k, logprob_start_len=-1),
                        detokenize=DetokenizeParams(), stream=stream)
    states = [GenerationState(rid=rid, inp=inp, started_at=time.perf_counter(),
                           outputs=Accumulator(inp.logprob, workload.tokens)) for rid in workload.rids]
    engine._requests = {state.rid: state for state in states}
    replies: list[Reply] = []
    for n, data in enumerate(received, 1):
        engine._dispatch(decode_step(data))
        if stream or n == len(received):
            replies = [engine._reply(state) for state in states]
    for reply in replies:
        assert reply.whole  # built here, as a route asks for it
    return replies


# ---- client formats: build, serialize, client parse + decode ----

@dataclass
class Format:
    build: Callable[[Reply], object]
    serialize: Callable[[object], bytes]
    client: Callable[[bytes, Callable], object]  # (body, json loads) -> the top-k as numpy arrays


def _generate_body(fmt: LogprobFormat, table: TokenTable) -> Callable[[Reply], dict]:
    # What the /generate route returns (services/gateway/http/generate.py, _body).
    return lambda result: {"text": result.whole.text, "output_ids": result.whole.token_ids,
                           "meta_info": base_meta_info(result) | logprob_meta_info(result.whole, fmt, table)}


def _chat_body(table: TokenTable) -> Callable[[Reply], dict]:
    # What /v1/chat/completions returns (services/gateway/http/openai_chat.py, _choice).
    return lambda result: {
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.whole.text},
                     "logprobs": chat_logprobs(result.whole.output, table), "finish_reason": "length"}],
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}}


def _packed(result: Reply) -> GenerateResponse:
    # What the public gRPC Generate returns (services/gateway/grpc_api.py) for a request that did not stream.
    return packed_response(result, result.whole)


def _nested_client(body: bytes, loads) -> tuple:
    rows = loads(body)["meta_info"]["output_top_logprobs"]
    return (np.array([[c[0] for c in row] for row in rows], dtype=F32),
            np.array([[c[1] for c in row] for row in rows], dtype=I32), [[c[2] for c in row] for row in rows])


def _chat_client(body: bytes, loads) -> tuple:
    content = loads(body)["choices"][0]["logprobs"]["content"]
    return (np.array([[c["logprob"] for c in e["top_logprobs"]] for e in content], dtype=F32),
            [[c["token"] for c in e["top_logprobs"]] for e in content])


def _flat_client(body: bytes, loads) -> tuple:
    meta = loads(body)["meta_info"]
    shape = meta["output_top_logprobs_shape"]
    return (np.asarray(meta["output_top_logprobs_val_flat"], dtype=F32).reshape(shape),
            np.asarray(meta["output_top_logprobs_idx_flat"], dtype=I32).reshape(shape))


def _b64_client(body: bytes, loads) -> tuple:
    meta = loads(body)["meta_info"]
    shape = meta["output_top_logprobs_shape"]
    return (np.frombuffer(pybase64.b64decode(meta["output_top_logprobs_val_flat_b64"]), F32).reshape(shape),
            np.frombuffer(pybase64.b64decode(meta["output_top_logprobs_idx_flat_b64"]), I32).reshape(shape))


def _grpc_client(body: bytes, loads) -> tuple:
    output = GenerateResponse.from_bytes(body).output_logprobs()
    assert output is not None
    return output.topk_values, output.topk_ids


def formats(table: TokenTable) -> dict[str, Format]:
    flat = dict(return_flat_raw_output_top_logprobs=True)
    return {
        "SGLang nested + text": Format(_generate_body(LogprobFormat(return_text_in_logprobs=True), table), dumps,
                                       _nested_client),
        "OpenAI chat logprobs": Format(_chat_body(table), dumps, _chat_client),
        "SGLang flat JSON": Format(_generate_body(LogprobFormat(**flat), table), dumps, _flat_client),
        "SGLang flat base64": Format(_generate_body(LogprobFormat(**flat, return_flat_raw_top_logprobs_b64=True),
                                                    table), dumps, _b64_client),
        "gRPC raw (GenerateResponsePacked)": Format(_packed, GenerateResponse.to_bytes, _grpc_client),
    }


SGLANG_ROW = {"SGLang nested + text": "nested", "SGLang flat base64": "flat b64"}
NO_CLIENT_JSON = {"gRPC raw (GenerateResponsePacked)"}


def _with_whole(result: Reply, **changes) -> Reply:
    """The same last reply, its whole output changed."""
    return dataclasses.replace(result, new=dataclasses.replace(result.whole, **changes), so_far=None)


def without_topk(result: Reply) -> Reply:
    """The same response with k=0: its size is the body's fixed part."""
    o = result.whole.output
    track = RequestLogprobs(o.token_logprobs, o.topk_values[:, :0], o.topk_ids[:, :0], o.ids_logprobs,
                            token_ids=o.token_ids)
    return _with_whole(result, output=track)


def truncated(result: Reply, tokens: int, k: int) -> Reply:
    """The first `tokens` positions and `k` candidates of a finished result."""
    o = result.whole.output
    track = RequestLogprobs(o.token_logprobs[:tokens], np.ascontiguousarray(o.topk_values[:tokens, :k]),
                            np.ascontiguousarray(o.topk_ids[:tokens, :k]), o.ids_logprobs[:tokens],
                            token_ids=o.token_ids[:tokens])
    return dataclasses.replace(_with_whole(result, output=track, token_ids=result.whole.token_ids[:tokens]),
                               completion_tokens=tokens)


def floor_parts(result: Reply) -> dict[str, Callable[[], object]]:
    track = result.whole.output
    return {
        "copy": lambda: (track.topk_values.copy(), track.topk_ids.copy()),
        "base64": lambda: (pybase64.b64encode(track.topk_values.data), pybase64.b64encode(track.topk_ids.data)),
    }


# ---- the run ----

class CpuInterleaved(Interleaved):
    """Interleaved rounds timed in CPU seconds of this process, not wall seconds."""

    def round(self) -> None:
        for key, (fn, number) in self.cases.items():
            start = time.process_time()
            for _ in range(number):
                fn()
            self.record(key, (time.process_time() - start) / number, number)


def run(repeats: int) -> dict:
    started = time.perf_counter()
    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    table = TokenTable.from_model_dir(model_dir)
    engine = EngineClient(GatewayConfig(owner_id=OWNER), tokenizer)
    fmts = formats(table)
    progress = Progress(len(SHAPES) + repeats + 2, "replay")
    progress.step(f"tokenizer and gateway loaded in {time.perf_counter() - started:.1f} s")

    timer = CpuInterleaved(min_time=0.02)
    shapes = {}
    for tokens, k in SHAPES:
        ids = paragraph_ids(tokenizer, tokens)
        shape = {"workloads": {}, "results": None, "bodies": {}, "fixed": {}}
        for batch in BATCHES:
            workload = scheduler_steps(ids, k, batch, table.size)
            received = detokenize(tokenizer, workload)
            results = accumulate(engine, workload, received)
            shape["workloads"][batch] = (workload, received)
            timer.add((tokens, k, batch, "detokenize"), lambda w=workload: detokenize(tokenizer, w))
            timer.add((tokens, k, batch, "accumulate"), lambda w=workload, r=received: accumulate(engine, w, r))
            if (tokens, k) == STREAMED_SHAPE:
                streamed = scheduler_steps(ids, k, batch, table.size, interval=1)
                streamed_received = detokenize(tokenizer, streamed)
                timer.add((tokens, k, batch, "detokenize streamed"), lambda w=streamed: detokenize(tokenizer, w))
                timer.add((tokens, k, batch, "accumulate streamed"),
                          lambda w=streamed, r=streamed_received: accumulate(engine, w, r))
            if batch == 1:
                shape["results"] = results
        result = shape["results"][0]
        whole = result.whole
        assert whole.text and whole.output.topk_values.shape == (tokens, k), "replay did not reassemble"
        for name, part in floor_parts(result).items():
            timer.add((tokens, k, "floor", name), part)
        for name, fmt in fmts.items():
            response = fmt.build(result)
            body = fmt.serialize(response)
            shape["bodies"][name] = body
            shape["fixed"][name] = len(fmt.serialize(fmt.build(without_topk(result))))
            timer.add((tokens, k, name, "build"), lambda f=fmt, r=result: f.build(r))
            if name in TOPK_PART:
                timer.add((tokens, k, name, "build+serialize at k=0"),
                          lambda f=fmt, r=without_topk(result): f.serialize(f.build(r)))  # noqa: B008
            timer.add((tokens, k, name, "serialize"), lambda f=fmt, r=response: f.serialize(r))
            timer.add((tokens, k, name, "client orjson"), lambda f=fmt, b=body: f.client(b, orjson.loads))
            if name not in NO_CLIENT_JSON:
                timer.add((tokens, k, name, "client json"), lambda f=fmt, b=body: f.client(b, json.loads))
        shapes[tokens, k] = shape
        progress.step(f"{tokens}x{k}: workloads built and calibrated")
    sweep = {}
    largest = shapes[SHAPES[-1]]["results"][0]
    for tokens, k in sorted({(1000, k) for k in SWEEP_K} | {(t, 128) for t in SWEEP_TOKENS}):
        result = truncated(largest, tokens, k)
        timer.add(("sweep", tokens, k, "floor"), lambda r=result: [f() for f in floor_parts(r).values()])
        for name, fmt in fmts.items():
            sweep[tokens, k, name] = len(fmt.serialize(fmt.build(result)))
            timer.add(("sweep", tokens, k, name), lambda f=fmt, r=result: f.serialize(f.build(r)))
    progress.step("sweep over k and length calibrated")
    for r in range(repeats):
        timer.round()
        progress.step(f"round {r + 1}/{repeats} of {len(timer.cases)} cases")
    return {"timer": timer, "shapes": shapes, "formats": list(fmts), "sweep": sweep}


def ms(timer: Interleaved, key) -> float:
    return timer.timing(key).median


def tables(run_data: dict) -> tuple[list[Table], dict]:
    timer, shapes, names = run_data["timer"], run_data["shapes"], run_data["formats"]
    main = Table(
        "Per response, per format",
        ["tokens x k", "format", "detokenize (B=1 / B=32)", "accumulate (B=1 / B=32)", "build", "serialize",
         "gateway CPU", "body", "client json", "client orjson", "build+serialize vs floor"],
        "CPU time per response. detokenize and accumulate do not depend on the format (one run per shape, "
        "shown on every row). "
        "gateway CPU = accumulate (B=1) + build + serialize: the gateway's whole work for the response once "
        "the detokenizer's messages are in. client = parse + top-k into numpy arrays (nested and OpenAI keep "
        "the candidate texts as lists). floor = copy + base64 of the same top-k bytes, in the same run.")
    sglang = Table(
        "Beside SGLang's reference (issue 4), same shapes",
        ["tokens x k", "format", "SGLang detok+build+serialize", "flatwire (B=1)", "ratio", "flatwire (B=32)",
         "ratio", "SGLang body", "flatwire body", "SGLang client", "flatwire client (json)", "ratio"],
        "flatwire = detokenize + accumulate + build + serialize per response. SGLang's nested row is the "
        "[logprob, id, text] triples; flatwire's is SGLang nested + text. SGLang measured on its own machine: "
        "ratios across machines are indicative; the ratios to the floor are from the same run.")
    floor = Table("The floor: the same top-k bytes, copied and base64-encoded (same run)",
                  ["tokens x k", "top-k bytes", "copy", "base64", "copy + base64", "base64 size"])
    bodies = Table("Body size against the bytes (targets)",
                   ["tokens x k", "format", "body", "fixed part (k=0 body)", "expected", "body / expected"],
                   "expected: flat base64 = 4/3 x 8 x tokens x k + its fixed part; gRPC raw = 8 x tokens x k + "
                   "its fixed part (token ids, token logprobs, text). The fixed part is the same response "
                   "rendered with k=0.")
    data = []
    for (tokens, k), shape in shapes.items():
        label = f"{tokens} x {k}"
        detok = {b: ms(timer, (tokens, k, b, "detokenize")) / b for b in BATCHES}
        accum = {b: ms(timer, (tokens, k, b, "accumulate")) / b for b in BATCHES}
        copy, b64 = ms(timer, (tokens, k, "floor", "copy")), ms(timer, (tokens, k, "floor", "base64"))
        floor_time = copy + b64
        topk_bytes = 8 * tokens * k
        floor.add(label, fmt_bytes(topk_bytes), fmt_time(copy), fmt_time(b64), fmt_time(floor_time),
                  fmt_bytes(len(base64.b64encode(bytes(4 * tokens * k))) * 2))
        for name in names:
            build, serialize = ms(timer, (tokens, k, name, "build")), ms(timer, (tokens, k, name, "serialize"))
            client_or = ms(timer, (tokens, k, name, "client orjson"))
            client_js = ms(timer, (tokens, k, name, "client json")) if name not in NO_CLIENT_JSON else None
            body = len(shape["bodies"][name])
            gateway = accum[1] + build + serialize
            main.add(label, name, f"{fmt_time(detok[1])} / {fmt_time(detok[32])}",
                     f"{fmt_time(accum[1])} / {fmt_time(accum[32])}", fmt_time(build), fmt_time(serialize),
                     fmt_time(gateway), fmt_bytes(body), fmt_time(client_js) if client_js else "n/a",
                     fmt_time(client_or), fmt_ratio((build + serialize) / floor_time))
            row = {"tokens": tokens, "k": k, "format": name, "detokenize_b1": detok[1], "detokenize_b32": detok[32],
                   "accumulate_b1": accum[1], "accumulate_b32": accum[32], "build": build, "serialize": serialize,
                   "gateway_cpu": gateway, "body_bytes": body, "fixed_bytes": shape["fixed"][name],
                   "client_json": client_js, "client_orjson": client_or, "floor": floor_time,
                   "build_serialize_k0": ms(timer, (tokens, k, name, "build+serialize at k=0"))
                   if name in TOPK_PART else None,
                   "floor_copy": copy, "floor_base64": b64}
            data.append(row)
            ref = SGLANG.get((tokens, k, SGLANG_ROW.get(name)))
            if ref:
                ref_total = sum(ref[:3]) * 1e-3
                ours1 = detok[1] + gateway
                ours32 = detok[32] + accum[32] + build + serialize
                sglang.add(label, SGLANG_ROW[name], fmt_time(ref_total), fmt_time(ours1), fmt_ratio(ref_total / ours1),
                           fmt_time(ours32), fmt_ratio(ref_total / ours32), f"{ref[3]:.2f} MB", fmt_bytes(body),
                           fmt_time(ref[4] * 1e-3), fmt_time(client_js), fmt_ratio(ref[4] * 1e-3 / client_js))
                row["sglang"] = {"detokenize": ref[0], "build": ref[1], "serialize": ref[2], "body_mb": ref[3],
                                 "client": ref[4]}
            if name in ("SGLang flat base64", "gRPC raw (GenerateResponsePacked)"):
                fixed = shape["fixed"][name]
                expected = (topk_bytes * 4 / 3 if "base64" in name else topk_bytes) + fixed
                bodies.add(label, name, fmt_bytes(body), fmt_bytes(fixed), fmt_bytes(int(expected)),
                           f"{body / expected:.4f}")
    tokens, k = STREAMED_SHAPE
    streamed = Table(f"A token per message (streaming) against {INTERVAL}-token entries (not streaming), "
                     f"{tokens} x {k}",
                     ["stage", "B=1 streamed", f"B=1 every {INTERVAL}", "ratio", "B=32 streamed",
                      f"B=32 every {INTERVAL}", "ratio"],
                     "Per response. streamed: the scheduler ships each token in its own message and the gateway "
                     "takes a chunk per message (a streaming request's generator); otherwise the request ships "
                     f"{INTERVAL} tokens per entry and its generator is woken once, at the end.")
    per_message = {}
    for stage in ("detokenize", "accumulate"):
        cells = []
        for b in BATCHES:
            each, coalesced = (ms(timer, (tokens, k, b, f"{stage} streamed")) / b,
                               ms(timer, (tokens, k, b, stage)) / b)
            cells += [fmt_time(each), fmt_time(coalesced), fmt_ratio(each / coalesced)]
            per_message[f"{stage}_b{b}"] = {"streamed": each, "coalesced": coalesced}
        streamed.add(stage, *cells)
    sweep = [{"tokens": tokens, "k": k, "format": name, "build_serialize": ms(timer, ("sweep", tokens, k, name)),
              "body_bytes": body, "floor": ms(timer, ("sweep", tokens, k, "floor"))}
             for (tokens, k, name), body in run_data["sweep"].items()]
    return [main, streamed, sglang, floor, bodies], {"rows": data, "sweep": sweep, "streamed": per_message}


def targets(rows: list[dict]) -> Table:
    """Issue 4's replay targets at 1000 x 128."""
    at = {r["format"]: r for r in rows if (r["tokens"], r["k"]) == (1000, 128)}
    b64, nested, raw = at["SGLang flat base64"], at["SGLang nested + text"], at["gRPC raw (GenerateResponsePacked)"]
    checks = Table("Targets (1000 x 128)", ["target", "measured", "verdict"])

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    bs = b64["build"] + b64["serialize"]
    checks.add("flat base64: gateway build+serialize within 3x of the floor",
               f"{fmt_time(bs)} vs floor {fmt_time(b64['floor'])}: {bs / b64['floor']:.1f}x",
               verdict(bs <= 3 * b64["floor"]))
    topk = bs - b64["build_serialize_k0"]
    checks.add("flat base64: the top-k fields' share of build+serialize (the response minus the same at k=0) "
               "within 3x of the floor",
               f"{fmt_time(topk)} vs floor {fmt_time(b64['floor'])}: {topk / b64['floor']:.1f}x; the k=0 rest "
               f"({fmt_time(b64['build_serialize_k0'])}) is output_token_logprobs, 1000 [logprob, id, null] rows",
               verdict(topk <= 3 * b64["floor"]))
    for label, key_detok, key_accum in (("B=1", "detokenize_b1", "accumulate_b1"),
                                        ("B=32", "detokenize_b32", "accumulate_b32")):
        total = b64[key_detok] + b64[key_accum] + bs
        checks.add(f"flat base64: detokenize+accumulate+build+serialize at least 10x below SGLang's 43.7 ms ({label})",
                   f"{fmt_time(total)}: {43.7e-3 / total:.1f}x below", verdict(total * 10 <= 43.7e-3))
    for label, key_detok, key_accum in (("B=1", "detokenize_b1", "accumulate_b1"),
                                        ("B=32", "detokenize_b32", "accumulate_b32")):
        total = nested[key_detok] + nested[key_accum] + nested["build"] + nested["serialize"]
        checks.add(f"nested + text: at least 10x below SGLang's 3754 ms ({label})",
                   f"{fmt_time(total)}: {3754e-3 / total:.0f}x below", verdict(total * 10 <= 3754e-3))
    for label, key in (("B=1", "accumulate_b1"), ("B=32", "accumulate_b32")):
        gateway = b64[key] + bs
        checks.add(f"flat base64 (issue 10): gateway CPU per response (accumulate + build + serialize) <= 2 ms "
                   f"({label})", fmt_time(gateway), verdict(gateway <= 2e-3))
    checks.add("flat base64 (issue 10): detokenizer CPU per response <= 3 ms (B=32)", fmt_time(b64["detokenize_b32"]),
               verdict(b64["detokenize_b32"] <= 3e-3))
    for row, what in ((b64, "4/3 x 8 x tokens x k + fixed fields"), (raw, "8 x tokens x k + fixed fields")):
        expected = 8 * 1000 * 128 * (4 / 3 if row is b64 else 1) + row["fixed_bytes"]
        checks.add(f"{row['format']} body within 1% of {what}",
                   f"{row['body_bytes']} B vs {int(expected)} B ({(row['body_bytes'] / expected - 1) * 100:+.2f}%); "
                   f"top-k part alone {row['body_bytes'] - row['fixed_bytes']} B",
                   verdict(abs(row["body_bytes"] / expected - 1) <= 0.01))
    return checks


def profile_target(stage: str, seconds: float) -> None:
    """Run one stage at 1000 x 128, B=32, for `seconds`: a target for a sampling profiler."""
    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = EngineClient(GatewayConfig(owner_id=OWNER), tokenizer)
    workload = scheduler_steps(paragraph_ids(tokenizer, 1000), 128, 32, len(tokenizer))
    received = detokenize(tokenizer, workload)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if stage == "detokenize":
            detokenize(tokenizer, workload)
        else:
            accumulate(engine, workload, received)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--profile", choices=("detokenize", "accumulate"),
                        help="only run this stage (1000 x 128, B=32) for --seconds, under a profiler")
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args(argv)
    if args.profile:
        return profile_target(args.profile, args.seconds)
    run_data = run(args.repeats)
    out, data = tables(run_data)
    out.append(targets(data["rows"]))
    command = "python -m bench.replay" + (f" --repeats {args.repeats}" if args.repeats != 5 else "")
    notes = (f"Requests ship {INTERVAL} tokens per entry (the scheduler's --output-interval for requests that do "
             f"not stream) and are taken whole when they end; the streamed table ships a token per message. Token "
             f"ids: an English + CJK paragraph, repeated, in the default model's Qwen3.5 vocabulary; top-k: random "
             f"sorted logprobs, uniform vocabulary ids. CPU time (process_time), medians of {args.repeats} "
             f"interleaved rounds.")
    print(write_results("replay", command, out, data, notes))


if __name__ == "__main__":
    main()
