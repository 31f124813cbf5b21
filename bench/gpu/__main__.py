"""python -m bench.gpu [--smoke]: see bench/gpu/__init__.py."""

import argparse
import asyncio
import gc
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config

from bench.common import Progress, Table, fmt_ratio, write_results
from bench.e2e import run as run_e2e
from bench.e2e import start_up
from bench.e2e import tables as e2e_tables
from bench.gpu.engine import DeviceRates, decode_rows, overlap_rows, prefill_rows, transformers_rows
from services.common.memory import keep_big_blocks
from services.common.model_store import resolve_model
from services.scheduler.model.runner import ModelRunner

# Qwen3's published shapes (their config.json), with the default model's vocabulary.
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SEEDS_MODES = ("k=0", "k=128 flat base64")


def shape_dir(name: str, root: Path) -> Path:
    """A checkpoint directory of the shape without weights (--load-format dummy), the default model's tokenizer."""
    default = resolve_model(None)
    vocab = Qwen3Config.from_pretrained(default).vocab_size
    path = root / name
    Qwen3Config(vocab_size=vocab, max_position_embeddings=40960, rope_theta=1_000_000, rms_norm_eps=1e-6,
                eos_token_id=[248046, 248044], pad_token_id=248044, **SHAPES[name]).save_pretrained(path)
    for file in TOKENIZER_FILES:
        if (default / file).exists():
            shutil.copy(default / file, path / file)
    return path


def load(path: Path, max_batch: int, context: int, device: torch.device) -> ModelRunner:
    return ModelRunner(path, str(device), "bfloat16" if device.type == "cuda" else "float32", 0, max_batch,
                       max_total_tokens=max_batch * (context + 256), attention_backend="triton",
                       cuda_graph_max_bs=max_batch, load_format="dummy")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts, on the CPU (the CI test): "
                        "every part runs once, no figure means anything")
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-8b"], choices=sorted(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--context", type=int, default=512, help="tokens each decoding request holds")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per row")
    parser.add_argument("--prefill", type=int, nargs=2, default=[8, 2048], metavar=("PROMPTS", "TOKENS"))
    parser.add_argument("--generate-batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--serving-shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--single-tokens", type=int, nargs="+", default=[160, 1000])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the single requests (their median)")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.serving_shape, args.batches, args.context, args.steps = ["smoke"], "smoke", [1, 3], 24, 2
        args.prefill, args.generate_batches, args.single_tokens, args.concurrency = [2, 20], [2], [6], 2
        args.rounds = 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        keep_big_blocks()
    rounds = args.rounds
    progress = Progress(1 + 4 * len(args.shapes) + (rounds * len(args.single_tokens) + 1) * len(SEEDS_MODES), "gpu")
    rates = DeviceRates.measure(device, 0.01 if args.smoke else 4.0, 256 if args.smoke else 8192)
    progress.step(f"copy {rates.copy_bytes_per_s / 1e9:.0f} GB/s, matmul {rates.matmul_flops / 1e12:.3g} TFLOP/s")
    decode, overlap, prefill, generate = [], [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for shape in args.shapes:
            runner = load(shape_dir(shape, Path(scratch)), max(args.batches), args.context, device)
            progress.step(f"{shape} loaded")
            decode += decode_rows(runner, shape, args.batches, args.context, args.steps, rates)
            overlap += overlap_rows(runner, shape, [b for b in args.batches if b > 1][-2:], args.context,
                                    args.steps)
            progress.step(f"{shape} decode, overlap")
            prefill += prefill_rows(runner, shape, *args.prefill)
            progress.step(f"{shape} prefill")
            generate += transformers_rows(runner, shape, args.generate_batches, args.context, args.steps)
            progress.step(f"{shape} transformers generate")
            del runner
            gc.collect()  # the runner and its graphs refer to each other: freed by the collector, not at del
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the scheduler that flatwire up starts below needs the memory
        options = ("--load-format", "dummy", "--attention-backend", "triton", "--max-running-requests",
                   str(max(64, args.concurrency)), "--max-total-tokens", str(max(64, args.concurrency) * 2048))
        if device.type == "cuda":
            options += ("--enable-cuda-graph", "--cuda-graph-max-bs", str(max(64, args.concurrency)))
        up, pids = start_up(model=shape_dir(args.serving_shape, Path(scratch)), options=options)
        try:
            serving = asyncio.run(run_e2e(up.http_url, pids, args.single_tokens, [rounds] * len(args.single_tokens),
                                          args.concurrency, args.single_tokens[-1], progress, modes=SEEDS_MODES))
        finally:
            up.stop()
    serving_tables, serving_data = e2e_tables(serving)
    tables = report(rates, decode, overlap, prefill, generate) + serving_tables
    data = {"rates": vars(rates), "decode": [vars(r) for r in decode], "overlap": [vars(r) for r in overlap],
            "prefill": [vars(r) for r in prefill],
            "generate": [vars(r) for r in generate], "serving": serving_data}
    command = " ".join(["python -m bench.gpu", *(sys.argv[1:] if argv is None else argv)])
    notes = (f"Device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'none (CPU)'}. "
             "Random weights (--load-format dummy); decode requests placed at their context with zero KV.")
    print(write_results("gpu-smoke" if args.smoke else "gpu", command, tables, data, notes))


def report(rates: DeviceRates, decode, overlap, prefill, generate) -> list[Table]:
    decode_table = Table("Decode steps (the engine's whole step)", [
        "shape", "B", "k", "attention", "step ms", "tokens/s", "floor ms", "step / floor", "vs transformers"],
        f"Floor: weights and the batch's KV read once per step at the copy bandwidth measured "
        f"({rates.copy_bytes_per_s / 1e9:.0f} GB/s).")
    baseline = {(g.shape, g.batch): g for g in generate}
    for row in decode:
        base = baseline.get((row.shape, row.batch))
        decode_table.add(row.shape, row.batch, row.k, row.mode, f"{row.step_s * 1e3:.2f}", f"{row.tokens_per_s:,.0f}",
                         f"{row.floor_s * 1e3:.2f}", fmt_ratio(row.step_s / row.floor_s),
                         fmt_ratio(row.tokens_per_s / base.tokens_per_s) if base else "-")
    overlap_table = Table("The engine's loop, overlap schedule off and on", [
        "shape", "B", "k", "pass ms, off", "pass ms, on", "on / off"],
        "One pass: a decode step and its output message, built and encoded to the wire.")
    for off, on in zip(overlap[::2], overlap[1::2]):
        overlap_table.add(off.shape, off.batch, off.k, f"{off.step_s * 1e3:.2f}", f"{on.step_s * 1e3:.2f}",
                          f"{on.step_s / off.step_s:.3f}")
    prefill_table = Table("Prefill steps", ["shape", "prompts x tokens", "attention", "step ms", "tokens/s",
                                            "TFLOP/s", "of the matmul rate"],
                          f"Matmul rate measured: {rates.matmul_flops / 1e12:.3g} TFLOP/s.")
    for p in prefill:
        prefill_table.add(p.shape, f"{p.prompts} x {p.prompt_tokens}", p.mode, f"{p.step_s * 1e3:.1f}",
                          f"{p.tokens_per_s:,.0f}", f"{p.flops / p.step_s / 1e12:.3g}",
                          f"{p.flops / p.step_s / rates.matmul_flops:.0%}")
    generate_table = Table("transformers generate, static cache (the baseline)", ["shape", "B", "step ms",
                                                                                   "tokens/s"])
    for g in generate:
        generate_table.add(g.shape, g.batch, f"{g.decode_s * 1e3:.2f}", f"{g.tokens_per_s:,.0f}")
    return [decode_table, overlap_table, prefill_table, generate_table, targets(decode, generate)]


def targets(decode, generate) -> Table:
    checks = Table("Targets (issue 22)", ["target", "measured", "verdict"])

    def find(shape: str, batch: int, k: int, mode: str):
        return next((r for r in decode if (r.shape, r.batch, r.k, r.mode) == (shape, batch, k, mode)), None)

    best = "triton + graphs" if any(r.mode == "triton + graphs" for r in decode) else "triton"
    big = find("qwen3-8b", 128, 0, best)
    if big:
        checks.add("8B decode at B=128 within 1.5x of the floor", fmt_ratio(big.step_s / big.floor_s),
                   "met" if big.step_s <= 1.5 * big.floor_s else "missed")
        base = next((g for g in generate if (g.shape, g.batch) == ("qwen3-8b", 128)), None)
        if base:
            ratio = big.tokens_per_s / base.tokens_per_s
            checks.add("8B decode at B=128 >= 3x transformers generate", fmt_ratio(ratio),
                       "met" if ratio >= 3 else "missed")
        flat = find("qwen3-8b", 128, 128, best)
        if flat:
            cost = flat.step_s / big.step_s - 1
            checks.add("k=128 within 3% of k=0 at B=128", f"{cost:+.1%}", "met" if cost <= 0.03 else "missed")
    one = find("qwen3-8b", 1, 0, "triton + graphs")
    if one:
        checks.add("graphs on: 8B B=1 step within 1.3x of the floor", fmt_ratio(one.step_s / one.floor_s),
                   "met" if one.step_s <= 1.3 * one.floor_s else "missed")
    return checks


if __name__ == "__main__":
    main()
