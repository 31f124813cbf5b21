"""What per-request logit work adds to a model step: logit adjustments (penalties, logit_bias,
min_new_tokens), grammar constraints (structured output), the logprob modes (processed_logprobs and
SGLang's sglang_logprobs against raw_logprobs) and top-p replay (each token's nucleus).

One decode step of the default model over B running requests (scheduler's batch_step.launch_step, the real
ModelRunner on this machine's device): plain, with every row adjusted (repetition, frequency and
presence penalties, a 16-token logit_bias, min_new_tokens), and with every row constrained (an EBNF
grammar that never completes, so every measured step is a constrained one), timed interleaved. Then the
work alone on [B, vocab] logits: services.scheduler.logit_adjust.adjust_logits with its count update, and
services.scheduler.grammar.TokenMask.apply (each row's bitmask filled by its xgrammar matcher, then
applied), with its fill part.

The logprob modes: B=32 requests with top-20 logprobs, sampled (temperature 0.8, top-k 50) or greedy, each
mode its own requests, their decode steps interleaved. Top-p replay: B=32 requests with top-20 logprobs in
SGLang's mode (as slime asks), without and with return_top_p_token_ids (whose logprobs are then the
nucleus's), at temperature 0.8 with top-k 50 and top-p 0.9 (nuclei of at most 50, as a trained model's
peaked distributions give) and with top-p 0.9 alone (the default model's random weights make its
distribution nearly flat: 200k of its 248k tokens a nucleus, the worst case); the step includes the
policy taking the nuclei into the requests' pending output. Replay's own work, alone: draw.nuclei against
the draw it reads (draw.sample) on [32, vocab] logits of the default model's spread, in CPU time on one
thread (less exposed than wall time to other processes on a busy machine).

    python -m bench.sampling_costs           # writes bench/out/sampling_costs.{md,json}
"""

import argparse
import time

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest

from bench.common import Interleaved, Table, fmt_ratio, write_results
from bench.in_process import InProcessSteps
from services.common.memory import keep_big_blocks
from services.common.model_store import resolve_model
from services.scheduler.engine.policy import SlotPool
from services.scheduler.kv.manager import KVManager
from services.scheduler.model.runner import ModelRunner
from services.scheduler.sampling.draw import SamplingBatch, nuclei, sample
from services.scheduler.sampling.grammar import Grammars
from services.scheduler.sampling.logit_adjust import AdjustedRow, adjust_logits
from services.scheduler.submit import SubmitLimits, parse_request

PROMPT_TOKENS = 64
GRAMMAR = "root ::= [a-z ]+ root"  # no end: the matcher never completes
CASES = {
    "plain": {},
    "adjusted": dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3, min_new_tokens=1000,
                     logit_bias={token: -5.0 for token in range(100, 116)}),
    "constrained": dict(ebnf=GRAMMAR),
}
LOGPROB_BATCH = 32
LOGPROB_CASES = {"sampled": dict(temperature=0.8, top_k=50), "greedy": dict(temperature=0.0)}
LOGPROB_MODES = (LogprobsMode.RAW, LogprobsMode.PROCESSED, LogprobsMode.SGLANG)
LOGIT_SPREAD = 0.23  # the default model's logits' standard deviation (random weights)
REPLAY_CASES = {"top-k 50, top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
                "top-p 0.9 (flat)": dict(temperature=0.8, top_p=0.9)}


def running_requests(runner: ModelRunner, grammars: Grammars, batch: int, fields: dict, slots: SlotPool,
                     kv: KVManager, logprob: LogprobParams | None = None, replay: bool = False) -> InProcessSteps:
    """`batch` requests with these SamplingParams fields (and logprobs, and top-p replay), past their prefill (each
    case its own slots and KV memory of the runner's)."""
    limits = SubmitLimits(runner.vocab_size, runner.max_context, 20, tuple(runner.eos_token_ids), 1)
    rng = np.random.default_rng(0)
    requests = []
    for i in range(batch):
        sampling = SamplingParams(max_new_tokens=100_000, **{"temperature": 0.0, **fields})
        prompt = rng.integers(0, 100_000, PROMPT_TOKENS).tolist()
        requests.append(parse_request(TokenizedRequest(rid=f"r{i}", owner="bench", input_ids=prompt,
                                                       sampling=sampling, logprob=logprob or LogprobParams(
                                                           logprob_start_len=-1), return_top_p_token_ids=replay),
                                      limits, grammars))
    engine = InProcessSteps(runner, slots, kv)
    engine.add(requests)
    engine.step()  # the prefills
    return engine


def add_cases(bench: Interleaved, runner: ModelRunner, grammars: Grammars, batch: int, slots: SlotPool,
              kv: KVManager) -> None:
    requests = {}
    for name, fields in CASES.items():
        engine = running_requests(runner, grammars, batch, fields, slots, kv)
        requests[name] = list(engine.policy.running)
        bench.add(("step", batch, name), engine.step)
    logits = torch.randn(batch, runner.vocab_size, device=runner.device)
    adjusted = [AdjustedRow(i, r.slot, len(r.output_ids), r.adjustment) for i, r in enumerate(requests["adjusted"])
                if r.adjustment is not None]
    slots = torch.tensor([r.slot for r in adjusted], device=runner.device)

    @torch.inference_mode()  # as the scheduler's step runs (its penalty tensors are inference tensors)
    def adjust():
        runner.sampler.penalties.add(slots, adjust_logits(logits, adjusted, runner.sampler.penalties).argmax(dim=-1))

    constrained = [(i, r.grammar) for i, r in enumerate(requests["constrained"]) if r.grammar is not None]

    def fill():
        for row, matcher in constrained:
            matcher.fill_next_token_bitmask(runner.sampler.token_mask.host, row)

    bench.add(("adjust", batch), adjust)
    bench.add(("mask", batch), lambda: runner.sampler.token_mask.apply(logits, constrained))
    bench.add(("fill", batch), fill)


def add_logprob_cases(bench: Interleaved, runner: ModelRunner, grammars: Grammars, slots: SlotPool,
                      kv: KVManager) -> None:
    for name, fields in LOGPROB_CASES.items():
        for mode in LOGPROB_MODES:
            engine = running_requests(runner, grammars, LOGPROB_BATCH, fields, slots, kv, top_20(mode))
            bench.add(("logprobs", name, mode), engine.step)
    for name, fields in REPLAY_CASES.items():
        for replay in (False, True):
            engine = running_requests(runner, grammars, LOGPROB_BATCH, fields, slots, kv, top_20(LogprobsMode.SGLANG),
                                      replay)
            bench.add(("replay", name, replay), _counting(engine, NUCLEUS_IDS.setdefault(name, []))
                      if replay else engine.step)


def replay_work(vocab: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Per replay case: median CPU seconds (one thread) of the B=32 draw and of its nuclei."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logits = torch.randn(LOGPROB_BATCH, vocab, generator=torch.Generator().manual_seed(0)) * LOGIT_SPREAD
    work = {}
    for name, fields in REPLAY_CASES.items():
        params = SamplingBatch(rows=list(range(LOGPROB_BATCH)), temperature=[fields["temperature"]] * LOGPROB_BATCH,
                               top_p=[fields["top_p"]] * LOGPROB_BATCH, top_k=[fields.get("top_k", -1)] * LOGPROB_BATCH,
                               min_p=[0.0] * LOGPROB_BATCH, generators=[None] * LOGPROB_BATCH)
        draws, replays = [], []
        for _ in range(rounds):
            start = time.process_time()
            draw = sample(logits, params)
            middle = time.process_time()
            nuclei(draw, params, params.rows, vocab)
            draws.append(middle - start)
            replays.append(time.process_time() - middle)
        work[name] = (float(np.median(draws)), float(np.median(replays)))
    torch.set_num_threads(threads)
    return work


NUCLEUS_IDS: dict[str, list[int]] = {}  # per replay case: how many nucleus ids each step made


def _counting(engine: InProcessSteps, counts: list[int]):
    """The engine's step, noting into `counts` how many nucleus ids it made."""
    def step() -> None:
        result = engine.step()
        counts.append(len(result.top_p.token_ids) if result.top_p is not None else 0)
    return step


def top_20(mode: LogprobsMode) -> LogprobParams:
    return LogprobParams(return_logprob=True, top_logprobs_num=20, logprob_start_len=-1, logprobs_mode=mode)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sampling_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    model_dir = resolve_model(None)
    slot_count = len(CASES) * sum(args.batch) + (len(LOGPROB_MODES) * len(LOGPROB_CASES) + 2 * len(REPLAY_CASES)) * \
        LOGPROB_BATCH
    runner = ModelRunner(model_dir, "auto", "auto", 0, slot_count)
    slots = SlotPool(slot_count)
    kv = KVManager(runner.num_pages, runner.page_size, runner.kv_windows, prefix_cache=False)
    if runner.device.type == "cpu":
        keep_big_blocks()  # as the scheduler process does
    grammars = Grammars(model_dir, runner.vocab_size, runner.eos_token_ids)
    bench = Interleaved(min_time=0.1)
    for batch in args.batch:
        add_cases(bench, runner, grammars, batch, slots, kv)
    add_logprob_cases(bench, runner, grammars, slots, kv)
    for _ in range(args.rounds):
        bench.round()
    work = replay_work(runner.vocab_size, 3 * args.rounds)

    table = Table("Decode step with logit adjustments or a grammar constraint on every row",
                  ["requests", "plain step ms", "adjusted step ms", "constrained step ms", "adjustment per row µs",
                   "mask per row µs", "of which fill µs"],
                  f"The default model on {runner.device} (vocab {runner.vocab_size}). Adjusted rows carry "
                  "repetition, frequency and presence penalties, a 16-token logit_bias and min_new_tokens; "
                  f"constrained rows follow `{GRAMMAR}`. Medians of {args.rounds} interleaved rounds.")
    rows_json = []
    for batch in args.batch:
        steps = {name: bench.timing(("step", batch, name)) for name in CASES}
        per_row = {name: bench.timing((name, batch)).us / batch for name in ("adjust", "mask", "fill")}
        with_ratio = [f"{steps[name].ms:.2f} ({steps[name].median / steps['plain'].median:.2f}x)"
                      for name in ("adjusted", "constrained")]
        table.add(batch, f"{steps['plain'].ms:.2f}", *with_ratio,
                  f"{per_row['adjust']:.0f}", f"{per_row['mask']:.0f}", f"{per_row['fill']:.1f}")
        rows_json.append({"batch": batch, **{f"{name}_step_ms": timing.ms for name, timing in steps.items()},
                          **{f"{name}_us_per_row": us for name, us in per_row.items()}})
    modes = Table(f"Decode step at B={LOGPROB_BATCH} with top-20 logprobs: processed_logprobs and sglang_logprobs "
                  "against raw_logprobs",
                  ["requests", "raw step ms", "processed step ms", "processed / raw", "sglang step ms", "sglang / raw"])
    checks = Table("Targets", ["target", "measured", "verdict"])
    logprob_json = []
    for name in LOGPROB_CASES:
        raw, processed, sglang = (bench.timing(("logprobs", name, mode)) for mode in LOGPROB_MODES)
        ratios = {mode: timing.median / raw.median for mode, timing in
                  ((LogprobsMode.PROCESSED, processed), (LogprobsMode.SGLANG, sglang))}
        modes.add(name, f"{raw.ms:.2f}", f"{processed.ms:.2f}", fmt_ratio(ratios[LogprobsMode.PROCESSED]),
                  f"{sglang.ms:.2f}", fmt_ratio(ratios[LogprobsMode.SGLANG]))
        for mode, ratio in ratios.items():
            checks.add(f"{mode.api_name} cost <= 5% of the B={LOGPROB_BATCH} decode step ({name})",
                       f"{(ratio - 1) * 100:+.1f}%", "met" if ratio <= 1.05 else "missed")
        logprob_json.append({"requests": name, "raw_step_ms": raw.ms, "processed_step_ms": processed.ms,
                             "sglang_step_ms": sglang.ms})
    replays = Table(f"Decode step at B={LOGPROB_BATCH} with top-20 sglang_logprobs, without and with top-p replay",
                    ["sampling (temperature 0.8)", "step ms", "with replay ms", "replay / without",
                     "nucleus ids per step", "draw CPU ms", "its nuclei CPU ms"])
    replay_json = []
    for name in REPLAY_CASES:
        without, with_replay = (bench.timing(("replay", name, replay)) for replay in (False, True))
        ids = int(np.median(NUCLEUS_IDS[name]))
        ratio = with_replay.median / without.median
        draw_s, nuclei_s = work[name]
        replays.add(name, f"{without.ms:.2f}", f"{with_replay.ms:.2f}", fmt_ratio(ratio), f"{ids:,}",
                    f"{draw_s * 1e3:.1f}", f"{nuclei_s * 1e3:.1f} ({nuclei_s / draw_s * 100:.1f}%)")
        replay_json.append({"sampling": name, "step_ms": without.ms, "replay_step_ms": with_replay.ms,
                            "draw_cpu_ms": draw_s * 1e3, "nuclei_cpu_ms": nuclei_s * 1e3,
                            "nucleus_ids_per_step": ids})
    checks.add(f"top-p replay costs <= 5% of the B={LOGPROB_BATCH} decode step (nuclei of at most 50)",
               f"{(replay_json[0]['replay_step_ms'] / replay_json[0]['step_ms'] - 1) * 100:+.1f}%",
               "met" if replay_json[0]["replay_step_ms"] <= 1.05 * replay_json[0]["step_ms"] else "missed")
    small = work[next(iter(REPLAY_CASES))]
    checks.add(f"the nuclei cost <= 5% of the B={LOGPROB_BATCH} draw they read (nuclei of at most 50, CPU time)",
               f"{small[1] / small[0] * 100:.1f}%", "met" if small[1] <= 0.05 * small[0] else "missed")
    print(write_results("sampling_costs", "python -m bench.sampling_costs", [table, modes, replays, checks],
                        {"rows": rows_json, "logprob_modes": logprob_json, "top_p_replay": replay_json},
                        f"Prompts of {PROMPT_TOKENS} tokens, one decode step per call."))


if __name__ == "__main__":
    main()
