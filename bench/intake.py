"""The gateway's intake of a step: each entry of a StepMessage into its request's Accumulator (its tokens, text
delta and logprob rows copied into the buffers held for the whole output), as EngineClient._dispatch does for
every message, before anything is rendered. This is the gateway's per-token work that no coalescing of events
saves: a streaming request takes an entry per step.

Beside it, the scheduler's own per-entry bookkeeping of each message it publishes: the step journal's record of
every request's output ids (what a new subscriber is replayed).

B requests, one token each per message (streaming), 64 messages in turn; CPU per entry, in process.

    python -m bench.intake          # writes bench/out/intake.md and .json
"""

import argparse

from flatwire_wire.logprobs import LogprobBlock, LogprobRows
from flatwire_wire.scheduler import LogprobParams
from flatwire_wire.steps import RequestStart, StepMessage

from bench.common import Progress, Table, fmt_time, measure, write_results
from services.gateway.accumulator import Accumulator
from services.scheduler.output.journal import StepJournal

MESSAGES = 64


def messages(requests: int, k: int) -> list[bytes]:
    """MESSAGES steps' messages as the gateway receives them: an entry of one token per request."""
    rids = [f"rid-{i}" for i in range(requests)]
    out = []
    for position in range(MESSAGES):
        block = LogprobBlock.of_rows([LogprobRows.allocate(1, k, 0) for _ in rids]) if k else None
        out.append(StepMessage(step=position, rids=rids, token_ids=list(range(requests)), output=block,
                               texts=["ab"] * requests, positions=[position] * requests, counts=[1] * requests,
                               weight_version="v0").encoded)
    return out


def intake(encoded: list[bytes], requests: int, k: int) -> None:
    """Every message decoded and its entries taken, as EngineClient._dispatch takes them."""
    params = LogprobParams(return_logprob=bool(k), top_logprobs_num=k)
    held = [Accumulator(params, MESSAGES) for _ in range(requests)]
    for data in encoded:
        step = StepMessage.from_bytes(data)
        token_ids, texts, output, end = list(step.token_ids), list(step.texts), step.output, 0
        for i, (position, count) in enumerate(zip(step.positions, step.counts)):
            start, end = end, end + count
            held[i].add(position, token_ids[start:end], texts[i], output, i, step.weight_version)


def journal(started: StepMessage, published: list[StepMessage]) -> None:
    """The messages recorded in a fresh journal, after the one that starts their requests."""
    steps = StepJournal(window_s=3600, window_bytes=1 << 40)
    steps.record(started)
    for message in published:
        steps.record(message)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.intake", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=512)
    args = parser.parse_args(argv)
    ks = (0, 20, 128)
    progress = Progress(len(ks) + 1, "intake")
    table = Table(f"Gateway intake per entry, {args.requests} requests x {MESSAGES} messages of one token each",
                  ["k", "per entry", "per message"])
    results = {}
    for k in ks:
        progress.step(f"k={k}")
        encoded = messages(args.requests, k)
        timing = measure(lambda encoded=encoded, k=k: intake(encoded, args.requests, k), repeats=7)
        per_entry = timing.median / (MESSAGES * args.requests)
        results[f"k{k}_entry_s"] = per_entry
        table.add(k, fmt_time(per_entry), fmt_time(timing.median / MESSAGES))
    progress.step("the scheduler's journal")
    published = [StepMessage.from_bytes(data) for data in messages(args.requests, 0)]
    started = StepMessage(started=[RequestStart(rid=f"rid-{i}", owner="bench") for i in range(args.requests)])
    timing = measure(lambda: journal(started, published), repeats=7)
    per_entry = timing.median / (MESSAGES * args.requests)
    results["journal_entry_s"] = per_entry
    recorded = Table("The scheduler's StepJournal.record per entry (the same messages, k=0)",
                     ["per entry", "per message"])
    recorded.add(fmt_time(per_entry), fmt_time(per_entry * args.requests))
    print(write_results("intake", "python -m bench.intake", [table, recorded], results))


if __name__ == "__main__":
    main()
