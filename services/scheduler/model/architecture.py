"""What the engine reads of a model's config: the kind of memory each of its layers keeps (kv/specs.py), grouped,
and a refusal, at load and by name, of what it does not implement."""

import torch

from services.scheduler.kv.specs import FullAttention, LayerGroup


class UnsupportedModel(ValueError):
    """A checkpoint the engine cannot run: the message names the model, the feature, and what is supported."""


def layer_groups(name: str, text_config, dtype: torch.dtype) -> list[LayerGroup]:
    """The model's decoder layers grouped by the KV memory they keep, stored in `dtype`."""
    layers = int(text_config.num_hidden_layers)
    layer_types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * layers)
    if unknown := sorted(set(layer_types) - {"full_attention"}):
        raise UnsupportedModel(f"{name}: layer type {', '.join(unknown)} is not supported; this engine runs "
                               "full_attention layers")
    heads = int(text_config.num_attention_heads)
    head_dim = getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    return [LayerGroup(FullAttention(kv_heads, int(head_dim), dtype), tuple(range(layers)))]
