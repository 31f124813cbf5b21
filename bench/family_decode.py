"""A decode step per model family, the engine against transformers' own forward with its cache.

    python -m bench.family_decode      # about 10 minutes on 2 cores

Each family as a mid-size random model of its own architecture (8 layers, hidden 512, 8 query heads over 2 KV
heads of 64, a 32000-token vocabulary; windows of 256 where the family has them, so that a 1024-token context
reaches past them; gpt-oss with sinks and 8 experts, DeepSeek V3 with its latent and 8 experts), float32 on the CPU.
The engine: the median seconds of a decode step of B requests placed at the context (bench/in_process.py, the
scheduler's policy, KV manager and model step). transformers: the median seconds of a greedy decode step of its
model's forward over the same B prompts, prefilled, with its own cache (DynamicCache; sliding layers keep their
window).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
)

from bench.common import Progress, Table, fmt_ratio, fmt_time, write_results
from bench.decode_context import STEPS, decode_step
from bench.in_process import random_prompt
from services.scheduler.model.runner import ModelRunner

CONTEXT, BATCHES, WINDOW = 1024, (1, 8), 256
COMMON = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, eos_token_id=None)
SLIDING_THEN_FULL = (["sliding_attention"] * 3 + ["full_attention"]) * 2
FAMILIES = {
    "Llama (full attention)": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "Mistral (every layer windowed)": lambda: MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **COMMON)),
    "Gemma 3 (3 windowed : 1 full)": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        sliding_window=WINDOW, query_pre_attn_scalar=64, layer_types=SLIDING_THEN_FULL, **COMMON)),
    "OLMo 3 (3 windowed : 1 full)": lambda: Olmo3ForCausalLM(Olmo3Config(
        sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, **COMMON)),
    "gpt-oss (alternating, sinks, MoE)": lambda: GptOssForCausalLM(GptOssConfig(
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 4, num_local_experts=8,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        **{**COMMON, "intermediate_size": 512})),
    "DeepSeek V3 (MLA, MoE)": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        moe_intermediate_size=512, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=64, **{**COMMON, "num_key_value_heads": 8, "head_dim": 32})),
}


def prompt(seed: int, length: int = CONTEXT) -> list[int]:
    return [token % COMMON["vocab_size"] for token in random_prompt(seed, length)]


def engine_step(runner: ModelRunner, batch: int) -> float:
    """Median seconds of a decode step of `batch` requests at CONTEXT tokens (bench.decode_context's step)."""
    return decode_step(runner, [CONTEXT] * batch, prompt)


@torch.inference_mode()
def transformers_step(model, batch: int) -> float:
    """The median seconds of a greedy decode step of transformers' own forward with its own cache (DynamicCache),
    the B prompts prefilled first."""
    prompts = torch.tensor([prompt(i) for i in range(batch)])
    out = model(input_ids=prompts, use_cache=True)
    cache, seconds = out.past_key_values, []
    for _ in range(STEPS + 1):  # the first step untimed, as the engine's
        start = time.perf_counter()
        out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    progress = Progress(len(FAMILIES), "family_decode")
    table = Table(f"A decode step at {CONTEXT} tokens of context: the engine against transformers' forward",
                  ["family", *[f"B={b}: engine, transformers, ratio" for b in BATCHES]],
                  "Mid-size random models of each architecture, float32 on the CPU; median of "
                  f"{STEPS} steps each, after one untimed.")
    data = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, make in FAMILIES.items():
            progress.step(name)
            torch.manual_seed(0)
            path = Path(scratch) / "model"
            make().save_pretrained(path)
            runner = ModelRunner(path, "cpu", "float32", 0, max(BATCHES),
                                 max_total_tokens=max(BATCHES) * (CONTEXT + 64))
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cells = []
            for batch in BATCHES:
                ours, theirs = engine_step(runner, batch), transformers_step(reference, batch)
                data[f"{name} B={batch}"] = {"engine_s": ours, "transformers_s": theirs}
                cells.append(f"{fmt_time(ours)}, {fmt_time(theirs)}, {fmt_ratio(ours / theirs)}")
            table.add(name, *cells)
            del runner, reference
    print(write_results("family_decode", "python -m bench.family_decode", [table], data))


if __name__ == "__main__":
    main()
