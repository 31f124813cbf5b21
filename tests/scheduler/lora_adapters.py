"""LoRA adapters for the tests, made by PEFT itself (get_peft_model, save_pretrained: adapter_config.json and
adapter_model.safetensors), and the reference each is checked against: PEFT's own merge of it into the base
model's weights (merge_and_unload)."""

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def peft_adapter(base_dir: Path, target: Path, seed: int, r: int, alpha: float, modules: list[str],
                 **config) -> Path:
    """A random adapter of the model at `base_dir` (B random too: init_lora_weights False), saved to `target`;
    `config`: LoraConfig's other fields (use_rslora, rank_pattern, ...)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    adapted = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=modules,
                                               init_lora_weights=False, **config))
    adapted.save_pretrained(target)
    return target


def merged(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """The base model with the adapter merged into its weights by PEFT, float32: the reference."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
