"""Checkpoints for the tests: the default model on a small vocabulary (the engine tests), the default model with
seeded noise on some layers (weight updates), and small random Mixture-of-Experts, Qwen3-Next (linear attention,
experts) and DeepSeek V3 (latent attention, experts) models on a given model's vocabulary; each beside its
tokenizer."""

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from services.common import default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# The small vocabulary's ordinary tokens: ids below it are Qwen's first byte-pair ranks (the 256 bytes first), its
# 33 special tokens follow (<|im_end|> at SMALL_VOCABULARY + 2).
SMALL_VOCABULARY = 4096


def small_vocabulary_checkpoint(target: Path) -> Path:
    """The default model's architecture and tokenizer on a vocabulary of SMALL_VOCABULARY tokens and the special
    ones (services/common/default_model.py's `ranks`), random weights from its seed, saved to `target`; `target`.
    The default model is 99% embedding: at every step its 248k rows go through lm_head, log-softmax and top-k,
    which is what an engine test on it spends its time on. Any text still encodes, in more tokens."""
    default_model.build(target, ranks=SMALL_VOCABULARY)
    return target


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
    _copy_tokenizer(model_dir, target)
    return target


def moe_checkpoint(model_dir: Path, target: Path, seed: int = 7) -> Path:
    """A random Qwen3-MoE of 3 decoder layers (8 experts, 2 per token; layer 1 dense, as mlp_only_layers make it)
    on the vocabulary and tokenizer of `model_dir` (the default model's, or the small one's), saved to `target`;
    `target`."""
    vocabulary = AutoConfig.from_pretrained(model_dir)
    config = Qwen3MoeConfig(
        vocab_size=vocabulary.vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=vocabulary.eos_token_id, pad_token_id=vocabulary.pad_token_id)
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).save_pretrained(target)
    _copy_tokenizer(model_dir, target)
    return target


def qwen3_next_checkpoint(model_dir: Path, target: Path, seed: int = 11) -> Path:
    """A random Qwen3-Next of 4 decoder layers (3 Gated DeltaNet, 1 gated full attention; 4 experts, 2 per token,
    and a shared expert) on the vocabulary and tokenizer of `model_dir`, saved to `target`; `target`."""
    return _on_vocabulary(model_dir, target, seed, lambda vocabulary: Qwen3NextForCausalLM(Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, **vocabulary)))


def deepseek_v3_checkpoint(model_dir: Path, target: Path, seed: int = 13) -> Path:
    """A random DeepSeek V3 of 3 decoder layers (multi-head latent attention; a dense first layer, then 8 grouped
    experts, 2 per token, and a shared one) on the vocabulary and tokenizer of `model_dir`, saved to `target`;
    `target`."""
    return _on_vocabulary(model_dir, target, seed, lambda vocabulary: DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, **vocabulary)))


def _on_vocabulary(model_dir: Path, target: Path, seed: int, build: Callable[[dict], PreTrainedModel]) -> Path:
    """`build(vocabulary)`'s random model (seeded), on `model_dir`'s vocabulary (its size, eos and pad ids, tied
    embeddings, a 4096-token context), saved to `target` with `model_dir`'s tokenizer; `target`."""
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    build(dict(vocab_size=config.vocab_size, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
               tie_word_embeddings=True, max_position_embeddings=4096)).save_pretrained(target)
    _copy_tokenizer(model_dir, target)
    return target


def _copy_tokenizer(model_dir: Path, target: Path) -> None:
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, target / name)
