"""One LoRA adapter as PEFT saves it (adapter_config.json + adapter_model.safetensors), read and checked against
the served model's LoRA targets (model/lora.py) before anything changes.

An adapter's tensors are `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r] under PEFT's
`base_model.model.` prefix; its config gives each module's rank and alpha (`rank_pattern`, `alpha_pattern`), and
its scaling alpha / r (alpha / sqrt(r) with `use_rslora`), as PEFT's own forward and merge apply it. The scaling is
folded into B here, so that a step multiplies by the adapter alone. What this engine does not run is refused by
name: DoRA, biases, modules_to_save, layer subsets, embedding adapters, targets that are not the model's LoRA
targets (--lora-target-modules), ranks past --max-lora-rank. Only safetensors are read: a pickled adapter
(adapter_model.bin) could run code when loaded.
"""

import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT config keys whose non-neutral value asks for what the batched LoRA does not compute.
UNSUPPORTED = {"use_dora": (None, False), "bias": (None, "none"), "modules_to_save": (None, []),
               "layers_to_transform": (None, []), "layers_pattern": (None, [], ""), "fan_in_fan_out": (None, False),
               "layer_replication": (None, []), "target_parameters": (None, []), "lora_bias": (None, False),
               "use_qalora": (None, False), "alora_invocation_tokens": (None, []),
               "trainable_token_indices": (None, [], {})}
TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_ids = itertools.count(1)


class AdapterRefused(ValueError):
    """An adapter this server cannot load; the message says why (and `not_found`: its path holds none)."""

    def __init__(self, message: str, not_found: bool = False):
        super().__init__(message)
        self.not_found = not_found


@dataclass(eq=False)  # an adapter is itself: two loads of the same files are two adapters
class LoraAdapter:
    """An adapter's weights per target module, in the model's dtype, on the host: (A [r, in], B [out, r] times the
    module's scaling). `id` is new for every load, so that a replaced adapter is never mistaken for its successor
    (the prefix cache's namespace, the device slots). The registry (engine/lora_registry.py) alone writes the rest."""

    name: str
    path: str  # where it was read from ("": tensors sent in a request)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    pinned: bool = False  # never unloaded to make room
    id: int = field(default_factory=lambda: next(_ids))
    users: int = 0  # requests the engine holds that run on it
    last_use: float = 0.0  # time.monotonic() when a request last named it (or it was loaded)
    retired: bool = False  # unloaded or replaced: no new request gets it

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())

    @property
    def bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_adapter_dir(name: str, path: str, targets: Mapping[str, tuple[int, int]], max_rank: int,
                     dtype: torch.dtype) -> LoraAdapter:
    """The adapter in a PEFT directory; `targets`: the model's LoRA target modules -> (in, out) features."""
    directory = Path(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise AdapterRefused(f"No adapter found at {path}: no {CONFIG_FILE} there", not_found=True)
    if not weights_file.is_file():
        pickled = " (adapter_model.bin is pickled, which this server does not read)" if (
            directory / "adapter_model.bin").is_file() else ""
        raise AdapterRefused(f"No adapter found at {path}: no {WEIGHTS_FILE} there{pickled}", not_found=True)
    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(weights_file)
    except (OSError, ValueError, SafetensorError) as exc:
        raise AdapterRefused(f"{path}: the adapter does not read: {exc}") from None
    return adapter_of(name, path, config, tensors, targets, max_rank, dtype)


def read_adapter_bytes(name: str, config: dict, safetensors: bytes, targets: Mapping[str, tuple[int, int]],
                       max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """An adapter sent as its config and the bytes of its safetensors file."""
    try:
        tensors = load_safetensors(safetensors)
    except (SafetensorError, ValueError) as exc:
        raise AdapterRefused(f"the adapter's tensors are not a safetensors file: {exc}") from None
    return adapter_of(name, "", config, tensors, targets, max_rank, dtype)


def _pattern_value(patterns: Mapping[str, float] | None, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def adapter_of(name: str, path: str, config: dict, tensors: Mapping[str, torch.Tensor],
               targets: Mapping[str, tuple[int, int]], max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """Check a PEFT config and its tensors against the model's targets; the adapter, its scaling folded into B."""
    where = path or name
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterRefused(f"{where}: peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for key, neutral in UNSUPPORTED.items():
        if config.get(key) not in neutral:
            raise AdapterRefused(f"{where}: {key} = {config[key]!r} is not supported by this server")
    try:
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError):
        raise AdapterRefused(f"{where}: {CONFIG_FILE} has no valid r") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = TENSOR_NAME.match(tensor_name)
        if match is None:
            raise AdapterRefused(f"{where}: tensor {tensor_name} is not a LoRA A or B weight (embedding adapters, "
                                 "DoRA magnitudes and saved modules are not supported)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise AdapterRefused(f"{where}: the adapter holds no tensor")
    weights = {}
    for module, pair in sorted(parts.items()):
        if module not in targets:
            raise AdapterRefused(f"{where}: it adapts {module}, which is not one of this server's LoRA targets "
                                 f"({_target_kinds(targets)}: --lora-target-modules)")
        if set(pair) != {"A", "B"}:
            raise AdapterRefused(f"{where}: {module} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        in_features, out_features = targets[module]
        module_rank = int(_pattern_value(config.get("rank_pattern"), module, rank))
        module_alpha = float(_pattern_value(config.get("alpha_pattern"), module, alpha))
        if a.shape != (module_rank, in_features) or b.shape != (out_features, module_rank):
            raise AdapterRefused(f"{where}: {module}'s lora_A is {list(a.shape)} and lora_B {list(b.shape)}; rank "
                                 f"{module_rank} over this model's {in_features} -> {out_features} needs "
                                 f"[{module_rank}, {in_features}] and [{out_features}, {module_rank}]")
        if module_rank > max_rank:
            raise AdapterRefused(f"{where}: rank {module_rank} ({module}) exceeds --max-lora-rank {max_rank}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterRefused(f"{where}: {module}'s tensors are not floating point")
        scaling = module_alpha / (math.sqrt(module_rank) if config.get("use_rslora") else module_rank)
        # Scaled in float32, then cast once: what PEFT's merge adds, W + scaling * B @ A, up to the last rounding.
        weights[module] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return LoraAdapter(name=name, path=path, weights=weights)


def _target_kinds(targets: Mapping[str, tuple[int, int]]) -> str:
    return ", ".join(sorted({module.rsplit(".", 1)[-1] for module in targets})) or "none"
