"""Prefix cache benchmark: the prefill work and the wall time that the cache saves.

- GRPO's n samples: n=8 samples (temperature 1, each seeded) of one 2048-token prompt, against one request;
- an agent's session: 10 turns, each prompt the conversation so far (the last prompt, its reply and a new
  64-token message); the tokens each turn prefills;
with the cache and with --disable-radix-cache, on the default model and the mid-size one (bench/models.py), in
process (the engine's policy and model step, bench/in_process.py).

    python -m bench.prefix        # writes bench/out/prefix.md and .json
"""

import argparse
import time

from bench.common import Progress, Table, fmt_ratio, fmt_time, write_results
from bench.in_process import InProcessSteps, random_prompt
from bench.models import default_model, mid_model
from services.scheduler.model.runner import ModelRunner

PROMPT, SAMPLES, NEW_TOKENS = 2048, 8, 16
TURNS, MESSAGE, REPLY = 10, 64, 32


def samples(runner: ModelRunner, cache: bool, n: int) -> dict:
    engine = InProcessSteps(runner, n, prefix_cache=cache)
    prompt = random_prompt(1, PROMPT)
    engine.add([engine.request(f"s{i}", prompt, NEW_TOKENS, temperature=1.0, seed=i) for i in range(n)])
    start = time.perf_counter()
    engine.run()
    return {"seconds": time.perf_counter() - start, "prefill_tokens": engine.policy.prefill_tokens}


def session(runner: ModelRunner, cache: bool) -> dict:
    engine = InProcessSteps(runner, 1, prefix_cache=cache)
    prompt, turns = random_prompt(2, MESSAGE), []
    for turn in range(TURNS):
        request = engine.request(f"t{turn}", prompt, REPLY)
        before, start = engine.policy.prefill_tokens, time.perf_counter()
        engine.add([request])
        engine.run()
        turns.append({"prompt": len(prompt), "prefilled": engine.policy.prefill_tokens - before,
                      "seconds": time.perf_counter() - start})
        prompt = prompt + request.output_ids + random_prompt(100 + turn, MESSAGE)
    return {"turns": turns, "prefill_tokens": sum(t["prefilled"] for t in turns),
            "seconds": sum(t["seconds"] for t in turns)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    models = {"default": default_model(), "mid-size": mid_model()}
    progress = Progress(len(models) * 5, "prefix")
    data: dict = {}
    grpo = Table(f"n={SAMPLES} samples of one {PROMPT}-token prompt ({NEW_TOKENS} new tokens each)",
                 ["model", "prefix cache", "prefill tokens", "vs one request", "wall", "vs one request"],
                 "One request: the same prompt alone. Prefill tokens: the tokens whose KV a prefill computed.")
    chat = Table(f"A {TURNS}-turn session (each turn: the conversation so far + a {MESSAGE}-token message, "
                 f"{REPLY} new tokens)", ["model", "prefix cache", "prefill tokens, all turns", "last turn's prompt",
                                          "last turn prefilled", "wall, all turns"], "")
    for name, path in models.items():
        runner = ModelRunner(path, "cpu", "float32", 0, SAMPLES, max_total_tokens=4 * PROMPT * SAMPLES)
        samples(runner, False, 1)  # warm-up: torch's first calls at these shapes are slower
        one = samples(runner, True, 1)
        progress.step(f"{name}: one request")
        data[name] = {"one": one}
        for cache in (True, False):
            label = "on" if cache else "off"
            got = data[name][f"samples_{label}"] = samples(runner, cache, SAMPLES)
            progress.step(f"{name}: samples, cache {label}")
            grpo.add(name, label, got["prefill_tokens"], fmt_ratio(got["prefill_tokens"] / one["prefill_tokens"]),
                     fmt_time(got["seconds"]), fmt_ratio(got["seconds"] / one["seconds"]))
            turns = data[name][f"session_{label}"] = session(runner, cache)
            progress.step(f"{name}: session, cache {label}")
            last = turns["turns"][-1]
            chat.add(name, label, turns["prefill_tokens"], last["prompt"], last["prefilled"],
                     fmt_time(turns["seconds"]))
    print(write_results("prefix", "python -m bench.prefix", [grpo, chat], data))


if __name__ == "__main__":
    main()
