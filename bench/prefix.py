"""Prefix cache benchmark: the prefill work and the wall time that the cache saves.

- GRPO's n samples: n=8 samples (temperature 1, each seeded) of one 2048-token prompt, against one request;
- an agent's session: 10 turns, each prompt the conversation so far (the last prompt, its reply and a new
  64-token message); the tokens each turn prefills;
with the cache and with --disable-radix-cache, on the default model and the mid-size one (bench/models.py), in
process (the engine's policy and model step, bench/in_process.py); and
- two scheduler replicas behind one gateway (processes, harness.stack; the default model): 16 concurrent
  sessions of 6 turns, and 8 prompts sampled n=8 at once, routed by session key and prefix (cache_aware,
  the default) or by load alone (least_loaded): the share of prompt tokens found in a replica's cache.

    python -m bench.prefix        # writes bench/out/prefix.md and .json
"""

import argparse
import concurrent.futures
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import Progress, Table, fmt_ratio, fmt_time, write_results
from bench.in_process import InProcessSteps, random_prompt
from bench.models import default_model, mid_model
from harness.stack import running
from services.scheduler.model.runner import ModelRunner

PROMPT, SAMPLES, NEW_TOKENS = 2048, 8, 16
TURNS, MESSAGE, REPLY = 10, 64, 32
SESSIONS, SESSION_TURNS, GROUPS, GROUP_SAMPLES = 16, 6, 8, 8


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


def cacheable(prompt_tokens: int, page: int = 16) -> int:
    return (prompt_tokens - 1) // page * page


def replicas(policy: str, session_keys: bool) -> dict:
    """Two replicas, one gateway: sessions and n-sample groups at once; prompt and cached tokens over all."""
    # best_cached: what a cache holding every earlier prompt would find (whole pages, never a prompt's last token)
    totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "best_cached": 0}
    with tempfile.TemporaryDirectory() as logs, running(
            default_model(), Path(logs), schedulers=2, scheduler_args=("--max-running-requests", "64"),
            gateway_args=("--routing-policy", policy, "--health-interval-s", "0.2")) as stack:
        stack.wait_ready()
        http = httpx.Client(base_url=stack.http_url, timeout=600)

        def generate(body: dict, headers: dict | None = None) -> list[dict]:
            reply = http.post("/generate", json=body, headers=headers or {})
            reply.raise_for_status()
            body = reply.json()
            return [item["meta_info"] for item in (body if isinstance(body, list) else [body])]

        def session(i: int) -> list[dict]:
            prompt, metas = random_prompt(1000 + i, 4 * MESSAGE), []
            totals["best_cached"] += sum(cacheable(4 * MESSAGE + turn * (REPLY + MESSAGE) + 1)
                                         for turn in range(SESSION_TURNS - 1))
            for turn in range(SESSION_TURNS):
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": REPLY, "ignore_eos": True}}
                meta = generate(body, {"X-Session-ID": f"s{i}"} if session_keys else None)[0]
                metas.append(meta)
                prompt = prompt + random_prompt(2000 + i * 100 + turn, REPLY + MESSAGE)  # its reply stands in
            return metas

        def group(i: int) -> list[dict]:
            totals["best_cached"] += (GROUP_SAMPLES - 1) * cacheable(PROMPT // 2)
            return generate({"input_ids": random_prompt(3000 + i, PROMPT // 2), "sampling_params": {
                "max_new_tokens": 8, "n": GROUP_SAMPLES, "temperature": 1.0}})

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(SESSIONS + GROUPS) as pool:
            jobs = [pool.submit(session, i) for i in range(SESSIONS)] + [pool.submit(group, i) for i in range(GROUPS)]
            for job in jobs:
                for meta in job.result():
                    totals["requests"] += 1
                    totals["prompt_tokens"] += meta["prompt_tokens"]
                    totals["cached_tokens"] += meta["cached_tokens"]
        totals["seconds"] = time.perf_counter() - start
        totals["prefill_tokens"] = sum(stack.stats(name).prefill_tokens for name in ("scheduler", "scheduler-1"))
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    models = {"default": default_model(), "mid-size": mid_model()}
    routings = {"cache_aware, session keys": ("cache_aware", True),
                "cache_aware, prefixes only": ("cache_aware", False), "least_loaded": ("least_loaded", True)}
    progress = Progress(len(models) * 5 + len(routings), "prefix")
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
    routed = Table(f"Two replicas behind one gateway: {SESSIONS} sessions of {SESSION_TURNS} turns and {GROUPS} "
                   f"prompts of {PROMPT // 2} tokens sampled n={GROUP_SAMPLES}, all at once (default model)",
                   ["routing", "requests", "prompt tokens", "found cached", "hit rate", "of the best possible",
                    "prefill tokens", "wall"],
                   "Hit rate: cached tokens (meta_info.cached_tokens) over prompt tokens, every request. The best "
                   "possible is what one cache holding every earlier prompt would find: each session's first turn "
                   "and each group's first sample find nothing.")
    data["replicas"] = {}
    for label, (policy, keys) in routings.items():
        got = data["replicas"][label] = replicas(policy, keys)
        progress.step(f"two replicas: {label}")
        routed.add(label, got["requests"], got["prompt_tokens"], got["cached_tokens"],
                   f"{got['cached_tokens'] / got['prompt_tokens']:.0%}",
                   f"{got['cached_tokens'] / got['best_cached']:.0%}", got["prefill_tokens"],
                   f"{got['seconds']:.1f} s")
    print(write_results("prefix", "python -m bench.prefix", [grpo, chat, routed, targets(data)], data))


def targets(data: dict) -> Table:
    checks = Table("Targets", ["target", "measured", "verdict"])
    for name in ("default", "mid-size"):
        ratio = data[name]["samples_on"]["prefill_tokens"] / data[name]["one"]["prefill_tokens"]
        checks.add(f"{name}: n={SAMPLES} samples prefill <= 1.2x one request's", f"{ratio:.2f}x",
                   "met" if ratio <= 1.2 else "missed")
        last = data[name]["session_on"]["turns"][-1]
        checks.add(f"{name}: a session's turn prefills only its new {MESSAGE}-token message (up to a page more)",
                   f"{last['prefilled']} of {last['prompt']}", "met" if last["prefilled"] <= MESSAGE + 16 else "missed")
    aware, least = data["replicas"]["cache_aware, session keys"], data["replicas"]["least_loaded"]
    rates = [got["cached_tokens"] / got["prompt_tokens"] for got in (aware, least)]
    checks.add("two replicas: routing by session and prefix keeps the hits", f"{rates[0]:.0%} vs {rates[1]:.0%} "
               "least loaded", "met" if rates[0] > rates[1] else "missed")
    return checks


if __name__ == "__main__":
    main()
