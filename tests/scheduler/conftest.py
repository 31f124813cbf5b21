"""Models the engine tests run on: the small vocabulary's (tests/conftest.py small_model_dir), the default model's
shape, and a second shape on the same vocabulary and tokenizer."""

import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from harness.checkpoints import TOKENIZER_FILES


@pytest.fixture(scope="session")
def gqa_model(small_model_dir, tmp_path_factory):
    """Random weights, 6 layers, 8 query heads over 2 KV heads of 16, the small vocabulary and its tokenizer."""
    path = tmp_path_factory.mktemp("gqa-model")
    vocabulary = AutoConfig.from_pretrained(small_model_dir)
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=vocabulary.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=vocabulary.eos_token_id,
                         pad_token_id=vocabulary.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (small_model_dir / name).exists():
            shutil.copy(small_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module", params=["default", "gqa"])
def model(request, small_model_dir, gqa_model):
    """"default": the default model's shape (on the small vocabulary); "gqa": gqa_model."""
    path = small_model_dir if request.param == "default" else gqa_model
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gqa(gqa_model):
    """The GQA model alone, for tests whose subject is not the model's shape (the engine's schedules)."""
    return gqa_model, AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32).eval()
