"""What the engine reads of a model's config: the kind of memory each of its layers keeps (kv/specs.py), grouped,
and a refusal, at load and by name, of what it does not implement.

A model with multi-head latent attention (a `kv_lora_rank`: DeepSeek V3, Kimi K2) keeps its latent (model/mla.py).
A `linear_attention` layer (Qwen3.5, Qwen3-Next: Gated DeltaNet) keeps a state per request
(model/linear_attention.py). Otherwise a layer attends fully or within a sliding window as transformers' own
forward does: by `layer_types` where the
config has them (Gemma 3, OLMo 3, gpt-oss, Qwen2/3 with use_sliding_window), else every layer within
`sliding_window` where that is set (Mistral, Mixtral, Phi-3, Starcoder2 pass it to every layer). The attention
checks, at every layer, that the window transformers passes is the one its memory keeps (model/attention.py), and
the model runner runs a first step at load, so that a model read otherwise fails at start.
"""

import json
import re
from collections import Counter
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.scheduler.kv.specs import AttentionSpec, KVLayout, LayerSpec, MLASpec, RecurrentSpec, kv_layout
from services.scheduler.model.gated_delta_kernels import GatedDeltaKernels

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# Config fields whose feature the engine does not implement, and what it is: the model is refused when one is set.
UNSUPPORTED_FIELDS = {
    "attn_logit_softcapping": "attention logit soft-capping (Gemma 2)",
    "final_logit_softcapping": "final logit soft-capping (Gemma 2)",
    "logit_scale": "scaled logits (Cohere)",
    "logits_scaling": "scaled logits (Granite)",
    "index_topk": "sparse attention (DeepSeek V3.2's indexer)",
}
NEUTRAL = (None, 1, 1.0)


class UnsupportedModel(ValueError):
    """A checkpoint the engine cannot run: the message names the model, the feature, and what is supported."""


def load_config(model_dir: Path) -> PretrainedConfig:
    """The checkpoint's config. One whose model type transformers does not know is read by the config class of an
    architecture it names that transformers has: Kimi K2's `kimi_k2`, published for remote code, is DeepSeek V3's
    (`DeepseekV3ForCausalLM`). It then takes that class's model type, under which transformers converts the
    checkpoint's weights as it loads them (DeepSeek V3's experts, one tensor each in the checkpoint, are fused):
    under an unknown type they would be missing, and initialized at random."""
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError) as exc:
        try:
            raw = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            raise UnsupportedModel(f"{model_dir}: its config.json does not load: {exc}") from None
        for architecture in raw.get("architectures") or []:
            if (config_class := getattr(getattr(transformers, architecture, None), "config_class", None)) is not None:
                config = config_class.from_pretrained(model_dir)
                config.model_type = config_class.model_type
                return config
        raise UnsupportedModel(f"{model_dir}: model type {raw.get('model_type')!r} is not one transformers "
                               f"{transformers.__version__} knows, nor is any of its architectures "
                               f"({', '.join(raw.get('architectures') or []) or 'none'})") from None


def unused_tensors(model_dir: Path, model: torch.nn.Module) -> dict[str, int]:
    """The checkpoint's tensors the model's class declares it leaves unloaded (transformers'
    _keys_to_ignore_on_load_unexpected: Qwen3.5's and Qwen3-Next's multi-token-prediction layers, a vision tower the
    text model does not use), counted by pattern, so that the log says what is skipped."""
    patterns = list(getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or [])
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        names = [name for file in sorted(Path(model_dir).glob("*.safetensors"))
                 for name in safe_open(str(file), "pt").keys()]
    counts = {pattern: sum(1 for name in names if re.search(pattern, name)) for pattern in patterns}
    return {pattern: count for pattern, count in counts.items() if count}


def check_supported(name: str, config) -> None:
    """Refuse a config (raw dict or transformers config) that asks for what the engine does not implement."""
    fields = config if isinstance(config, dict) else config.to_dict()
    for key, feature in UNSUPPORTED_FIELDS.items():
        if fields.get(key) not in NEUTRAL:
            raise UnsupportedModel(f"{name}: {feature} ({key} = {fields[key]}) is not supported by this engine")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    # One set of parameters, or one per layer type (Gemma 3's).
    for parameters in rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]:
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedModel(f"{name}: rope type {rope_type!r} is not supported; supported: default, "
                                   f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")


def layer_specs(name: str, text_config, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                tp_size: int = 1) -> list[LayerSpec]:
    """What each decoder layer keeps: its pages (keys and values, a latent) stored in `kv_dtype` (--kv-cache-dtype;
    None: `dtype`), a linear-attention layer's state in `dtype` (as SGLang's --kv-cache-dtype leaves that state's
    dtype alone: an 8-bit recurrent state would round again at every step). With `tp_size` ranks, one rank's: its
    share of the KV heads (parallel/sharding.py)."""
    check_supported(name, text_config)
    layers = int(text_config.num_hidden_layers)
    pages = kv_dtype or dtype
    if latent := getattr(text_config, "kv_lora_rank", None):  # DeepSeek V3, Kimi K2: model/mla.py
        if int(text_config.num_attention_heads) % tp_size:
            raise UnsupportedModel(f"{name}: --tp-size {tp_size} does not divide its "
                                   f"{text_config.num_attention_heads} attention heads: each rank keeps whole heads")
        # Under --tp-size every rank keeps the whole latent: every head attends to it (SGLang's MLA does the same).
        return [MLASpec(int(latent), int(text_config.qk_rope_head_dim), pages)] * layers
    window = getattr(text_config, "sliding_window", None) or 0
    layer_types = list(getattr(text_config, "layer_types", None) or
                       ["sliding_attention" if window else "full_attention"] * layers)
    if unknown := sorted(set(layer_types) - set(LAYER_TYPES)):
        raise UnsupportedModel(f"{name}: layer type {', '.join(unknown)} is not supported; this engine runs "
                               f"{', '.join(LAYER_TYPES)} layers")
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedModel(f"{name}: sliding_attention layers, but no sliding_window in the config")
    heads = int(text_config.num_attention_heads)
    head_dim = int(getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    if heads % tp_size or kv_heads % tp_size:
        raise UnsupportedModel(f"{name}: --tp-size {tp_size} does not divide its {heads} attention heads and "
                               f"{kv_heads} KV heads: each rank keeps whole heads")
    attention: dict[str, LayerSpec] = {
        kind: AttentionSpec(kv_heads // tp_size, head_dim, pages, window if kind == "sliding_attention" else 0)
        for kind in ("full_attention", "sliding_attention")}
    if "linear_attention" in layer_types:
        if getattr(text_config, "linear_num_key_heads", None) is None:
            raise UnsupportedModel(f"{name}: linear_attention layers that are not Gated DeltaNet (Qwen3.5's, "
                                   "Qwen3-Next's): the only linear attention this engine runs")
        # Whole on every rank under --tp-size (transformers' plans keep these layers whole): the state too.
        attention["linear_attention"] = gated_delta_spec(text_config, dtype)
    return [attention[kind] for kind in layer_types[:layers]]


def gated_delta_spec(text_config, dtype: torch.dtype) -> RecurrentSpec:
    """A Gated DeltaNet layer's state (Qwen3.5, Qwen3-Next: model/linear_attention.py)."""
    key_heads, key_dim = int(text_config.linear_num_key_heads), int(text_config.linear_key_head_dim)
    value_heads, value_dim = int(text_config.linear_num_value_heads), int(text_config.linear_value_head_dim)
    return RecurrentSpec(conv_dim=2 * key_heads * key_dim + value_heads * value_dim,
                         conv_width=int(text_config.linear_conv_kernel_dim) - 1, heads=value_heads, key_dim=key_dim,
                         value_dim=value_dim, dtype=dtype)


def layout_of(name: str, text_config, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
              tp_size: int = 1) -> KVLayout:
    """The model's decoder layers laid out by the memory they keep (layer_specs' dtypes and ranks)."""
    return kv_layout(layer_specs(name, text_config, dtype, kv_dtype, tp_size))


def route_layers(name: str, model: torch.nn.Module, layout: KVLayout, attention_backend: str,
                 linear_kernels: GatedDeltaKernels) -> None:
    """Route the layers that keep more than keys and values through the KV pool: MLA layers through their latent
    cache (model/mla.py), linear-attention layers through their state slots (model/linear_attention.py), computed
    by `linear_kernels`."""
    from services.scheduler.model.linear_attention import use_paged_state
    from services.scheduler.model.mla import use_latent_cache

    if layout.groups and isinstance(layout.groups[0].spec, MLASpec):
        if attention_backend != "torch":
            raise UnsupportedModel(f"{name}: --attention-backend {attention_backend} does not run multi-head latent "
                                   "attention yet; use --attention-backend torch")
        if use_latent_cache(model) != sum(len(group.layers) for group in layout.groups):
            raise UnsupportedModel(f"{name}: a kv_lora_rank, but not every layer is DeepSeek V3's latent attention")
    if layout.states is not None and use_paged_state(model, linear_kernels) != len(layout.states.layers):
        raise UnsupportedModel(f"{name}: linear_attention layers that are not Gated DeltaNet (Qwen3.5's, "
                               "Qwen3-Next's): the only linear attention this engine runs")
    if not layout.groups:
        raise UnsupportedModel(f"{name}: no attention layer: this engine keeps KV pages for at least one")


def describe(layout: KVLayout) -> str:
    """The layers by kind, for logs and refusals: "24 layers: 12 full attention, 12 sliding window 128"."""
    kinds: Counter[str] = Counter()
    if layout.states is not None:
        kinds["linear attention"] = len(layout.states.layers)
    for group in layout.groups:
        if isinstance(group.spec, MLASpec):
            kind = f"latent attention ({group.spec.latent_dim} + {group.spec.rope_dim} a token)"
        else:
            kind = f"sliding window {group.window}" if group.window else "full attention"
        kinds[kind] += len(group.layers)
    return f"{sum(kinds.values())} layers: " + ", ".join(f"{count} {kind}" for kind, count in kinds.items())
