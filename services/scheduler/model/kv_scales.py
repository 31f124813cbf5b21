"""A checkpoint's per-tensor KV cache scales, taken as SGLang and vLLM take them for an 8-bit KV cache.

Checkpoints calibrated for an fp8 KV cache (llm-compressor, ModelOpt, Quark) carry one scalar per attention layer for
its keys and one for its values, under the names vLLM's and SGLang's `maybe_remap_kv_scale_name` accepts:
`model.layers.N.self_attn.k_scale` and `.v_scale`; ModelOpt's `self_attn.k_proj.k_scale` and
`self_attn.v_proj.v_scale`; a deprecated `self_attn.kv_scale` for both (any prefix before `layers.N`, and vLLM's own
`self_attn.attn.` form, are accepted too). As their `BaseKVCacheMethod.process_weights_after_loading`: a layer with
only one of the two uses it for both, a non-positive one counts as absent (their -1 means "not in the checkpoint"),
and a layer with neither, or a model with none, reads and writes its KV at 1.0 (values beyond the format's largest,
448 for e4m3 and 57344 for e5m2, are clamped). Only per-tensor scales: a scale of several values is refused. With
--kv-cache-dtype auto the scales are not read (as theirs: 1.0). transformers' loader does not know these tensors and
leaves them out of the model, so they are read here from the checkpoint's safetensors.
"""

import logging
import re
from pathlib import Path

from safetensors import safe_open

from services.scheduler.kv.quantize import KVScales
from services.scheduler.model.architecture import UnsupportedModel

log = logging.getLogger(__name__)

SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?(k|v|kv)_scale$")


def read_kv_scales(model_dir: Path, layers: int) -> list[KVScales]:
    """Each of the model's `layers` decoder layers' scales, from the checkpoint's safetensors in `model_dir`."""
    found: dict[int, dict[str, float]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                match = SCALE_NAME.search(name)
                if match is None or int(match[1]) >= layers:
                    continue
                scale = reader.get_tensor(name)
                if scale.numel() != 1:
                    raise UnsupportedModel(f"{model_dir}: {name} holds {scale.numel()} scales; an 8-bit KV cache "
                                           "takes one per tensor (per-tensor k_scale and v_scale, as SGLang)")
                if float(scale) > 0:
                    found.setdefault(int(match[1]), {})[match[2]] = float(scale)
    if found:
        log.info("--kv-cache-dtype: the checkpoint's k_scale and v_scale for %d of %d layers%s", len(found), layers,
                 "" if len(found) == layers else ", 1.0 for the others")
    else:
        log.info("--kv-cache-dtype: no k_scale or v_scale in the checkpoint: every layer's are 1.0")
    return [_layer_scales(found.get(layer, {})) for layer in range(layers)]


def _layer_scales(found: dict[str, float]) -> KVScales:
    """A layer's scales from what its checkpoint names: k, v, or kv for both; one of k and v serves for both."""
    key = found.get("k") or found.get("kv") or found.get("v", 1.0)
    value = found.get("v") or found.get("kv") or found.get("k", 1.0)
    return KVScales(key, value)
