"""Models the engine tests run on."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM


@pytest.fixture(scope="module")
def gqa_model(model_dir, tmp_path_factory):
    """Random weights, 6 layers, 8 query heads over 2 KV heads of 16, the default model's vocabulary."""
    path = tmp_path_factory.mktemp("gqa-model")
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=248077, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=[248046, 248044], pad_token_id=248044)
    Qwen3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, path / name)
    return path


@pytest.fixture(scope="module", params=["default", "gqa"])
def model(request, model_dir, gqa_model):
    path = model_dir if request.param == "default" else gqa_model
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gqa(gqa_model):
    """The GQA model alone, for tests whose subject is not the model's shape (the engine's schedules)."""
    return gqa_model, AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32).eval()
