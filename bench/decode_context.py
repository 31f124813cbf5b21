"""Decode step time against context length, and the decode stall that chunked prefill removes.

- A decode step of B=1 and B=32 requests whose contexts hold 256 to 8192 tokens (the models' limit), each
  request placed as if its prompt were prefilled (InProcessSteps.place: its pages hold zeros, which cost the
  attention what real keys cost);
- a B=32 step of one request at 8192 tokens among 31 at 256, against those two apart: a long context costs its
  own attention, not every row's;
- the same B=32 step at 512 tokens of context under --context-length 1024 and 8192: what a step costs follows
  the tokens attended, not the longest context allowed;
- 8 requests decoding when a 4096-token prompt arrives: the longest step they wait through, with
  --chunked-prefill-size 512 and with chunking off (the whole prompt in one step).
On the default model and the mid-size one (bench/models.py), in process.

    python -m bench.decode_context        # writes bench/out/decode_context.md and .json
"""

import argparse
import statistics
import time
from collections.abc import Callable

from bench.common import Progress, Table, fmt_ratio, fmt_time, write_results
from bench.in_process import InProcessSteps, random_prompt
from bench.models import default_model, mid_model
from services.scheduler.model.runner import ModelRunner

CONTEXTS = (256, 1024, 2048, 4096, 8192)
BATCHES = (1, 32)
STEPS = 4  # timed decode steps per point (after one untimed)
STALL_DECODERS, STALL_PROMPT, CHUNK = 8, 4096, 512


def decode_step(runner: ModelRunner, contexts: list[int],
                prompt: Callable[[int, int], list[int]] = random_prompt) -> float:
    """The median seconds of a decode step of requests at these contexts (tokens each); `prompt(seed, length)`:
    their placed tokens."""
    engine = InProcessSteps(runner, len(contexts))
    for i, context in enumerate(contexts):
        # context - 1 tokens placed, then the decode steps add theirs
        engine.place(engine.request(f"d{i}", prompt(i, context - STEPS - 1), STEPS + 2))
    engine.step()
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def stall(runner: ModelRunner, chunk: int | None) -> dict:
    """Decoders running when a long prompt arrives: each step's seconds until the prompt's first token."""
    budget = chunk or STALL_PROMPT
    engine = InProcessSteps(runner, STALL_DECODERS + 1, prefill_budget=budget, chunked=chunk is not None)
    for i in range(STALL_DECODERS):
        engine.place(engine.request(f"d{i}", random_prompt(i, 256), 10_000))
    engine.step()
    long = engine.request("long", random_prompt(99, STALL_PROMPT), 1)
    engine.add([long])
    seconds = []
    while not long.output_ids:
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return {"longest_step": max(seconds), "steps": len(seconds), "until_first_token": sum(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    models = {"default": default_model(), "mid-size": mid_model()}
    progress = Progress(len(models) * (len(CONTEXTS) * len(BATCHES) + 5), "decode_context")
    data: dict = {}
    curve = Table("Decode step time against context length (median of 4 steps)",
                  ["model", "batch", *[f"{c} tokens" for c in CONTEXTS], f"{CONTEXTS[-1]} vs {CONTEXTS[0]}"], "")
    mixed = Table("A B=32 decode step: one request at 8192 tokens of context among 31 at 256",
                  ["model", "together", "B=1 at 8192 + B=31 at 256, apart", "ratio", "B=32 at 8192"], "")
    limit = Table("A B=32 decode step at 512 tokens of context, by --context-length",
                  ["model", "--context-length 1024", "--context-length 8192", "ratio"], "")
    stalls = Table(f"{STALL_DECODERS} requests decoding when a {STALL_PROMPT}-token prompt arrives",
                   ["model", "chunked prefill", "longest step the decoders wait", "steps to the prompt's first token",
                    "time to its first token"], "")
    for name, path in models.items():
        runner = ModelRunner(path, "cpu", "float32", 0, max(BATCHES),
                             max_total_tokens=max(BATCHES) * (CONTEXTS[-1] + 64))
        data[name] = {}
        for batch in BATCHES:
            times = []
            for context in CONTEXTS:
                times.append(decode_step(runner, [min(context, runner.max_context)] * batch))
                progress.step(f"{name}: B={batch} at {context}")
            data[name][f"B{batch}"] = dict(zip(CONTEXTS, times))
            curve.add(name, batch, *map(fmt_time, times), fmt_ratio(times[-1] / times[0]))
        long, short = CONTEXTS[-1], CONTEXTS[0]
        together = decode_step(runner, [long] + [short] * 31)
        apart = decode_step(runner, [long]) + decode_step(runner, [short] * 31)
        data[name]["mixed"] = {"together": together, "apart": apart}
        mixed.add(name, fmt_time(together), fmt_time(apart), fmt_ratio(together / apart),
                  fmt_time(data[name]["B32"][long]))
        progress.step(f"{name}: mixed")
        by_limit = []
        for context_length in (1024, 8192):
            limited = ModelRunner(path, "cpu", "float32", context_length, 32, max_total_tokens=32 * 1024)
            by_limit.append(decode_step(limited, [512] * 32))
            progress.step(f"{name}: --context-length {context_length}")
        data[name]["by_context_length"] = by_limit
        limit.add(name, *map(fmt_time, by_limit), fmt_ratio(by_limit[1] / by_limit[0]))
        for chunk in (CHUNK, None):
            got = data[name][f"stall_{chunk or 'off'}"] = stall(runner, chunk)
            progress.step(f"{name}: stall, chunk {chunk}")
            stalls.add(name, chunk or "off", fmt_time(got["longest_step"]), got["steps"],
                       fmt_time(got["until_first_token"]))
    checks = Table("Targets", ["target", "measured", "verdict"])
    for name in models:
        short, long = data[name]["by_context_length"]
        checks.add(f"{name}: a B=32 step follows the tokens attended, not --context-length",
                   f"{long / short:.2f}x at 8192 vs 1024", "met" if long / short <= 1.1 else "missed")
        mix = data[name]["mixed"]
        checks.add(f"{name}: one long context among short rows costs its own attention, not every row's",
                   f"{mix['together'] / mix['apart']:.2f}x the rows apart", "met" if mix["together"] <= 1.2 * mix[
                       "apart"] else "missed")
        on, off = data[name][f"stall_{CHUNK}"]["longest_step"], data[name]["stall_off"]["longest_step"]
        checks.add(f"{name}: chunked prefill shortens the decoders' longest step", f"{on * 1e3:.0f} ms vs "
                   f"{off * 1e3:.0f} ms unchunked", "met" if on < off else "missed")
    print(write_results("decode_context", "python -m bench.decode_context", [curve, mixed, limit, stalls, checks],
                        data))


if __name__ == "__main__":
    main()
