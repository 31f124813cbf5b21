"""Streaming top-k: bytes on the wire and gateway CPU of a streamed response against the same response whole.

A synthetic scheduler (--engine synthetic, a step every --step-ms) and the real detokenizer
and gateway; one /generate request at a time, 1000 tokens x k=128, greedy and identical
each time, in each format (flat base64, flat JSON, nested) streamed and not. Per response:
the bytes the client received (SSE framing included), the gateway's CPU time (utime + stime
from /proc around the request), and the client's time to turn the body into [tokens, k]
arrays (streamed: decoding each event's delta rows and concatenating them).

    python -m bench.stream                   # writes bench/out/stream.{md,json}
"""

import argparse
import base64
import statistics
import time

import httpx
import numpy as np
import orjson

from bench.common import OUT_DIR, Table, fmt_bytes, fmt_ratio, fmt_time, write_results
from bench.e2e import cpu_seconds
from bench.faults import running
from services.common.model_store import resolve_model

FORMATS = {
    "flat base64": {"return_flat_raw_output_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True},
    "flat JSON": {"return_flat_raw_output_top_logprobs": True},
    "nested": {},
}


def body(fmt: str, tokens: int, k: int, stream: bool) -> dict:
    return {"input_ids": list(range(1000, 1016)), "stream": stream, "return_logprob": True, "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}, **FORMATS[fmt]}


def arrays(meta: dict, fmt: str) -> np.ndarray:
    """The output top-k values of one (whole or event) meta_info as a [rows, k] array."""
    if fmt == "flat base64":
        values = np.frombuffer(base64.b64decode(meta["output_top_logprobs_val_flat_b64"]), "<f4")
    elif fmt == "flat JSON":
        values = np.array(meta["output_top_logprobs_val_flat"], dtype=np.float32)
    else:
        return np.array([[entry[0] for entry in row] for row in meta["output_top_logprobs"]], dtype=np.float32)
    return values.reshape(meta["output_top_logprobs_shape"])


def assemble(raw: bytes, fmt: str, stream: bool) -> np.ndarray:
    if not stream:
        return arrays(orjson.loads(raw)["meta_info"], fmt)
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    if fmt == "nested":  # SGLang's nested stream is cumulative: the last event has every row
        return arrays(events[-1]["meta_info"], fmt)
    deltas = [arrays(e["meta_info"], fmt) for e in events if "output_top_logprobs_shape" in e["meta_info"]]
    return np.concatenate(deltas)


def one(http: httpx.Client, gateway_pid: int, fmt: str, stream: bool, tokens: int, k: int) -> tuple[bytes, float]:
    before = cpu_seconds(gateway_pid)
    with http.stream("POST", "/generate", json=body(fmt, tokens, k, stream)) as reply:
        raw = reply.read()
    return raw, cpu_seconds(gateway_pid) - before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    log_dir = OUT_DIR / "stream-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with running(resolve_model(None), log_dir, scheduler_args=("--engine", "synthetic", "--step-ms",
                                                               str(args.step_ms))) as pipeline:
        pipeline.wait_ready()
        pid = pipeline.procs["gateway"].proc.pid
        with httpx.Client(base_url=pipeline.http_url, timeout=300) as http:
            for fmt in FORMATS:
                whole = None
                for stream in (False, True):
                    runs = [one(http, pid, fmt, stream, args.tokens, args.k) for _ in range(args.repeats)]
                    raw = runs[0][0]
                    started = time.process_time()
                    values = assemble(raw, fmt, stream)
                    client = time.process_time() - started
                    if whole is None:
                        whole = values
                    rows.append({"format": fmt, "stream": stream, "bytes": len(raw),
                                 "gateway_cpu_s": statistics.median(cpu for _, cpu in runs), "client_s": client,
                                 "same_arrays": values.tobytes() == whole.tobytes()})
    table = Table(f"A {args.tokens} x {args.k} response, streamed and whole",
                  ["format", "mode", "bytes", "vs whole", "gateway CPU", "vs whole", "client assemble", "same arrays"],
                  "Streamed: one SSE event per token. Flat formats stream each event's rows only (with their offset); "
                  "SGLang's nested format re-sends every row so far in every event. gateway CPU: median of "
                  f"{args.repeats} requests; client: turning the body into a [tokens, k] array once.")
    for fmt in FORMATS:
        whole, streamed = (next(r for r in rows if r["format"] == fmt and r["stream"] is s) for s in (False, True))
        for r in (whole, streamed):
            table.add(fmt, "stream" if r["stream"] else "whole", fmt_bytes(r["bytes"]),
                      fmt_ratio(r["bytes"] / whole["bytes"]), fmt_time(r["gateway_cpu_s"]),
                      fmt_ratio(r["gateway_cpu_s"] / whole["gateway_cpu_s"]), fmt_time(r["client_s"]),
                      "yes" if r["same_arrays"] else "NO")
    print(write_results("stream", "python -m bench.stream", [table], {"rows": rows},
                        f"Synthetic scheduler at {args.step_ms:g} ms per step; greedy, ignore_eos."))


if __name__ == "__main__":
    main()
