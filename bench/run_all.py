"""Run every benchmark and write BENCHMARKS.md with their tables, profiles and plots.

    python -m bench.run_all       # about 30 minutes on 2 cores; progress on stderr

Each benchmark runs as its own process (python -m bench.<name>, one after the other, so
none competes with another for the cores) and writes bench/out/<name>.md and .json;
then the per-step stages that miss their targets are sampled with py-spy, the plots
are drawn into bench/plots/, and BENCHMARKS.md is assembled from those files.
"""

import argparse
import itertools
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench import plots
from bench.common import OUT_DIR, Progress, machine_line

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ["hop", "replay", "step_codec", "e2e", "capacity", "stop_waste", "stream", "weights", "sampling_costs",
              "prefix", "kv_capacity", "kv_families", "kv_dtype", "family_decode", "hybrid", "decode_context",
              "tool_calls", "capacity_workers", "capacity_parsers", "capacity_bursts", "http_framework",
              "routed_experts", "lora", "tensor_parallel"]
PROFILED_STAGES = ["detokenize", "accumulate"]
COMMAND = "python -m bench.run_all"
GPU_RESULTS = ROOT / "bench" / "gpu" / "RESULTS.md"


def run_benchmark(name: str) -> bool:
    done = subprocess.run([sys.executable, "-m", f"bench.{name}"], cwd=ROOT, stdout=subprocess.DEVNULL)
    if done.returncode:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / f"{name}.md").write_text(f"## {name}\n\nFailed (exit {done.returncode}); see its stderr.\n")
    return done.returncode == 0


def profile(stage: str, seconds: int = 12) -> str:
    """py-spy samples of one replay stage: where its CPU goes, by own time and by caller."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return f"(py-spy is not installed: `pip install py-spy` to profile {stage})\n"
    raw = OUT_DIR / f"profile_{stage}.txt"
    subprocess.run([py_spy, "record", "--format", "raw", "--rate", "200", "--output", str(raw), "--",
                    sys.executable, "-m", "bench.replay", "--profile", stage, "--seconds", str(seconds)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    own, inclusive, total = Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [_short(frame) for frame in stack.split(";")]
        if f"{stage} (replay.py)" not in frames:  # start-up (imports, tokenizer load), not the stage
            continue
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    lines = [f"`py-spy record` of `python -m bench.replay --profile {stage}` (1000 x 128, B=32), "
             f"{total} samples inside the stage.", "",
             "| own time | function | | inclusive | function |", "|---|---|---|---|---|"]
    interesting = [(f, n) for f, n in inclusive.most_common() if _ours(f)][:12]
    for (f_own, n_own), (f_inc, n_inc) in zip(own.most_common(12), interesting):
        lines.append(f"| {n_own / total:.0%} | `{f_own}` | | {n_inc / total:.0%} | `{f_inc}` |")
    return "\n".join(lines) + "\n"


def _short(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func (file.py:12)' with the package folder kept for ours."""
    match = re.match(r"(.*) \((.*?):(\d+)\)$", frame)
    if not match:
        return frame
    func, path, _ = match.groups()  # by function: line numbers split one function's time
    parts = Path(path).parts
    keep = 3 if "services" in parts else 1
    return f"{func} ({'/'.join(parts[-keep:])})"


def _ours(frame: str) -> bool:
    return any(part in frame for part in ("services/", "transformers", "tokenizers", "numpy"))


def section(name: str) -> str:
    path = OUT_DIR / f"{name}.md"
    if not path.exists():
        return f"## {name}\n\n(not run)\n"
    return path.read_text()


def targets_summary() -> str:
    """Every benchmark's Targets table, gathered at the top."""
    rows = []
    for name in BENCHMARKS:
        path = OUT_DIR / f"{name}.md"
        if not path.exists():
            continue
        text = path.read_text()
        if "### Targets" not in text:
            continue
        lines = text.split("### Targets", 1)[1].splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("|"))  # past the table's note, if any
        table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
        rows += [f"| {name} " + row for row in table[2:]]
    return "\n".join(["| benchmark | target | measured | verdict |", "|---|---|---|---|", *rows]) + "\n"


ANALYSIS = """\
### Where targets are missed, and why

- **Per message, not per token.** A request that does not stream ships its tokens and rows 50 at a time
  (the scheduler's `--output-interval`, as SGLang ships non-streaming outputs), so a 1000-token response
  crosses the detokenizer and the gateway in 20 entries, and the gateway wakes its request once. The
  replay's streamed table puts the same response through a token per message: that is what a streaming
  client costs. What remains per entry is a fixed cost (the profiles below: the tokenizer's own
  `decode_batch` in the detokenizer, two batched calls per message; numpy slice copies into the request's
  buffers in the gateway), so the columns barely move from k=32 to k=128.
- **Capacity** (a synthetic scheduler at 10 ms steps, C concurrent clients, real detokenizer and gateway):
  non-streaming requests are delivered at the offered rate up to C=512 at k=128 flat base64; the same run
  with `--output-interval 1` (a message per token, everything else equal) shows what coalescing saves.
  Streaming delivery is per token and costs the gateway more (an SSE event per token, SGLang's cumulative
  `text` and `output_ids` in each); nested rows while streaming are re-sent whole in every event (SGLang's
  format), which is quadratic in the length: the streaming rows at k=128 nested show it. Flat formats
  stream each event's own rows (bench.stream: bytes and gateway CPU of a streamed response against the
  same response whole).
- **Bursts** (bench.capacity_bursts: 512 clients that submit together, as an RL rollout does, and again once
  every reply is in): 84-90% of the offer with the raw client, 73-81% with httpx, against 95-100% spread out;
  the targets (95%, 85%) are missed. The floor table beside them (bench.burst_floor: the same clients and rounds
  against a bare ASGI app on uvicorn that only waits the generation's 2.56 s and answers as many bytes) says how
  much of that is flatwire's: the bare app delivers 96-97% to the raw client and 74-80% to httpx (one run each
  in the table, two more in probes). So the httpx target is below what any server on Python's HTTP stack
  delivers to that client here (its reads cost 6-8 us a token, 1.5-2 ms a reply of 357 kB, all in the round's
  last few tenths of a second), and flatwire is within a point or two of that floor with httpx (73% against 74%
  in the table's run); with the raw client the target leaves flatwire's own work about 1.5% of a round, some 40
  ms for 512 requests (80 us a request for parsing, submitting, rendering and sending) where its gateway takes
  1-1.7 ms of CPU a request (6.6 us a token in the table). The gateway's garbage collector is part of it: about
  70 ms of collections a round, one of them a full collection of 30 ms (gc.callbacks, two runs); with the
  collector off, 85.6-87.6% against 84.7-85.4% on, inside the spread. A round is 2.56 s of steps plus what its
  two ends cost, and at 95% the ends get 0.13 s. Where a round goes (raw client, one gateway, scheduler stats
  every 2 ms and per-process CPU, 2026-12-05): the gateway parses the burst at about 0.3 ms of CPU a request, so
  every request runs 0.17-0.21 s into the round (the first 32 within 0.02-0.04 s: submits leave 32 at a time as
  they are parsed, `flatwire_wire/submit_batch.py`); requests finish in the order they started, from 2.57 s on;
  the last reply comes at 2.89-2.94 s. The end is the gateway sending 512 responses of 350 kB at 0.65-0.7 ms
  each, at a full core, while the client reads them on the other: about 0.35 s from the first finish, of which
  the finishes' own spread is 0.2 s. Of a response's gateway time in that window (cProfile, relative): its
  socket writes about a quarter, rendering about a third (half of it the per-token `output_token_logprobs` rows
  every SGLang response carries), orjson a tenth, the rest FastAPI/Starlette/uvicorn, the finish and the
  generation's teardown. With httpx the client's own reads cost 1.2 ms of CPU per response (4.7 us per token;
  the raw client 0.2 ms), 0.6 s a round on the same two cores. Two gateway processes: 90% raw, 78% httpx (one:
  89%, 79%, the same run). What the HTTP stack alone costs per request here (bench.http_framework): a bare ASGI
  app on uvicorn 33 us (129 us answering 350 kB), a Starlette route 59 us, a FastAPI route 113 us, the gateway's
  /health 176 us: about half of each end's 0.26 ms before flatwire's own work. A Starlette route for /generate
  instead of FastAPI's cut a one-token request's gateway CPU by about 0.07 ms but left the 256-token burst round
  where it was (2.878 s against 2.869 s, one run each), so it was not kept. What moved it, one run each unless
  said: a SubmitBatch per burst instead of a Submit each (the submits reached the scheduler in 0.21-0.26 s
  instead of 0.40-0.46 s); a whole-output request's first entry staggered by its rid (one 26 MB message every 50
  steps had held steps at 14.8 ms); the pending-output lanes (spread raw 75% -> 84-90%, burst raw 65% -> 77-79%
  on a host about 1.5x slower); a single generation read in the request's own task and labelled metrics that
  keep their children (burst raw 81% -> 84%, httpx 74% -> 78%); submits started as they are parsed, on a
  blocking channel, rather than after the whole burst (interleaved: raw 81-86% -> 86-88%, httpx 72-78% ->
  73-80%). The fixed cost per request, measured with bursts of one-token requests (interleaved, two runs each):
  a generation whose result came with its first chunk ended in the request's task rather than by a closing task
  (0.54-0.59 -> 0.47-0.48 ms of gateway CPU, rounds 0.30-0.33 -> 0.26-0.27 s), and one disconnect watcher per
  request instead of two (0.47-0.48 -> 0.44 ms); neither moves the 256-token rows beyond their spread (raw
  88-89% before and after). FastAPI's OpenTelemetry switched off measured nothing beyond the noise. The client
  shares the two cores: one httpx.AsyncClient shared by the 512 clients (httpx-pool) costs 45 to 60 us of client
  CPU per delivered token at k=128, because httpcore's pool scans every pooled connection on each request event
  (O(C) per request); an AsyncClient per client (httpx) costs 5 to 9, the minimal client under 1. An AsyncClient
  per client must share one TLS context: building its own costs about 56 ms of CPU each, which stalls the
  client's loop for seconds at C=512.
- **Streaming is a message per token until the gateway falls behind.** A streaming request is woken,
  rendered and sent once per token while the gateway keeps up: a few tenths of a ms of gateway CPU per event
  for a request streaming alone (bench.stream: a 1000-token response costs over 10x its whole rendering;
  this run's ratios are in the headlines above), far less per token when many requests share each message
  (the capacity table's streaming rows). Once the gateway is behind (a stream gets to its tokens more than 5
  ms late: its messages read late against the scheduler's stamp, or its event loop busy), each stream waits
  as long again, at most `--stream-coalesce-ms` (50), and its next event carries several steps' tokens: at
  C=512 k=0 that takes streaming from about a third of the offer to 87-91%, at k=128 flat base64 from about
  a quarter to 38-49%, and nested rows at C=128 from 26% to 99% (the capacity table and
  bench.capacity_workers are after it). Since 2026-12-05 the hops' per-entry work coalesces at the source
  too: steps that wait for a slow hop wait in the scheduler (the detokenizer's `--max-outbox-messages` 4,
  was 128), and while a subscriber has a message queued, output that ships every step holds up to
  `--stream-coalesce-tokens` (8) tokens per entry. The same host, C=512 k=128 flat base64 streaming (`python
  -m bench.capacity --concurrency 512 --k 128 --formats flat_b64 --modes stream`): 63-66% before, 77%, 83%,
  83%, 85%, 89% after (five runs); gateway 24.8-25.0 -> 20.1-23.0 us per token, detokenizer 10.1-10.6 ->
  6.9-7.1, scheduler 13.5-14.7 -> 8.8-11.7. k=0: 93% -> 97%, gateway 16.1 -> 15.3 us (later that day, with
  events that carry no logprobs skipping the logprob renderers: 96-98%, 14.8-15.8 us; k=128 80-88%,
  20.3-21.6 us; two runs at c15d79b: k=0 97-98%, 14.7 us; k=128 90%, 18.9-19.7 us). Holding 16 tokens
  instead of 8 gave 84-85% against 85-89% in the same interleaved runs. So "streamed CPU within 2x of whole"
  is missed for a stream alone; `--stream-interval N` (N tokens per event) divides the per-event part.
  Bytes: with `--incremental-streaming-output` a flat base64 stream is about 1.5x the whole body; the arrays
  are the same bytes, the rest is each event's own fields (about 540 bytes: shape, dtypes, offset, id,
  counts, its output_token_logprobs row). SGLang's cumulative default re-sends text, output_ids and the
  output lists in every event (about 11x for flat, hundreds of times for nested rows).
- **The gateway's parser and loop** (bench.capacity_parsers): on httptools and uvloop (the defaults since this
  table) instead of h11 and asyncio, one run each on this host, C=512 streaming: k=0 16.4 against 17.7 us of
  gateway CPU per token (97% and 96% of the offer), k=128 flat base64 21.1 against 23.8 us (82% and 72%). The
  burst pattern's admission, 512 submits at once, costs the gateway 0.65 against 0.82 ms per request
  (1-token requests, measured separately).
- **Flat base64 build + serialize vs the floor** includes `output_token_logprobs`, the per-token
  `[logprob, id, null]` rows every SGLang response carries whatever k is. The top-k fields' own share
  (the response minus the same response at k=0) is within 3x of the floor (replay targets).
- **End to end on this CPU** the scheduler's decode step (a 248k-row lm_head read per step) sets the
  pace, so end-to-end ratios mostly show the scheduler; the gateway and detokenizer CPU columns show
  the logprob path's own load (a few hundredths of a core for one request). k=128 flat and k=128
  nested do the same scheduler and detokenizer work (nested does more in the gateway), yet their single
  1000-token times differ by about as much as flat differs from k=0: that comparison sits within the
  run-to-run spread of a 36 s CPU-bound run on this shared machine. The top-k kernel's own cost at
  batch 1 is in the step_codec table (greedy vs greedy with top-128 logprobs).
- **An 8-bit KV cache's greedy output** (bench.kv_dtype) parts from the 16/32-bit cache's only at near-ties:
  the default model's weights are random, its next-token distribution nearly flat, and where its top two
  tokens lie closer than the 8-bit cache moves a logprob (0.02 for e4m3, 0.04 for e5m2 at most), greedy picks
  the other; every parting in the table is at such a margin (0.04 at the most, one exact bfloat16 tie). The
  logprob target (within 0.05) is met by every format and dtype.
- **The engine's house, before and after** (one KV manager with a memory spec per layer group, a public step, the
  sampler owning its state: 0ebe194 against 72bd7ce, back to back on this host, 2026-12-06, load 2-3.3 from the
  benchmarks alone). bench.prefix: the same prefill tokens in every row (n=8 samples 2160 of 16384, the session's
  last turn 80 of 928, two replicas' hits 82% against 74%), walls within 1-3% either way (default n=8 with the
  cache 594 -> 592 ms, mid-size 4.95 -> 5.01 s; mid-size session 16.4 -> 16.0 s). bench.kv_capacity: every number
  equal (4.1x and 3.8x, peaks 205 and 143). bench.decode_context, three runs each: B=1 equal; B=32 at 8192 tokens
  default 239/242/245 against 257/263/260 ms, mid-size 2.85/2.79/2.98 against 2.86/2.98/3.01 s; the 1024-2048
  columns move 30-60% between runs of the same code either way. A profile of the default model's B=32 step at
  8192 tokens (ten steps each, same host, minutes apart) gave 246 ms before and 236 ms after with the same
  split (page gather 53%, SDPA 27%): the step itself did not change. Capacity, C=512 streaming (`python -m
  bench.capacity --concurrency 512 --formats flat_b64 --modes stream`): k=0 98% against 97% of the offer,
  k=128 flat base64 86% against 85%; the synthetic scheduler's CPU per token rose from 5.6 to 7.4 us (k=0) and
  8.9 to 10.3 us (k=128): per decode row and step the KV manager did page arithmetic for every row. A row
  whose pages already reach its next token now returns at once (72bd7ce): the 512-row synthetic step in process
  went from 1.66 to 1.13 ms (the same loop before the issue: 0.39 ms, which kept no per-row output entries);
  the capacity run after it is not repeated here on a quiet host.
- **DeepSeek V3 at B=8** (bench.family_decode): before ec5e5f9 the engine's step took 3.4x transformers' (295
  against 87 ms, a busy host) while every other family was within 0.9-1.1x. The cause: MLA attended with values
  narrower than its keys (the latent without its rope columns), and torch's CPU scaled_dot_product_attention
  takes a path some 20x slower when the widths differ (the step's shapes alone, same load: 438 against 23 ms).
  MLA now attends with values as wide as the keys and drops the rope columns after (the same numbers; its tests
  unchanged). Rerun on a quiet host (load 1.5, 2026-12-06): 42.7 against 112.7 ms at B=8 (0.4x) and 18.0 against
  25.2 ms at B=1 (0.7x): the latent cache attends over [c, k_r] where transformers decompresses every head's
  keys and values. gpt-oss's B=8 transformers figure is its own MoE at B=8 (dense over the experts), not noise.
- **LoRA, the mixed step** (bench.lora): the earlier run missed the 1.5x target on two threads (1.65x) on a host
  whose load average was 1.4-5.4, where each of the adapters' small ops waited for the second thread. On a quiet
  host (2026-12-06) a B=32 decode step over 4 adapters and the base model is 1.05x the base model's on two threads
  (207 against 197 ms) and 1.02x on one; a prefill step 1.16x and 1.15x: every target met.
- **Tensor parallelism on two CPU cores** (bench.tensor_parallel, gloo, one torch thread per rank, quiet host):
  the mid-size model's 512-token prefill takes 0.74x TP=1's (564 against 763 ms); its B=32 decode step 1.06x
  (382 against 362 ms): most of that step is the LM head over a 248k vocabulary, which runs whole on rank 0
  (not vocabulary-parallel), and the 24 all-reduces a step over gloo cost 54 ms on rank 0 (waiting included).
  Telling rank 1 a step's rows costs 1.8 ms, 0.5% of the decode step (target: under 5%); each rank keeps half
  the KV bytes a token (12288 against 24576); greedy tokens identical. NCCL on GPUs has not run here.
"""


def headlines() -> str:
    """The headline ratios, computed from the benchmarks' JSON."""
    lines = ["### Headline ratios", ""]
    replay = _results("replay")
    if replay:
        at = {r["format"]: r for r in replay["rows"] if (r["tokens"], r["k"]) == (1000, 128)}
        nested, b64, raw = at["SGLang nested + text"], at["SGLang flat base64"], at["gRPC raw (GenerateResponsePacked)"]

        def total(row: dict, b: int) -> float:
            return row[f"detokenize_b{b}"] + row[f"accumulate_b{b}"] + row["build"] + row["serialize"]

        lines += [
            f"- 1000 x 128, nested + text vs flat base64 in the same run: build + serialize "
            f"{(nested['build'] + nested['serialize']) / (b64['build'] + b64['serialize']):.0f}x, body "
            f"{nested['body_bytes'] / b64['body_bytes']:.1f}x, client parse (json) "
            f"{nested['client_json'] / b64['client_json']:.0f}x.",
            f"- Flat base64 build + serialize: {(b64['build'] + b64['serialize']) / b64['floor']:.1f}x the floor "
            f"(copy + base64 of the same bytes); its top-k fields alone "
            f"{(b64['build'] + b64['serialize'] - b64['build_serialize_k0']) / b64['floor']:.1f}x. "
            f"gRPC raw: {(raw['build'] + raw['serialize']) / b64['floor']:.1f}x.",
            f"- vs SGLang's table (its machine): nested + text {3754.0e-3 / total(nested, 1):.1f}x faster at B=1, "
            f"{3754.0e-3 / total(nested, 32):.0f}x at B=32; flat base64 {43.7e-3 / total(b64, 1):.2f}x at B=1, "
            f"{43.7e-3 / total(b64, 32):.2f}x at B=32 (detokenize + accumulate + build + serialize).",
            f"- Bodies: flat base64 {b64['body_bytes'] / (8 * 1000 * 128 * 4 / 3 + b64['fixed_bytes']):.4f} of "
            f"4/3 x 8 x tokens x k + fixed fields; gRPC raw "
            f"{raw['body_bytes'] / (8 * 1000 * 128 + raw['fixed_bytes']):.4f} of 8 x tokens x k + fixed fields.",
        ]
    e2e = _results("e2e")
    if e2e:
        for row in e2e["rows"]:
            if row["mode"] != "k=0" and (row["tokens"] == 1000 or row["concurrency"] > 1):
                lines.append(f"- End to end, {row['part']}: {row['mode']} {row['vs_k0']:.2f}x the k=0 time "
                             f"({row['median_s']:.1f} s); gateway busiest second {row['peak_cores']['gateway']:.2f} "
                             f"cores.")
    capacity = _results("capacity")
    if capacity:
        rows = {(r["concurrency"], r["k"], r["format"], r["mode"], r.get("interval", 50)): r
                for r in capacity["rows"]}
        for interval in (50, 1):
            row = rows.get((512, 128, "flat_b64", "nonstream", interval))
            if row:
                us = row["us_per_token"]
                lines.append(f"- Capacity, C=512 k=128 flat base64, a message per {interval} tokens: "
                             f"{row['delivered_tok_s']:,.0f} of {row['offered_tok_s']:,.0f} tokens/s offered; CPU per "
                             f"token: detokenizer {us['detokenizer']:.1f} us, gateway {us['gateway']:.1f} us.")
    stream = _results("stream")
    if stream:
        rows = {(r["format"], r["mode"]): r for r in stream["rows"]}
        for fmt in ("flat base64", "nested"):
            for mode in ("stream", "incremental"):
                whole, streamed = rows.get((fmt, "whole")), rows.get((fmt, mode))
                if whole and streamed:
                    lines.append(f"- A 1000 x 128 {fmt} response streamed a token per event ({mode}) against the "
                                 f"same whole: bytes {streamed['bytes'] / whole['bytes']:.2f}x, gateway CPU "
                                 f"{streamed['gateway_cpu_s'] / whole['gateway_cpu_s']:.1f}x.")
    stop_waste = _results("stop_waste")
    if stop_waste:
        for row in stop_waste["rows"]:
            lines.append(f"- Stop strings at {row['step_ms']:g} ms steps: {row['wasted_mean']:.1f} tokens generated "
                         f"past the match on average (max {row['wasted_max']}).")
    weights = _results("weights")
    if weights:
        rows = {row["operation"]: row for row in weights["rows"]}
        disk, paused = rows["update_weights_from_disk"], rows["pause(in_place) + update_weights_from_disk + continue"]
        lines.append(f"- Weight update of the default model ({weights['model_bytes'] / 1e6:.0f} MB) from disk: "
                     f"{disk['seconds']:.2f} s; paused in place around it, streaming requests stop for "
                     f"{paused['max_gap']:.2f} s at most.")
    hop = _results("hop")
    if hop:
        target = next(h for h in hop["hops"] if h["shape"] == {"requests": 32, "k": 128, "rows": 1, "prompt": False})
        lines.append(f"- Hop, B=32 k=128 step: {target['hop'] * 1e6:.0f} us encode + transport + decode; nested "
                     f"pickle of the same step {target['nested_total'] / target['flat_serialize']:.1f}x flat "
                     f"encode + decode.")
    return "\n".join(lines) + "\n"


def _results(name: str) -> dict | None:
    path = OUT_DIR / f"{name}.json"
    return json.loads(path.read_text())["results"] if path.exists() else None


def gpu_section() -> str:
    """bench/gpu's device run (it cannot run here): its committed results, with their date and device."""
    if GPU_RESULTS.exists():
        return GPU_RESULTS.read_text()
    return ("## gpu\n\nNot run yet: no GPU has been lent to this project. `bash bench/gpu/device.sh` is the prepared "
            "device run (bench/gpu/__init__.py); its results go to bench/gpu/RESULTS.md with the date and the device. "
            "`python -m bench.gpu --smoke` runs every part on the CPU with tiny shapes (tests/repo/test_bench_gpu.py); "
            "its figures mean nothing.\n")


def assemble(profiles: dict[str, str]) -> str:
    images = "\n".join(f"![{p.stem}](bench/plots/{p.name})" for p in sorted(plots.PLOTS_DIR.glob("*.png")))
    parts = [
        "# Benchmarks",
        "",
        f"Made by `{COMMAND}` (about 30 minutes here; `--skip NAME...` reuses earlier results). "
        f"Machine: {machine_line()}. "
        "The machine is shared with other work: each table carries the load average when it finished; "
        "timings are medians of interleaved repeats, and the targets are judged on ratios from the same run.",
        "",
        "## Targets",
        "",
        targets_summary(),
        headlines(),
        ANALYSIS,
        "## Plots",
        "",
        "Gateway build + serialize (CPU) and body size per client format, from the replay's sweep; the dashed "
        "line is the floor (copy + base64 of the same top-k bytes).",
        "",
        images,
        "",
    ]
    parts += [section(name) for name in BENCHMARKS]
    parts += [gpu_section()]
    parts += ["## Profiles of the per-step stages", ""]
    for stage, text in profiles.items():
        parts += [f"### {stage}", "", text]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", nargs="*", default=[], choices=BENCHMARKS,
                        help="reuse bench/out/<name>.md from an earlier run instead of running these")
    args = parser.parse_args(argv)
    todo = [name for name in BENCHMARKS if name not in args.skip]
    progress = Progress(len(todo) + len(PROFILED_STAGES) + 2, "run_all")
    for name in todo:
        progress.step(f"bench.{name} {'done' if run_benchmark(name) else 'FAILED'}")
    profiles = {}
    for stage in PROFILED_STAGES:
        profiles[stage] = profile(stage)
        progress.step(f"profiled {stage}")
    plots.main()
    progress.step("plots drawn")
    (ROOT / "BENCHMARKS.md").write_text(assemble(profiles))
    progress.step("BENCHMARKS.md written")


if __name__ == "__main__":
    main()
