"""What batched LoRA adapters cost a step (issue 50): requests on 4 adapters and on the base model in one step,
against the same step on the base model alone.

On the mid-size model (bench/models.py), float32 on the CPU, in process: a B=32 decode step at 256 tokens of
context, and a prefill step of 8 prompts of 128 tokens, each
- on a runner without --enable-lora (the base model as flatwire serves it without adapters),
- on a runner with LoRA (--max-loras-per-batch 4, --max-lora-rank 16, every projection a target), every row on the
  base model (what the hooks cost when no adapter runs),
- on that runner, the rows spread over 4 rank-16 adapters of every projection and the base model (32 decode rows:
  7 on each adapter, 4 on the base; 8 prompts: 2 on three adapters, 1 on the fourth, 1 on the base).
Adapters are random PEFT files (adapter_config.json, adapter_model.safetensors) read by the server's own reader.
Cases are timed in rounds (each round: every case once, the median of its steps), the median over rounds reported;
the ratio a target is checked on is the median of the rounds' own ratios (one round's cases ran close together,
under much the same load from other processes). Each step is timed twice: wall-clock, and the CPU time the process
spent on it (every thread's: what it costs, less sensitive than the wall clock to other processes on the cores); and
every case runs with torch's threads and with one: on a host that other work keeps busy, each of the LoRA's small
ops (three a target, 84 targets) waits for the second thread to be scheduled, which one thread never does.

    python -m bench.lora        # writes bench/out/lora.md and .json
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import Progress, Table, fmt_time, write_results
from bench.in_process import InProcessSteps, random_prompt
from bench.models import mid_model
from services.common.memory import keep_big_blocks
from services.scheduler.config import SchedulerConfig
from services.scheduler.model.lora_adapter import LoraAdapter, read_adapter_dir
from services.scheduler.model.runner import ModelRunner

BATCH, CONTEXT, DECODE_STEPS = 32, 256, 4
PREFILLS, PROMPT = 8, 128
ADAPTERS, RANK = 4, 16
ROUNDS = 7
TARGET = 1.5  # the mixed step costs at most this many base-model steps


def random_adapter(directory: Path, features: dict[str, tuple[int, int]], seed: int) -> Path:
    """A rank-RANK PEFT adapter of every target module, random (A and B both), in PEFT's file layout."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in features.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator) * 0.02
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    kinds = sorted({module.rsplit(".", 1)[-1] for module in features})
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": kinds}))
    return directory


def spread(count: int, adapters: list[LoraAdapter]) -> list[LoraAdapter | None]:
    """Row i's adapter: round robin over the adapters and the base model, the base model taking the rest."""
    return [adapters[i % (len(adapters) + 1)] if i % (len(adapters) + 1) < len(adapters) else None
            for i in range(count)]


def timed(step) -> tuple[float, float]:
    """(wall-clock, CPU) seconds of step()."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - wall, time.process_time() - cpu


def decode_step(runner: ModelRunner, on: list[LoraAdapter | None]) -> tuple[float, float]:
    """The median (wall-clock, CPU) seconds of a decode step of len(on) requests at CONTEXT tokens, row i on on[i]."""
    engine = InProcessSteps(runner, len(on))
    for i, adapter in enumerate(on):
        request = engine.request(f"d{i}", random_prompt(i, CONTEXT - DECODE_STEPS - 1), DECODE_STEPS + 2)
        request.adapter = adapter
        engine.place(request)
    engine.step()
    walls, cpus = zip(*(timed(engine.step) for _ in range(DECODE_STEPS)))
    return statistics.median(walls), statistics.median(cpus)


def prefill_step(runner: ModelRunner, on: list[LoraAdapter | None]) -> tuple[float, float]:
    """The (wall-clock, CPU) seconds of one step that prefills len(on) prompts of PROMPT tokens, prompt i on on[i]."""
    engine = InProcessSteps(runner, len(on))
    requests = [engine.request(f"p{i}", random_prompt(100 + i, PROMPT), 1) for i in range(len(on))]
    for request, adapter in zip(requests, on):
        request.adapter = adapter
    engine.add(requests)
    return timed(engine.step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    keep_big_blocks()  # as the scheduler process does on the CPU
    path = mid_model()
    tokens = BATCH * (CONTEXT + 64)
    plain = ModelRunner(path, "cpu", "float32", 0, BATCH, max_total_tokens=tokens)
    lora_config = SchedulerConfig(enable_lora=True, max_loras_per_batch=ADAPTERS, max_lora_rank=RANK)
    lora = ModelRunner(path, "cpu", "float32", 0, BATCH, max_total_tokens=tokens, lora=lora_config.lora_layers)
    assert lora.lora is not None
    layers = lora.lora
    with tempfile.TemporaryDirectory() as scratch:
        adapters = [read_adapter_dir(f"a{i}", str(random_adapter(Path(scratch) / f"a{i}", layers.features, i)),
                                     layers.features, layers.max_rank, layers.dtype) for i in range(ADAPTERS)]
    cases = {
        ("decode", "base, no LoRA"): lambda: decode_step(plain, [None] * BATCH),
        ("decode", "base, LoRA on"): lambda: decode_step(lora, [None] * BATCH),
        ("decode", "4 adapters + base"): lambda: decode_step(lora, spread(BATCH, adapters)),
        ("prefill", "base, no LoRA"): lambda: prefill_step(plain, [None] * PREFILLS),
        ("prefill", "base, LoRA on"): lambda: prefill_step(lora, [None] * PREFILLS),
        ("prefill", "4 adapters + base"): lambda: prefill_step(lora, spread(PREFILLS, adapters)),
    }
    threads = (torch.get_num_threads(), 1)
    progress = Progress(ROUNDS * len(cases) * len(threads), "lora")
    runs: dict = {(count, *key): [] for key in cases for count in threads}
    for round_ in range(ROUNDS):
        for count in threads:
            torch.set_num_threads(count)
            for key, case in cases.items():
                runs[(count, *key)].append(case())
                progress.step(f"round {round_ + 1}, {count} threads: {key[0]}, {key[1]}")
    steps = Table(f"A step on the mid-size model (median of {ROUNDS} rounds): wall-clock, and CPU time",
                  ["step", "torch threads", "clock", "base, no LoRA", "base, LoRA on", "4 adapters + base",
                   "mixed vs no LoRA (median of the rounds' ratios)"],
                  f"decode: B={BATCH} at {CONTEXT} tokens of context; prefill: {PREFILLS} prompts of {PROMPT} "
                  f"tokens in one step; adapters of rank {RANK} on all 7 projections of every layer "
                  f"({len(layers.targets)} targets), {layers.bytes / 2**20:.0f} MiB of slot buffers")
    checks = Table("Targets", ["target", "measured", "verdict"])
    data: dict = {}
    for step in ("decode", "prefill"):
        data[step] = {}
        for count in threads:
            for clock, which in (("wall", 0), ("CPU", 1)):
                series = {case: [run[which] for run in runs[(count, step, case)]]
                          for (_, kind, case) in runs if kind == step}
                base, hooks, mixed = (statistics.median(series[case]) for case in ("base, no LoRA", "base, LoRA on",
                                                                                   "4 adapters + base"))
                ratio = statistics.median(m / b for m, b in zip(series["4 adapters + base"], series["base, no LoRA"]))
                steps.add(step, count, clock, fmt_time(base), fmt_time(hooks), fmt_time(mixed), f"{ratio:.2f}x")
                data[step][f"{count} threads, {clock}"] = series | {"ratio": ratio}
                on = f"{count} thread{'s' if count > 1 else ''}"
                checks.add(f"a {step} step over 4 adapters and the base model costs at most {TARGET}x the base "
                           f"model's ({on}, {clock})", f"{ratio:.2f}x", "met" if ratio <= TARGET else "missed")
    print(write_results("lora", "python -m bench.lora", [steps, checks], data))


if __name__ == "__main__":
    main()
