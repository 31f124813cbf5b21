"""An 8-bit KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) against one in the compute dtype (auto), on the default
model in process:

- KV bytes a token: what the layers' specs say (the pool's page slot) and what the pool's tensors hold per slot, by
  --dtype (float32, bfloat16) and --kv-cache-dtype;
- what the 8 bits cost in logprobs: PROMPTS random prompts of 4 to 256 tokens, each generating NEW_TOKENS greedy
  tokens together with top-TOP_K logprobs, on an 8-bit cache against the same --dtype's own cache: how many outputs
  stay the same, and the largest difference of a logprob up to the first token that differs (the chosen token's
  before it, the top-k values' up to it). The default model's weights are random: its next-token distribution is
  nearly flat, and where the auto cache's top two tokens lie closer than the 8-bit cache's error, greedy picks the
  other; the table gives those top-two margins.

    python -m bench.kv_dtype        # writes bench/out/kv_dtype.md and .json
"""

import argparse
import gc

import numpy as np
from flatwire_wire.logprobs import LogprobRows

from bench.common import Progress, Table, write_results
from bench.in_process import InProcessSteps, random_prompt
from bench.models import default_model
from services.scheduler.model.runner import ModelRunner

PROMPTS, NEW_TOKENS, TOP_K = 16, 64, 20
COMPUTE = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
LOGPROB_TARGET = 0.05


def greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[dict[str, np.ndarray]]:
    """Per prompt: its greedy tokens, the chosen tokens' logprobs and the top-k values, all prompts in one batch."""
    engine = InProcessSteps(runner, len(prompts))
    engine.add([engine.request(str(i), ids, NEW_TOKENS, top_k=TOP_K) for i, ids in enumerate(prompts)])
    rows: list[list[tuple[int, float, np.ndarray]]] = [[] for _ in prompts]
    while engine.policy.requests:
        batch = engine.policy.schedule()
        result = runner.step(batch)
        output: LogprobRows = result.output  # type: ignore[assignment]  # every request asks for logprobs
        for i, row in enumerate(batch.sampling):
            rows[int(row.request.rid)].append((int(result.next_ids[i]), float(output.token_logprobs[i]),
                                               output.topk_values[i]))
        engine.take(batch, result)
    return [{"tokens": np.array([r[0] for r in each]), "chosen": np.array([r[1] for r in each]),
             "topk": np.stack([r[2] for r in each])} for each in rows]


def compare(reference: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict:
    """Where the greedy tokens part (NEW_TOKENS if never), the logprob differences up to there, and the reference's
    top-two margin where they part."""
    differs = np.flatnonzero(reference["tokens"] != got["tokens"])
    first = int(differs[0]) if len(differs) else NEW_TOKENS
    chosen = np.abs(reference["chosen"][:first] - got["chosen"][:first])
    ranked = np.abs(reference["topk"][:first + 1] - got["topk"][:first + 1])
    top = reference["topk"][first] if first < NEW_TOKENS else None
    return {"first_difference": first, "chosen_max": float(chosen.max(initial=0)),
            "chosen_mean": float(chosen.mean()) if first else 0.0, "topk_max": float(ranked.max(initial=0)),
            "margin": None if top is None else float(top[0] - top[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    model = default_model()
    prompts = [random_prompt(i, length) for i, length in
               enumerate(np.random.default_rng(0).integers(4, 257, PROMPTS).tolist())]
    progress = Progress(len(COMPUTE) * len(KV_CACHE_DTYPES), "kv_dtype")
    data: dict = {"bytes": {}, "logprobs": {}}
    references: dict[str, list] = {}
    for compute in COMPUTE:
        for kv_cache_dtype in KV_CACHE_DTYPES:
            runner = ModelRunner(model, "cpu", compute, 0, PROMPTS, max_total_tokens=PROMPTS * (256 + NEW_TOKENS),
                                 kv_cache_dtype=kv_cache_dtype)
            slots = runner.num_pages * runner.page_size
            data["bytes"][f"{compute} {kv_cache_dtype}"] = {
                "stored": str(runner.kv.keys(0).dtype).removeprefix("torch."), "token_bytes": runner.kv_token_bytes,
                "pool_bytes_per_slot": runner.kv.bytes / slots}
            outputs = greedy(runner, prompts)
            if kv_cache_dtype == "auto":
                references[compute] = outputs
            else:
                data["logprobs"][f"{compute} {kv_cache_dtype}"] = [
                    compare(reference, got) for reference, got in zip(references[compute], outputs)]
            del runner
            gc.collect()
            progress.step(f"--dtype {compute} --kv-cache-dtype {kv_cache_dtype}")
    sizes = Table("KV bytes a token, default model (4 layers, 2 KV heads of 32)",
                  ["--dtype", "--kv-cache-dtype", "stored as", "bytes a token", "pool bytes a slot (measured)",
                   "vs bfloat16 auto", "vs float32 auto"],
                  "Bytes a token: the layers' specs (keys and values of every layer); measured: the pool's tensors "
                  "over its slots.")
    for key, got in data["bytes"].items():
        sizes.add(*key.split(), got["stored"], got["token_bytes"], f"{got['pool_bytes_per_slot']:.0f}",
                  f"{got['token_bytes'] / data['bytes']['bfloat16 auto']['token_bytes']:g}x",
                  f"{got['token_bytes'] / data['bytes']['float32 auto']['token_bytes']:g}x")
    logprobs = Table(f"{PROMPTS} prompts x {NEW_TOKENS} greedy tokens: an 8-bit cache against the same --dtype's "
                     "own", ["--dtype", "--kv-cache-dtype", "outputs unchanged", "largest logprob difference",
                             "largest chosen-token difference", "mean chosen-token difference",
                             "top-two margin where outputs part"],
                     f"Largest logprob difference: over the chosen tokens' logprobs and the top-{TOP_K} values, up "
                     "to the first token that differs (a run that never differs: all of it). Margin: the auto "
                     "cache's top logprob minus its second at that token.")
    for key, runs in data["logprobs"].items():
        parted = [run for run in runs if run["first_difference"] < NEW_TOKENS]
        logprobs.add(*key.split(), f"{len(runs) - len(parted)} of {len(runs)}",
                     f"{max(max(run['chosen_max'], run['topk_max']) for run in runs):.4f}",
                     f"{max(run['chosen_max'] for run in runs):.4f}",
                     f"{np.mean([run['chosen_mean'] for run in runs]):.4f}",
                     ", ".join(f"{run['margin']:.4f} (token {run['first_difference']})" for run in parted) or "-")
    checks = Table("Targets", ["target", "measured", "verdict"])
    for compute in COMPUTE:
        auto = data["bytes"][f"{compute} auto"]["token_bytes"]
        for kv_cache_dtype in KV_CACHE_DTYPES[1:]:
            got = data["bytes"][f"{compute} {kv_cache_dtype}"]["token_bytes"]
            share, times = {"bfloat16": ("half", 2), "float32": ("a quarter of", 4)}[compute]
            checks.add(f"{kv_cache_dtype}: {share} the KV bytes a token of {compute}", f"{got} vs {auto} bytes",
                       "met" if got * times == auto else "missed")
    for key, runs in data["logprobs"].items():
        largest = max(max(run["chosen_max"], run["topk_max"]) for run in runs)
        unchanged = sum(run["first_difference"] == NEW_TOKENS for run in runs)
        checks.add(f"{key}: logprobs within {LOGPROB_TARGET} of the {key.split()[0]} cache's", f"{largest:.4f}",
                   "met" if largest <= LOGPROB_TARGET else "missed")
        checks.add(f"{key}: greedy output unchanged over {NEW_TOKENS} tokens", f"{unchanged} of {len(runs)} prompts",
                   "met" if unchanged == len(runs) else "missed (near-ties: see the margins)")
    print(write_results("kv_dtype", "python -m bench.kv_dtype", [sizes, logprobs, checks], data,
                        notes="No GPU: the pools hold float8 on the CPU and the torch path attends."))


if __name__ == "__main__":
    main()
