"""KV capacity: how many requests of a realistic length mix run at once in one KV memory, paged against slots.

The memory is 131072 tokens (the CPU default, and what 32 slots of 4096 tokens reserved before paging). Each
mix is 90% short requests and 10% near the 4096-token context (prompt 3072-3584 tokens, 256-512 new), all
submitted at once; short is chat-like (prompt 64-512, 32-256 new) or longer (prompt 128-1024, 64-512 new).
Pages of 16 tokens (the default) against pages of 4096: one context-sized page per request, which is what the
former one-slot-per-request KV was. The scheduler's policy and pages as they run in the engine, on the
synthetic runner (no model: the tokens cost nothing to compute), so what is measured is admission, growth and
retraction alone.

    python -m bench.kv_capacity        # writes bench/out/kv_capacity.md and .json
"""

import argparse

import numpy as np

from bench.common import Progress, Table, fmt_ratio, write_results
from bench.in_process import InProcessSteps, random_prompt
from bench.models import default_model
from services.scheduler.model.synthetic import SyntheticRunner

KV_TOKENS, CONTEXT, MAX_RUNNING = 131072, 4096, 1024
REQUESTS, LONG_SHARE = 1000, 0.1
LONG = ((3072, 3584), (256, 512))  # (prompt range, new tokens range), inclusive
SHORT = {"chat-like": ((64, 512), (32, 256)), "longer": ((128, 1024), (64, 512))}


def length_mix(short: tuple, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, new tokens) per request."""
    rng = np.random.default_rng(seed)
    long = rng.random(REQUESTS) < LONG_SHARE

    def draw(index: int) -> np.ndarray:
        (short_low, short_high), (long_low, long_high) = short[index], LONG[index]
        return np.where(long, rng.integers(long_low, long_high + 1, REQUESTS),
                        rng.integers(short_low, short_high + 1, REQUESTS))
    return list(zip(draw(0).tolist(), draw(1).tolist()))


def run(page_size: int, mix: list[tuple[int, int]]) -> dict:
    runner = SyntheticRunner(default_model(), CONTEXT, 0, 0.0, page_size=page_size, max_total_tokens=KV_TOKENS)
    engine = InProcessSteps(runner, MAX_RUNNING, prefill_budget=8192, prefix_cache=True)
    engine.add([engine.request(f"r{i}", random_prompt(i, prompt), new) for i, (prompt, new) in enumerate(mix)])
    running, used = [], []
    while engine.policy.requests:
        engine.step()
        if engine.policy.waiting:  # while there is a backlog: what the memory holds at once
            running.append(len(engine.policy.running))
            used.append(sum(r.kv.computed for r in engine.policy.running))
    return {"page_size": page_size, "steps": len(running), "peak_running": max(running),
            "mean_running": float(np.mean(running)), "mean_tokens_in_use": float(np.mean(used)),
            "retractions": engine.policy.retractions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    progress = Progress(2 * len(SHORT), "kv_capacity")
    table = Table(f"{REQUESTS} requests at once in {KV_TOKENS} tokens of KV memory",
                  ["short requests", "mean request (tokens at its end)", "KV memory", "peak running",
                   "mean running", "vs slots", "KV in use", "vs slots, all KV in use", "retractions"],
                  "Mean running and KV in use: over the steps while requests still waited (the memory full); KV in "
                  "use: the running requests' computed tokens against the memory's. All KV in use: the mean running "
                  "scaled to a memory wholly in use, the most any packing of these requests would run. Long "
                  "requests stay longer, so they are more of the running than of the mix.")
    data: dict = {}
    for name, short in SHORT.items():
        mix = length_mix(short)
        mean_tokens = float(np.mean([prompt + new for prompt, new in mix]))
        slots = run(CONTEXT, mix)
        progress.step(f"{name}: pages of 4096 (slots)")
        paged = run(16, mix)
        progress.step(f"{name}: pages of 16")
        data[name] = {"slots": slots, "paged": paged, "mean_request_tokens": mean_tokens}
        for label, got in (("a 4096-token slot each", slots), ("pages of 16 tokens", paged)):
            table.add(name, f"{mean_tokens:.0f}", label, got["peak_running"], f"{got['mean_running']:.1f}",
                      fmt_ratio(got["mean_running"] / slots["mean_running"]),
                      f"{got['mean_tokens_in_use'] / KV_TOKENS:.0%}",
                      fmt_ratio(got["mean_running"] * KV_TOKENS / got["mean_tokens_in_use"] / slots["mean_running"]),
                      got["retractions"])
    checks = Table("Targets", ["target", "measured", "verdict"])
    for name, got in data.items():
        ratio = got["paged"]["mean_running"] / got["slots"]["mean_running"]
        bound = got["paged"]["mean_running"] * KV_TOKENS / got["paged"]["mean_tokens_in_use"] / got["slots"][
            "mean_running"]
        checks.add(f"{name} mix: >= 4x the requests running at once in the same KV memory",
                   f"{ratio:.1f}x (KV {got['paged']['mean_tokens_in_use'] / KV_TOKENS:.0%} in use; {bound:.1f}x "
                   "were all of it in use)", "met" if ratio >= 4 else "missed")
    print(write_results("kv_capacity", "python -m bench.kv_capacity", [table, checks], data))


if __name__ == "__main__":
    main()
