"""Render benchmark: the gateway's response renderers alone, per client format.

A finished request's arrays (random logprobs, ids drawn from the real Qwen3.5
vocabulary of the default model) rendered in each format: build (the renderer),
serialize (orjson), body size, and client parse (orjson.loads, plus base64 decode to
numpy for the b64 format). Beside them, in the same run, the floor: copying the same
float32/int32 bytes and base64-encoding them. Issue 4's targets: flat base64 build +
serialize within 3x of the floor; nested triples with text under 375 ms (SGLang: 3754).

    python -m bench.replay_render      # writes bench/out/replay_render.{md,json}
"""

import argparse
import time
from collections.abc import Callable

import numpy as np
import orjson
import pybase64

from bench.common import Progress, Table, fmt_bytes, fmt_ratio, fmt_time, measure, write_results
from services.common.arrays import F32, I32
from services.common.model_store import resolve_model
from services.gateway.render import LogprobFormat, chat_logprobs, completion_logprobs, dumps, logprob_meta_info
from services.gateway.result import LogprobTrack, RequestResult
from services.gateway.token_table import TokenTable

SHAPES = [(160, 128), (1000, 32), (1000, 128)]


def synthetic_result(tokens: int, k: int, vocab: int, seed: int = 0) -> RequestResult:
    """A finished request with `tokens` output positions and top-k candidates per position."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, k)).astype(F32) * 3
    values = -np.sort(np.abs(logits), axis=1)  # best first, as the scheduler sends them
    ids = rng.integers(0, vocab, (tokens, k), dtype=I32)
    output = LogprobTrack(
        token_ids=ids[:, 0].copy(),
        token_logprobs=values[:, 0].copy(),
        topk_values=values,
        topk_ids=ids,
        ids_logprobs=np.zeros((tokens, 0), F32),
    )
    return RequestResult(rid="bench", prompt_tokens=8, output_ids=output.token_ids.tolist(), text="",
                         finish_reason="length", output=output)


def formats(result: RequestResult, table: TokenTable) -> dict[str, Callable[[], dict]]:
    """Each client format: a function building the response's logprob part."""
    def meta(**flags) -> Callable[[], dict]:
        return lambda: {"meta_info": logprob_meta_info(result, LogprobFormat(**flags), table)}

    flat = dict(return_flat_raw_output_top_logprobs=True)
    return {
        "SGLang nested triples + text": meta(return_text_in_logprobs=True),
        "SGLang nested triples": meta(),
        "SGLang flat JSON": meta(**flat),
        "SGLang flat base64": meta(**flat, return_flat_raw_top_logprobs_b64=True),
        "OpenAI chat logprobs": lambda: {"logprobs": chat_logprobs(result.output, table)},
        "OpenAI chat + flat base64 meta_info": lambda: {
            "logprobs": chat_logprobs(result.output, table, candidates=False),
            **meta(**flat, return_flat_raw_top_logprobs_b64=True)(),
        },
        "OpenAI completions logprobs": lambda: {"logprobs": completion_logprobs([result.output], table)},
    }


def client_parse(body: bytes) -> None:
    meta = orjson.loads(body).get("meta_info", {})
    for key in ("output_top_logprobs_val_flat_b64", "output_top_logprobs_idx_flat_b64"):
        if key in meta:
            np.frombuffer(pybase64.b64decode(meta[key]), dtype=F32 if "val" in key else I32)


def floor(result: RequestResult) -> Callable[[], bytes]:
    track = result.output

    def copy_and_encode() -> bytes:
        return pybase64.b64encode(track.topk_values.tobytes()) + pybase64.b64encode(track.topk_ids.tobytes())

    return copy_and_encode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    table = TokenTable.from_model_dir(resolve_model(None))
    loaded = time.perf_counter()
    for fn in formats(synthetic_result(1, 1, table.size), table).values():
        dumps(fn())  # builds the table and every per-id piece table once
    built = time.perf_counter()
    notes = (f"Tokenizer load {loaded - started:.2f} s; token table and per-id JSON pieces for "
             f"{table.size} ids built once in {built - loaded:.2f} s (lazily, on first use). "
             f"Medians of {args.repeats} runs; random logprobs, uniformly drawn vocabulary ids.")

    columns = ["tokens x k", "format", "build", "serialize", "build+serialize", "vs floor", "body", "client parse"]
    out = Table("Response rendering per format", columns)
    data = []
    names = list(formats(synthetic_result(1, 1, table.size), table))
    progress = Progress(len(SHAPES) * (len(names) + 1), "replay_render")
    for tokens, k in SHAPES:
        result = synthetic_result(tokens, k, table.size)
        floor_time = measure(floor(result), args.repeats)
        floor_size = len(floor(result)())
        out.add(f"{tokens} x {k}", "floor: copy + base64 of the bytes", "", "", fmt_time(floor_time.median),
                "1.0x", fmt_bytes(floor_size), "")
        progress.step(f"{tokens}x{k} floor")
        for name, build in formats(result, table).items():
            response = build()
            body = dumps(response)
            build_time = measure(build, args.repeats)
            serialize_time = measure(lambda: dumps(response), args.repeats)
            parse_time = measure(lambda: client_parse(body), args.repeats)
            total = build_time.median + serialize_time.median
            out.add(f"{tokens} x {k}", name, fmt_time(build_time.median), fmt_time(serialize_time.median),
                    fmt_time(total), fmt_ratio(total / floor_time.median), fmt_bytes(len(body)),
                    fmt_time(parse_time.median))
            data.append({"tokens": tokens, "k": k, "format": name, "build": build_time, "serialize": serialize_time,
                         "floor": floor_time, "body_bytes": len(body), "client_parse": parse_time})
            progress.step(f"{tokens}x{k} {name}")
    print(write_results("replay_render", "python -m bench.replay_render", [out], {"rows": data}, notes))


if __name__ == "__main__":
    main()
