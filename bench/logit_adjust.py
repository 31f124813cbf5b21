"""Logit adjustments (penalties, logit_bias, min_new_tokens): what they add to a model step.

One decode step of the default model over B running requests (scheduler's batch_step.run_step,
the real ModelRunner on this machine's device), plain and with every row adjusted (repetition,
frequency and presence penalties, a 16-token logit_bias, min_new_tokens), timed interleaved;
and the adjustment alone (services.scheduler.logit_adjust.adjust_logits plus the count update)
on [B, vocab] logits.

    python -m bench.logit_adjust             # writes bench/out/logit_adjust.{md,json}
"""

import argparse

import numpy as np
import torch

from bench.common import Interleaved, Table, write_results
from services.common.model_store import resolve_model
from services.common.pb import scheduler_pb2
from services.scheduler.batch_step import run_step
from services.scheduler.logit_adjust import AdjustedRow, adjust_logits
from services.scheduler.model_runner import ModelRunner
from services.scheduler.request import Limits, Request, parse_request

PROMPT_TOKENS = 64
ADJUSTED = dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3, min_new_tokens=1000,
                logit_bias={token: -5.0 for token in range(100, 116)})


def running_requests(runner: ModelRunner, batch: int, adjusted: bool) -> list[Request]:
    """`batch` requests past their prefill, each holding a KV slot."""
    limits = Limits(runner.vocab_size, runner.max_context, 0, tuple(runner.eos_token_ids), 1)
    rng = np.random.default_rng(0)
    requests = []
    for i in range(batch):
        sampling = scheduler_pb2.SamplingParams(max_new_tokens=2000, temperature=0.0, **(ADJUSTED if adjusted else {}))
        prompt = rng.integers(0, 100_000, PROMPT_TOKENS).tolist()
        message = scheduler_pb2.TokenizedRequest(rid=f"r{i}", input_ids=prompt, sampling=sampling)
        request = parse_request(message, limits)
        request.slot = runner.cache.allocate()
        requests.append(request)
    host = run_step(runner, [], requests, runner.logits_chunk_rows)
    for request, token in zip(requests, host["next_ids"].tolist()):
        request.output_ids.append(token)
    return requests


def release(runner: ModelRunner, requests: list[Request]) -> None:
    for request in requests:
        runner.cache.release(request.slot)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.logit_adjust", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    runner = ModelRunner(resolve_model(None), "auto", "auto", 0, 2 * sum(args.batch))
    bench = Interleaved(min_time=0.1)
    for batch in args.batch:
        for adjusted in (False, True):
            requests = running_requests(runner, batch, adjusted)
            bench.add(("step", batch, adjusted),
                      lambda requests=requests: run_step(runner, requests, [], runner.logits_chunk_rows))
        logits = torch.randn(batch, runner.vocab_size, device=runner.device)
        rows = [AdjustedRow(i, r.slot, len(r.output_ids), r.adjustment) for i, r in enumerate(requests)
                if r.adjustment is not None]
        slots = torch.tensor([r.slot for r in rows], device=runner.device)

        @torch.inference_mode()  # as the scheduler's step runs (its count tensors are inference tensors)
        def adjust(logits=logits, rows=rows, slots=slots):
            adjusted = adjust_logits(logits, rows, runner.token_counts)
            runner.token_counts.add(slots, adjusted.argmax(dim=-1))

        bench.add(("adjust", batch, True), adjust)
    for _ in range(args.rounds):
        bench.round()

    table = Table("Decode step with logit adjustments on every row",
                  ["requests", "plain step ms", "adjusted step ms", "ratio", "adjustment alone ms", "per row µs"],
                  f"The default model on {runner.device} (vocab {runner.vocab_size}); adjusted rows carry repetition, "
                  "frequency and presence penalties, a 16-token logit_bias and min_new_tokens. Medians of "
                  f"{args.rounds} interleaved rounds.")
    rows_json = []
    for batch in args.batch:
        plain, adjusted = bench.timing(("step", batch, False)), bench.timing(("step", batch, True))
        alone = bench.timing(("adjust", batch, True))
        table.add(batch, f"{plain.ms:.2f}", f"{adjusted.ms:.2f}", f"{adjusted.median / plain.median:.2f}x",
                  f"{alone.ms:.2f}", f"{alone.us / batch:.0f}")
        rows_json.append({"batch": batch, "plain_ms": plain.ms, "adjusted_ms": adjusted.ms, "adjust_ms": alone.ms})
    print(write_results("logit_adjust", "python -m bench.logit_adjust", [table], {"rows": rows_json},
                        f"Prompts of {PROMPT_TOKENS} tokens, one decode step per call."))


if __name__ == "__main__":
    main()
