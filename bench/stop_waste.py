"""Stop strings: how many tokens the scheduler generates past a match before the request stops.

The detokenizer matches stop strings, so a request with stop strings ships every token
as soon as it exists (--output-interval does not apply to it); once a match is found the
detokenizer asks the scheduler to abort the request, and the steps run meanwhile are
wasted. This measures them, with the synthetic scheduler (--engine synthetic) at a
GPU-like step time, the real detokenizer and gateway: C concurrent /generate requests
whose stop string occurs early in the synthetic text. Wasted tokens per request are the
scheduler's own count for it (its Finish on the step stream, read by a tap) minus the
tokens the response carries.

    python -m bench.stop_waste               # writes bench/out/stop_waste.{md,json}
"""

import argparse
import concurrent.futures
import statistics

import httpx

from bench.common import OUT_DIR, Table, write_results
from harness.scheduler_client import Tap
from harness.stack import running
from services.common.model_store import resolve_model

STOP = " the"  # early and frequent in the synthetic engine's paragraph
PROMPT_IDS = list(range(1000, 1016))


def one(url: str, seed: int, max_new_tokens: int) -> dict:
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": max_new_tokens, "stop": STOP,
                                                         "seed": seed}}
    reply = httpx.post(f"{url}/generate", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()["meta_info"]


def measure(step_ms: float, concurrency: int, rounds: int, max_new_tokens: int) -> dict:
    log_dir = OUT_DIR / "stop_waste-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    scheduler_args = ("--engine", "synthetic", "--step-ms", str(step_ms), "--max-running-requests", str(concurrency))
    with running(resolve_model(None), log_dir, scheduler_args=scheduler_args) as stack:
        stack.wait_ready()
        tap = Tap(stack.scheduler_address)
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            metas = list(pool.map(lambda seed: one(stack.http_url, seed, max_new_tokens),
                                  range(concurrency * rounds)))
        tap.catch_up()
        tap.close()
    wasted, stopped = [], 0
    for meta in metas:
        if meta["finish_reason"]["type"] != "stop":
            continue
        stopped += 1
        wasted.append(tap.requests[meta["id"]].output_tokens - meta["completion_tokens"])
    return {"step_ms": step_ms, "concurrency": concurrency, "requests": len(metas), "stopped": stopped,
            "wasted_mean": statistics.mean(wasted), "wasted_max": max(wasted),
            "wasted_median": statistics.median(wasted)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stop_waste", description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[10.0, 30.0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    rows = [measure(step_ms, args.concurrency, args.rounds, args.max_new_tokens) for step_ms in args.step_ms]
    table = Table("Tokens generated past a stop string's match",
                  ["step ms", "requests", "stopped by the string", "wasted: mean", "median", "max"],
                  "Requests with stop strings ship every token, so the waste is the steps run while the match "
                  "travels scheduler -> detokenizer and the abort comes back; a request that shipped every "
                  "--output-interval (50) tokens instead would waste up to 49 more.")
    for r in rows:
        table.add(f"{r['step_ms']:g}", r["requests"], r["stopped"], f"{r['wasted_mean']:.2f}",
                  f"{r['wasted_median']:g}", r["wasted_max"])
    command = "python -m bench.stop_waste" + (f" --step-ms {' '.join(map(str, args.step_ms))}"
                                              if args.step_ms != [10.0, 30.0] else "")
    print(write_results("stop_waste", command, [table], {"rows": rows},
                        f"Synthetic scheduler, {args.concurrency} concurrent requests x {args.rounds} rounds, "
                        f"stop {STOP!r}, max_new_tokens {args.max_new_tokens}."))


if __name__ == "__main__":
    main()
