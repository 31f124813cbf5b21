"""Streaming top-k: bytes on the wire and gateway CPU of a streamed response against the same response whole.

A synthetic scheduler (--engine synthetic, a step every --step-ms) and the real detokenizer
and gateway; one /generate request at a time, 1000 tokens x k=128, greedy and identical
each time, in each format (flat base64, flat JSON, nested): whole, streamed with SGLang's
cumulative fields (text, output_ids and the output lists so far in every event), and
streamed with --incremental-streaming-output (a second gateway: each event only what is
new). Per response: the bytes the client received (SSE framing included), the gateway's
CPU time (utime + stime from /proc over the repeats, divided), and the client's time to
turn the body into [tokens, k] arrays (streamed: each event's rows, concatenated).

    python -m bench.stream                   # writes bench/out/stream.{md,json}
"""

import argparse
import base64
import time

import httpx
import numpy as np
import orjson

from bench.common import OUT_DIR, Table, fmt_bytes, fmt_ratio, fmt_time, write_results
from bench.e2e import cpu_seconds
from harness.stack import running
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


def assemble(raw: bytes, fmt: str, mode: str) -> np.ndarray:
    if mode == "whole":
        return arrays(orjson.loads(raw)["meta_info"], fmt)
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    if fmt == "nested" and mode == "stream":  # SGLang's nested stream is cumulative: the last event has every row
        return arrays(events[-1]["meta_info"], fmt)
    key = "output_top_logprobs" if fmt == "nested" else "output_top_logprobs_shape"
    deltas = [arrays(e["meta_info"], fmt) for e in events if e["meta_info"].get(key)]
    return np.concatenate(deltas)


def measure(http: httpx.Client, gateway_pid: int, fmt: str, mode: str, args) -> dict:
    """`repeats` identical requests (one for SGLang's nested cumulative stream: gigabytes each)."""
    repeats = 1 if (fmt, mode) == ("nested", "stream") else args.repeats
    before = cpu_seconds(gateway_pid)
    for _ in range(repeats):
        with http.stream("POST", "/generate", json=body(fmt, args.tokens, args.k, mode != "whole")) as reply:
            raw = reply.read()
    cpu = (cpu_seconds(gateway_pid) - before) / repeats
    started = time.process_time()
    values = assemble(raw, fmt, mode)
    return {"format": fmt, "mode": mode, "bytes": len(raw), "gateway_cpu_s": cpu,
            "client_s": time.process_time() - started, "values": values}


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
    scheduler_args = ("--max-running-requests", "64", "--engine", "synthetic", "--step-ms", str(args.step_ms))
    for modes, gateway_args in ((("whole", "stream"), ()), (("incremental",), ("--incremental-streaming-output",))):
        with running(resolve_model(None), log_dir, scheduler_args=scheduler_args,
                     gateway_args=gateway_args) as stack:
            stack.wait_ready()
            stack.wait_warm()
            pid = stack.procs["gateway"].proc.pid
            with httpx.Client(base_url=stack.http_url, timeout=600) as http:
                for fmt in FORMATS:  # untimed: the gateway warms its renderers in the background at start
                    http.post("/generate", json=body(fmt, 50, args.k, False)).raise_for_status()
                time.sleep(2)
                rows += [measure(http, pid, fmt, mode, args) for fmt in FORMATS for mode in modes]
    for row in rows:
        whole = next(r for r in rows if r["format"] == row["format"] and r["mode"] == "whole")
        row["same_arrays"] = row["values"].tobytes() == whole["values"].tobytes()
    for row in rows:
        del row["values"]
    table = Table(f"A {args.tokens} x {args.k} response, streamed and whole",
                  ["format", "mode", "bytes", "vs whole", "gateway CPU", "vs whole", "client assemble", "same arrays"],
                  "One SSE event per token. stream: SGLang's cumulative text, output_ids and output lists in every "
                  "event (flat arrays: each event's rows only, with their offset; nested rows: every row so far); "
                  "incremental: --incremental-streaming-output, each event only what is new. gateway CPU: per "
                  f"request, over {args.repeats} (1 for nested stream); client: the body into a [tokens, k] array.")
    for fmt in FORMATS:
        whole = next(r for r in rows if r["format"] == fmt and r["mode"] == "whole")
        for r in (r for r in rows if r["format"] == fmt):
            table.add(fmt, r["mode"], fmt_bytes(r["bytes"]), fmt_ratio(r["bytes"] / whole["bytes"]),
                      fmt_time(r["gateway_cpu_s"]), fmt_ratio(r["gateway_cpu_s"] / whole["gateway_cpu_s"]),
                      fmt_time(r["client_s"]), "yes" if r["same_arrays"] else "NO")
    print(write_results("stream", "python -m bench.stream", [table], {"rows": rows},
                        f"Synthetic scheduler at {args.step_ms:g} ms per step; greedy, ignore_eos."))


if __name__ == "__main__":
    main()
