"""Tensor parallelism: a model on one rank and cut over N (--tp-size N), in process (rank 0 here, the others
spawned as the scheduler spawns them). By default on the CPU (gloo), the mid-size model (bench/models.py) over
two ranks, each process on one torch thread (two cores: one per rank); on a host with N GPUs, a shape of
bench/gpu's with random weights (--load-format dummy) in bfloat16 over NCCL.

- greedy tokens of the same requests from both;
- a B=32 decode step at 256 tokens of context, and a 512-token prefill;
- what TP adds on rank 0 per step: telling the other ranks the step's rows (the broadcast over the step channel)
  and, on the CPU, the all-reduces (two per layer; the time in them includes waiting for the slower rank; on CUDA
  they are queued, not waited for, so not timed apart);
- KV bytes a token, per rank.
The LM head (a 248k vocabulary) runs on rank 0 alone, whole: on the mid-size model it is most of a decode step.

    python -m bench.tensor_parallel                                    # the CPU: bench/out/tensor_parallel.md
    python -m bench.tensor_parallel --device cuda --tp 8 --shape qwen3-8b   # N GPUs (never run here: one GPU at most)
"""

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import Progress, Table, fmt_ratio, fmt_time, write_results
from bench.decode_context import STEPS, decode_step
from bench.gpu.__main__ import SHAPES, shape_dir
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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tp", type=int, default=2, help="ranks (GPUs on CUDA)")
    parser.add_argument("--shape", default="mid", choices=["mid", *sorted(SHAPES)],
                        help="mid: bench/models.py's mid-size model; else bench/gpu's shape, random weights")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    if cpu:
        os.environ["OMP_NUM_THREADS"] = "1"  # the spawned ranks' threads, as this process's below
        torch.set_num_threads(1)
    scratch = tempfile.TemporaryDirectory()
    model = mid_model() if args.shape == "mid" else shape_dir(args.shape, Path(scratch.name))
    arguments = dict(model_dir=model, device=args.device, dtype="float32" if cpu else "bfloat16", context_length=0,
                     max_running=BATCH, max_total_tokens=BATCH * (CONTEXT + 64) + PREFILL + 64,
                     load_format="auto" if args.shape == "mid" else "dummy")
    progress = Progress(2, "tensor_parallel")
    single = ModelRunner(**arguments)
    one = measure(single)
    del single
    gc.collect()
    progress.step("TP=1")
    ranks = Ranks.start(args.tp, arguments, "warning", 60)
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

    scratch.cleanup()
    decode_one, decode_two = one["decode"], two["decode"]
    where = "one torch thread per rank, gloo" if cpu else f"{torch.cuda.get_device_name()}, bfloat16, NCCL"
    tp = f"TP={args.tp}"
    steps = Table(f"{'The mid-size model' if args.shape == 'mid' else args.shape} ({where}): TP=1 against {tp}",
                  ["", "TP=1", tp, f"{tp} vs TP=1"], f"Median of {STEPS} decode steps; median of 3 prefills.")
    steps.rows.append([f"B={BATCH} decode step at {CONTEXT} tokens", fmt_time(decode_one), fmt_time(decode_two),
                       fmt_ratio(decode_two / decode_one)])
    steps.rows.append([f"{PREFILL}-token prefill", fmt_time(one["prefill"]), fmt_time(two["prefill"]),
                       fmt_ratio(two["prefill"] / one["prefill"])])
    steps.rows.append(["KV bytes a token, per rank", str(one["kv_token_bytes"]), str(two["kv_token_bytes"]),
                       fmt_ratio(two["kv_token_bytes"] / one["kv_token_bytes"])])
    steps.rows.append([f"greedy tokens of 4 requests x {GREEDY_TOKENS}", "", "",
                       "identical" if one["greedy"] == two["greedy"] else "DIFFERENT"])
    overhead = Table("What TP adds on rank 0, per step (every step measured)",
                     ["", "per step", f"share of a {tp} B={BATCH} decode step"], "")
    overhead.rows.append(["telling the other ranks the step's rows (broadcast)", fmt_time(tell_per_step),
                          f"{100 * tell_per_step / decode_two:.1f}%"])
    if cpu:
        overhead.rows.append([f"all-reduces ({reduces_per_step:.0f} a step, waiting included)",
                              fmt_time(reduce_per_step), f"{100 * reduce_per_step / decode_two:.1f}%"])
    data = {"tp1": one, "tp": two, "ranks": args.tp, "shape": args.shape, "device": args.device,
            "tell_per_step_s": tell_per_step, "all_reduce_per_step_s": reduce_per_step if cpu else None}
    name = "tensor_parallel" if cpu else "gpu-tensor_parallel"
    print(write_results(name, " ".join(["python -m bench.tensor_parallel", *sys.argv[1:]]), [steps, overhead], data))


if __name__ == "__main__":
    main()
