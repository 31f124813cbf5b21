"""Models for the engine benchmarks: the embedded default (a 248k vocabulary on 4 small layers: the vocabulary
dominates) and a mid-size random-weight Qwen3 on the same vocabulary, where the layers dominate (12 layers, hidden
768, 12 query heads over 4 KV heads of 64: 266M parameters). Built once into the flatwire cache; no download."""

import shutil
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.common.model_store import DEFAULT_CACHE_DIR, resolve_model

MID_NAME = "bench-qwen3-mid-v1"
MID_ARCHITECTURE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                        num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                        rope_theta=1_000_000.0)


def default_model() -> Path:
    return resolve_model(None)


def mid_model() -> Path:
    target = DEFAULT_CACHE_DIR / MID_NAME
    if (target / "config.json").is_file():
        return target
    source = default_model()
    staging = target.with_name(target.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    config = Qwen3Config.from_pretrained(source)
    for name, value in MID_ARCHITECTURE.items():
        setattr(config, name, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(20261201)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, staging / name)
    staging.rename(target)
    return target
