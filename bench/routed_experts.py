"""What recording routed experts costs a decode step (--enable-return-routed-experts).

Two ModelRunners on a small random Qwen3-MoE (harness/checkpoints.py: 3 layers, 2 of them MoE with 8 experts,
2 per token; the default vocabulary), one recording the routers' choices into its KV-layout table and one not,
each with B requests past their prefill; their decode steps timed interleaved. Then what a finished request's
routing costs to read back (ExpertRouting.of over its page table).

    python -m bench.routed_experts            # writes bench/out/routed_experts.{md,json}
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np

from bench.common import Interleaved, Table, fmt_ratio, measure, write_results
from bench.in_process import InProcessSteps
from harness.checkpoints import moe_checkpoint
from services.common.memory import keep_big_blocks
from services.common.model_store import resolve_model
from services.scheduler.model.runner import ModelRunner

PROMPT_TOKENS = 64
NEW_TOKENS = 100_000  # the requests never end while timed


def running(runner: ModelRunner, batch: int) -> InProcessSteps:
    steps = InProcessSteps(runner, batch)
    rng = np.random.default_rng(0)
    steps.add([steps.request(f"r{i}", rng.integers(0, 240_000, PROMPT_TOKENS).tolist(), NEW_TOKENS)
               for i in range(batch)])
    steps.step()  # the prefills
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.routed_experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    keep_big_blocks()
    with tempfile.TemporaryDirectory() as scratch:
        moe_dir = moe_checkpoint(resolve_model(None), Path(scratch) / "moe")
        runners = {recording: ModelRunner(moe_dir, "auto", "auto", 0, args.batch, max_total_tokens=1 << 16,
                                          routed_experts=recording) for recording in (False, True)}
        steps = {recording: running(runner, args.batch) for recording, runner in runners.items()}
        bench = Interleaved(min_time=0.1)
        for recording, each in steps.items():
            bench.add(recording, each.step)
        for _ in range(args.rounds):
            bench.round()
        plain, recorded = bench.timing(False), bench.timing(True)
        request = steps[True].policy.running[0]
        routing = runners[True].expert_routing
        assert routing is not None
        read = measure(lambda: routing.of(request.kv.tables[routing.group], request.kv.computed))
    ratio = recorded.median / plain.median
    table = Table(f"Decode step at B={args.batch} on the MoE test model", ["step ms, not recording",
                                                                           "step ms, recording", "recording / not",
                                                                           "reading one request's routing"],
                  f"Medians of {args.rounds} interleaved rounds; the read is of a {request.kv.computed}-token "
                  f"sequence ({PROMPT_TOKENS}-token prompt and the output so far), [tokens, 3, 2] int32.")
    table.add(f"{plain.ms:.2f}", f"{recorded.ms:.2f}", fmt_ratio(ratio), f"{read.us:.0f} us")
    checks = Table("Targets", ["target", "measured", "verdict"])
    checks.add(f"routed experts add <= 3% to the B={args.batch} decode step", f"{(ratio - 1) * 100:+.1f}%",
               "met" if ratio <= 1.03 else "missed")
    print(write_results("routed_experts", "python -m bench.routed_experts", [table, checks],
                        {"plain_step_ms": plain.ms, "recording_step_ms": recorded.ms, "read_us": read.us}))


if __name__ == "__main__":
    main()
