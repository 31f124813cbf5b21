"""Scheduler step costs (issue 2's closing numbers).

1. Encoding and decoding one StepOutput for B requests at k=128, through the
   scheduler's own code: each request's pending row from the host arrays one step
   copies back, then output.step_output.step_message(...) and its bytes; on the
   receiving side flatwire_wire.steps.decode_step (+ one slice per request).
2. The default model's decode step on this machine (ModelRunner + batch_step, in
   process, no gRPC): batch 1 and 32, greedy without logprobs, greedy with k=128,
   and seeded sampling (temperature 1, top-p 0.9).

    python -m bench.step_codec     # writes bench/out/step_codec.md and .json
"""

import argparse
import time

import numpy as np
from flatwire_wire.logprobs import LogprobRows
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import StepMessage, decode_step

from bench.common import Progress, Table, fmt_bytes, fmt_time, measure, timing_of, write_results
from bench.in_process import InProcessSteps
from services.common.memory import keep_big_blocks
from services.common.model_store import resolve_model
from services.scheduler.model.runner import ModelRunner
from services.scheduler.output.step_output import step_message
from services.scheduler.request import Request
from services.scheduler.step import StepResult
from services.scheduler.submit import SubmitLimits, parse_request

VOCAB = 248077


def make_request(i: int, prompt_len: int, k: int, temperature: float = 0.0, seed: int | None = None) -> Request:
    """A request as the scheduler's Submit validates it; it ships every token (as a streaming one)."""
    rng = np.random.default_rng(i)
    sampling = SamplingParams(max_new_tokens=1 << 30, temperature=temperature,
                                            top_p=0.9 if temperature else 1.0, seed=seed)
    message = TokenizedRequest(
        rid=f"req-{i:04d}", owner="bench", input_ids=rng.integers(0, 240_000, prompt_len).tolist(), sampling=sampling,
        logprob=LogprobParams(return_logprob=k > 0, top_logprobs_num=k, logprob_start_len=-1))
    return parse_request(message, SubmitLimits(VOCAB, 1 << 20, max(k, 1), (), output_interval=1))


def codec(batch: int, k: int) -> dict:
    rng = np.random.default_rng(0)
    requests = [make_request(i, 8, k) for i in range(batch)]
    result = StepResult(next_ids=rng.integers(0, VOCAB, batch).astype(np.int32), output=LogprobRows(
        -rng.random(batch, dtype=np.float32) * 10, -np.sort(rng.random((batch, k), dtype=np.float32) * 10, axis=1),
        rng.integers(0, VOCAB, (batch, k)).astype(np.int32), np.zeros((batch, 0), np.float32)))

    def encode() -> bytes:
        for row, request in enumerate(requests):
            request.pending.add(int(result.next_ids[row]), result.output, row)
        return step_message(7, [], requests, [], [], "default").encoded

    wire = encode()

    def decode() -> StepMessage:
        return decode_step(wire)

    def decode_and_slice():
        message = decode()
        assert message.output is not None
        return [message.output.request(i) for i in range(len(message.rids))]

    return {"encode": measure(encode, repeats=9), "decode": measure(decode, repeats=9),
            "decode_and_slice": measure(decode_and_slice, repeats=9), "bytes": len(wire)}


def decode_steps(runner: ModelRunner, batch: int, k: int, temperature: float, steps: int, repeats: int) -> list[float]:
    """Per-step seconds (one entry per repeat of `steps` decode steps) after one prefill."""
    engine = InProcessSteps(runner, batch)
    engine.add([make_request(i, 32, k, temperature, seed=i if temperature else None) for i in range(batch)])
    engine.step()  # the prefills
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        per_step.append((time.perf_counter() - start) / steps)
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local checkpoint (default: the embedded default model)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    cases = [(1, 0, 0.0), (1, 128, 0.0), (1, 0, 1.0), (32, 0, 0.0), (32, 128, 0.0), (32, 0, 1.0)]
    progress = Progress(2 + len(cases), "step_codec")
    codecs = {}
    for batch in (32,):
        codecs[batch] = codec(batch, 128)
        progress.step(f"codec B={batch} k=128")
    codec_table = Table("One StepOutput, k=128", ["requests", "encode (step_message + its bytes)",
                                                   "decode (bytes -> StepMessage)", "+ a slice per request",
                                                   "bytes"])
    for batch, result in codecs.items():
        codec_table.add(batch, fmt_time(result["encode"].median), fmt_time(result["decode"].median),
                        fmt_time(result["decode_and_slice"].median), fmt_bytes(result["bytes"]))

    runner = ModelRunner(resolve_model(args.model), "auto", "auto", 0, 32, max_total_tokens=32 * 4096)
    if runner.device.type == "cpu":
        keep_big_blocks()  # as the scheduler process does
    progress.step(f"model loaded on {runner.device}")
    step_table = Table(f"Decode step of the model ({runner.device}, {str(runner.dtype).removeprefix('torch.')})",
                       ["batch", "mode", "step (median)", "per request"],
                       note="In process: flat forward + logits + sampling/logprobs + one host copy; "
                            "prompts of 32 tokens, median over repeats.")
    steps = {}
    for batch, k, temperature in cases:
        mode = ("sampled (T=1, top-p 0.9, seeded)" if temperature else "greedy") + (f", top-{k} logprobs" if k else "")
        timing = timing_of(decode_steps(runner, batch, k, temperature, args.steps, args.repeats), args.steps)
        steps[f"B={batch} {mode}"] = timing
        step_table.add(batch, mode, fmt_time(timing.median), fmt_time(timing.median / batch))
        progress.step(f"B={batch} {mode}: {fmt_time(timing.median)}")
    print(write_results("step_codec", "python -m bench.step_codec", [codec_table, step_table],
                        {"codec": codecs, "decode_step": steps}))


if __name__ == "__main__":
    main()
