"""Tensor parallelism on the CPU (gloo): the mid-size model (bench/models.py) on one rank and cut over two
(--tp-size 2), in process (rank 0 here, rank 1 spawned as the scheduler spawns it).

- greedy tokens of the same requests from both;
- a B=32 decode step at 256 tokens of context, and a 512-token prefill, each process on one torch thread (two
  cores: one per rank);
- what TP adds on rank 0 per step: telling the other rank the step's rows (the broadcast over the step channel)
  and the all-reduces (two per layer; the time in them includes waiting for the slower rank);
- KV bytes a token, per rank.
The LM head (a 248k vocabulary) runs on rank 0 alone, whole: on this model it is most of a decode step's work.
On a GPU the all-reduces are NCCL's; the device run (bench/gpu) has not measured TP.

    python -m bench.tensor_parallel      # writes bench/out/tensor_parallel.md and .json
"""

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench.common import Progress, Table, fmt_ratio, fmt_time, write_results
from bench.decode_context import STEPS, decode_step
from bench.in_process import InProcessSteps, random_prompt
from bench.models import mid_model
from services.scheduler.model.runner import ModelRunner
from services.scheduler.parallel.ranks import Ranks

BATCH, CONTEXT, PREFILL = 32, 256, 512
GREEDY_TOKENS = 16


class Timed:
    """Seconds spent in a function, and its calls, from when it is wrapped."""

    def __init__(self, function: Callable):
        self.function, self.seconds, self.calls = function, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def prefill_step(runner: ModelRunner) -> float:
    seconds = []
    for seed in range(3):
        engine = InProcessSteps(runner, 1)
        engine.add([engine.request("p", random_prompt(100 + seed, PREFILL), 1)])
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def greedy(runner: ModelRunner) -> list[list[int]]:
    engine = InProcessSteps(runner, 4)
    requests = [engine.request(f"g{i}", random_prompt(200 + i, 24 + 17 * i), GREEDY_TOKENS) for i in range(4)]
    engine.add(requests)
    engine.run()
    return [list(request.output_ids) for request in requests]


def measure(runner: ModelRunner) -> dict:
    return {"decode": decode_step(runner, [CONTEXT] * BATCH), "prefill": prefill_step(runner), "greedy": greedy(runner),
            "kv_token_bytes": runner.kv_token_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned rank's threads, as this process's below
    torch.set_num_threads(1)
    model = mid_model()
    arguments = dict(model_dir=model, device="cpu", dtype="float32", context_length=0, max_running=BATCH,
                     max_total_tokens=BATCH * (CONTEXT + 64) + PREFILL + 64)
    progress = Progress(2, "tensor_parallel")
    one = measure(ModelRunner(**arguments))
    progress.step("TP=1")
    ranks = Ranks.start(2, arguments, "warning", 60)
    runner = ModelRunner(**arguments, ranks=ranks.group)
    tell = Timed(ranks.group.tell)
    ranks.group.tell = tell  # type: ignore[method-assign]
    reduce = Timed(dist.all_reduce)
    dist.all_reduce = reduce  # type: ignore[assignment]  # the layers' hooks look it up per call
    two = measure(runner)
    progress.step("TP=2")
    # The broadcast and all-reduce time of every step measured (decode, prefill, greedy), per step.
    tell_per_step, reduce_per_step = tell.seconds / tell.calls, reduce.seconds / tell.calls
    reduces_per_step = reduce.calls / tell.calls
    ranks.stop()

    decode_one, decode_two = one["decode"], two["decode"]
    steps = Table("The mid-size model, one torch thread per rank: TP=1 against TP=2 (gloo)",
                  ["", "TP=1", "TP=2", "TP=2 vs TP=1"],
                  f"Median of {STEPS} decode steps; median of 3 prefills.")
    steps.rows.append([f"B={BATCH} decode step at {CONTEXT} tokens", fmt_time(decode_one), fmt_time(decode_two),
                       fmt_ratio(decode_two / decode_one)])
    steps.rows.append([f"{PREFILL}-token prefill", fmt_time(one["prefill"]), fmt_time(two["prefill"]),
                       fmt_ratio(two["prefill"] / one["prefill"])])
    steps.rows.append(["KV bytes a token, per rank", str(one["kv_token_bytes"]), str(two["kv_token_bytes"]),
                       fmt_ratio(two["kv_token_bytes"] / one["kv_token_bytes"])])
    steps.rows.append([f"greedy tokens of 4 requests x {GREEDY_TOKENS}", "", "",
                       "identical" if one["greedy"] == two["greedy"] else "DIFFERENT"])
    overhead = Table("What TP adds on rank 0, per step (every step measured)",
                     ["", "per step", f"share of a TP=2 B={BATCH} decode step"], "")
    overhead.rows.append(["telling rank 1 the step's rows (broadcast)", fmt_time(tell_per_step),
                          f"{100 * tell_per_step / decode_two:.1f}%"])
    overhead.rows.append([f"all-reduces ({reduces_per_step:.0f} a step, waiting included)", fmt_time(reduce_per_step),
                          f"{100 * reduce_per_step / decode_two:.1f}%"])
    data = {"tp1": one, "tp2": two, "tell_per_step_s": tell_per_step, "all_reduce_per_step_s": reduce_per_step}
    print(write_results("tensor_parallel", "python -m bench.tensor_parallel", [steps, overhead], data))


if __name__ == "__main__":
    main()
