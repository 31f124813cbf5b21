"""Fuzz every public and internal surface beside a good request; the table goes into RELIABILITY.md.

The three services run as separate processes. While a monitor sends a good /generate every
few tenths of a second (its output must never change, and it must never fail), three kinds
of bad input are sent: a hostile HTTP corpus (every field of each endpoint given wrong types,
extreme numbers, huge and empty values, plus malformed bodies), schema fuzzing (bodies drawn by
hypothesis-jsonschema from each endpoint's request model), and raw gRPC bytes to every method
of every service. Each case is counted as accepted, refused naming the field, refused
otherwise, 5xx or UNKNOWN/INTERNAL, hung, or crashed (a service exited); target: 0 in the last
three. harness/fuzz.py holds the cases and their runner (tests/reliability/test_fuzz.py runs
it in small).

    pip install -e '.[test]'              # hypothesis, hypothesis-jsonschema
    python -m bench.fuzz                 # 1000 schema cases per endpoint; writes the RELIABILITY.md section
    python -m bench.fuzz --cases 50      # quicker
"""

import argparse
from pathlib import Path

from bench.common import machine_line
from harness.faults import SCHEDULER_ARGS
from harness.fuzz import run, table
from harness.stack import running

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Fuzzing"


def write_section(text: str) -> None:
    path = ROOT / "RELIABILITY.md"
    report = path.read_text() if path.exists() else "# Reliability\n"
    head = report.split(f"\n{SECTION}\n")[0].rstrip("\n")
    path.write_text(f"{head}\n\n{SECTION}\n\n{text}\n")


def main() -> None:
    from services.common.model_store import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="schema cases per endpoint, gRPC cases per service")
    args = parser.parse_args()
    log_dir = ROOT / "bench" / "out" / "fuzz-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with running(resolve_model(None, None), log_dir, scheduler_args=SCHEDULER_ARGS) as stack:
        rows = run(stack, args.cases)
    write_section(f"What bad input does, beside a good request (`bench/fuzz.py`). Command: "
                  f"`python -m bench.fuzz --cases {args.cases}`. Machine: {machine_line()}.\n"
                  f"Target: 0 in the 5xx, hung and crashed columns, and the good request intact.\n\n{table(rows)}")
    print("RELIABILITY.md: fuzzing section written")


if __name__ == "__main__":
    main()
