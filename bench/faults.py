"""Fault scenarios: kill, stop and restart each hop under load; count what every request got.

The three services run as separate processes on loopback, as compose runs them. For
each scenario, N requests go in flight (greedy, ignore_eos, top-k logprobs; a mix of
non-streaming HTTP with flat base64 top-k, streaming HTTP, and streaming gRPC with raw
arrays), a fault is injected once every request has tokens, and each request is
classified (identical, failed explicitly, truncated silently, hung, other: see
harness/faults.py, which runs the scenarios).

    python -m bench.faults                 # writes RELIABILITY.md (and bench/out/faults.{md,json})
    python -m bench.faults --requests 16   # fewer requests per scenario

tests/reliability/test_faults.py runs the same scenarios with fewer requests and asserts
the outcomes.
"""

import argparse
from pathlib import Path

from bench.common import machine_line
from harness.faults import OUTCOMES, SCENARIOS, SCHEDULER_ARGS, K, ScenarioResult, run_scenario
from harness.stack import running

ROOT = Path(__file__).resolve().parent.parent


def table(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | " + " | ".join(OUTCOMES) + " | time to fail (max) | notes |",
             "|---" * (len(OUTCOMES) + 3) + "|"]
    for result in results:
        worst = f"{max(result.fail_times):.1f} s" if result.fail_times else "-"
        notes = "; ".join(result.notes + result.details)
        lines.append(f"| {result.name} | " + " | ".join(str(result.counts[o]) for o in OUTCOMES)
                     + f" | {worst} | {notes} |")
    return "\n".join(lines)


def main() -> None:
    from transformers import AutoTokenizer

    from services.common.model_store import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = parser.parse_args()
    model_dir = resolve_model(None, None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    log_dir = ROOT / "bench" / "out" / "faults-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with running(model_dir, log_dir, scheduler_args=SCHEDULER_ARGS) as stack:
        for name in args.scenarios:
            print(f"{name} ...", flush=True)
            results.append(run_scenario(stack, name, args.requests, args.tokens, tokenizer))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    command = "python -m bench.faults " + " ".join(
        f"--{k} {v}" for k, v in (("requests", args.requests), ("tokens", args.tokens)))
    report = ROOT / "RELIABILITY.md"
    fuzzing = report.read_text().partition("\n## Fuzzing\n") if report.exists() else ("", "", "")
    report.write_text(REPORT.format(command=command, machine=machine_line(), requests=args.requests,
                                    tokens=args.tokens, k=K, table=table(results))
                      + (f"\n## Fuzzing\n{fuzzing[2]}" if fuzzing[1] else ""))
    print("RELIABILITY.md written")


REPORT = """# Reliability

What each request got when a hop was killed, stopped or restarted under load (`bench/faults.py`;
the invariants are in docs/reliability.md). Target: 0 truncated silently, 0 hung, in every row.

Command: `{command}`. Machine: {machine}.
Per scenario: {requests} requests in flight ({tokens} tokens each, greedy, ignore_eos; non-streaming HTTP
with flat base64 top-{k}, streaming HTTP, streaming gRPC with raw top-{k} arrays), the services as separate
processes with default settings (hop timeout 5 s), the fault injected once every request had 8 tokens.
"identical" means ids, text and the logprob bytes equal what the scheduler produced, as recorded by a
subscriber of its step stream. "time to fail" is from the fault to the last explicit failure.

{table}
"""


if __name__ == "__main__":
    main()
