"""Hybrid linear attention (Qwen3.5's layer mix): decode steps, the prefix cache's checkpoints, and sessions in the
same memory as a full-attention model.

    python -m bench.hybrid      # about 10 minutes on 2 cores

A Qwen3.5-shaped mid-size random model (its real mix: three Gated DeltaNet layers to one full-attention layer, 8
layers, hidden 512, a 32000-token vocabulary), float32 on the CPU:
- a decode step of the engine against transformers' own forward with its cache, at a 1024-token context;
- n=8 samples of a 2048-token prompt, and a 10-turn session (each turn a new 128-token message and 32 tokens of
  answer), with the prefix cache and without: the tokens prefilled and the wall time;
and, from the shapes of the published configs alone (no weights): concurrent sessions at a 32k context in 24 GiB
(bf16) for Qwen3.5-9B and Qwen3-Next-80B-A3B against full-attention models of the same layers, each session
holding its pages (measured on the KV manager), its state slot and one checkpoint.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from bench.common import Progress, Table, fmt_bytes, fmt_ratio, fmt_time, write_results
from bench.family_decode import engine_step, transformers_step
from bench.in_process import InProcessSteps, random_prompt
from bench.kv_families import CHUNK, CONTEXT, MEMORY, PAGE, Session
from services.scheduler.kv.manager import KVManager
from services.scheduler.kv.specs import token_bytes
from services.scheduler.model.architecture import layout_of
from services.scheduler.model.runner import ModelRunner

VOCAB = 32000
MID = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
           linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=8192,
           eos_token_id=None)
PROMPT, SAMPLES, TURNS, MESSAGE, ANSWER = 2048, 8, 10, 128, 32


def linear_mix(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


# The attention part of the published configs.
SHAPES = {
    "Qwen3.5-9B": dict(num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=linear_mix(32)),
    "Qwen3-Next-80B-A3B": dict(num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=linear_mix(48)),
}


def prompt(seed: int, length: int) -> list[int]:
    return [token % VOCAB for token in random_prompt(seed, length)]


def timed(engine: InProcessSteps) -> float:
    start = time.perf_counter()
    engine.run()
    return time.perf_counter() - start


def samples(runner: ModelRunner, cache: bool) -> tuple[int, float]:
    """(prefill tokens, seconds) of n samples of one prompt, all submitted at once."""
    engine = InProcessSteps(runner, SAMPLES, prefill_budget=2048, prefix_cache=cache)
    ids = prompt(1, PROMPT)
    engine.add([engine.request(f"s{i}", ids, 4, temperature=1.0, seed=i) for i in range(SAMPLES)])
    seconds = timed(engine)
    return engine.policy.prefill_tokens, seconds


def session(runner: ModelRunner, cache: bool) -> tuple[int, float]:
    """(prefill tokens, seconds) of a session: each turn the conversation so far and a new message."""
    engine = InProcessSteps(runner, 1, prefill_budget=2048, prefix_cache=cache)
    conversation: list[int] = []
    seconds = 0.0
    for turn in range(TURNS):
        conversation += prompt(100 + turn, MESSAGE)
        request = engine.request(f"t{turn}", conversation, ANSWER)
        engine.add([request])
        seconds += timed(engine)
        conversation += request.output_ids
    return engine.policy.prefill_tokens, seconds


def sessions_at_32k(shape: dict, linear: bool) -> tuple[int, int, int]:
    """(sessions of CONTEXT tokens in MEMORY, pool bytes a session holds, state bytes a session holds: its slot and
    one checkpoint) for the shape, or for the same layers all full attention (`linear` False)."""
    fields = shape if linear else {**shape, "layer_types": ["full_attention"] * shape["num_hidden_layers"]}
    layout = layout_of("bench", PretrainedConfig(**fields), torch.bfloat16)
    page_bytes = token_bytes(layout.groups) * PAGE
    pages = MEMORY // page_bytes + 1
    kv = KVManager(pages, PAGE, layout.windows, prefix_cache=False)
    one = Session(CONTEXT)
    for end in range(CHUNK, CONTEXT + 1, CHUNK):
        kv.allocate(one, end)
        kv.computed(one, end, commit=False)
    session_bytes = (kv.pages.usable - kv.pages.free) * page_bytes
    state_bytes = 2 * layout.states.slot_bytes if layout.states is not None else 0
    return MEMORY // (session_bytes + state_bytes), session_bytes, state_bytes


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    progress = Progress(6, "hybrid")
    decode = Table("A decode step at 1024 tokens of context: the engine against transformers' forward",
                   ["B", "engine", "transformers", "ratio"], "The Qwen3.5-shaped mid-size model, float32 on the CPU.")
    cache = Table("The prefix cache with linear-attention state checkpoints",
                  ["workload", "prefill tokens: with the cache", "without", "wall: with", "without", "speed-up"],
                  f"n={SAMPLES} samples of a {PROMPT}-token prompt; a {TURNS}-turn session of {MESSAGE}-token "
                  f"messages and {ANSWER}-token answers. A checkpoint is taken at every page boundary a row reaches.")
    memory = Table(f"Sessions at a {CONTEXT // 1024}k context in {MEMORY // 2**30} GiB, bf16",
                   ["shape", "KV a session", "state a session", "sessions", "full attention: KV a session",
                    "sessions", "ratio"],
                   "State a session: its slot and one checkpoint of the linear-attention state (whatever its length).")
    data: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "qwen3_5-mid"
        torch.manual_seed(0)
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**MID)).save_pretrained(path)
        runner = ModelRunner(path, "cpu", "float32", 0, SAMPLES, max_total_tokens=SAMPLES * (PROMPT + 64))
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for batch in (1, 8):
            progress.step(f"decode B={batch}")
            ours, theirs = engine_step(runner, batch), transformers_step(reference, batch)
            data[f"decode_b{batch}"] = {"engine_s": ours, "transformers_s": theirs}
            decode.add(batch, fmt_time(ours), fmt_time(theirs), fmt_ratio(ours / theirs))
        for name, workload in (("samples", samples), ("session", session)):
            progress.step(name)
            (hit_tokens, hit_s), (miss_tokens, miss_s) = workload(runner, True), workload(runner, False)
            data[name] = {"prefill_tokens": hit_tokens, "seconds": hit_s, "uncached_prefill_tokens": miss_tokens,
                          "uncached_seconds": miss_s}
            cache.add(name, hit_tokens, miss_tokens, f"{hit_s:.1f} s", f"{miss_s:.1f} s", fmt_ratio(miss_s / hit_s))
    for name, shape in SHAPES.items():
        progress.step(name)
        (sessions, kv_bytes, state), (full, full_kv, _) = sessions_at_32k(shape, True), sessions_at_32k(shape, False)
        data[name] = {"sessions": sessions, "kv_bytes": kv_bytes, "state_bytes": state, "full_attention_sessions": full}
        memory.add(name, fmt_bytes(kv_bytes), fmt_bytes(state), sessions, fmt_bytes(full_kv), full,
                   fmt_ratio(sessions / full))
    print(write_results("hybrid", "python -m bench.hybrid", [decode, cache, memory], data))


if __name__ == "__main__":
    main()
