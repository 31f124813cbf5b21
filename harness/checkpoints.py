"""Checkpoints for weight updates: the default model with seeded noise on some layers, beside its tokenizer."""

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def perturbed_checkpoint(model_dir: Path, target: Path, seed: int, layers: Sequence[str] = (".layers.",),
                         scale: float = 0.05) -> Path:
    """The model (float32) with `scale` x standard-normal noise, drawn from `seed`, added to every parameter whose
    name holds one of `layers`, saved to `target` with the model's tokenizer files; `target`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(layer in name for layer in layers):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, target / name)
    return target
