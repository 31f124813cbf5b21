"""Weight updates in place: read a checkpoint, check it against the served model, stage it, swap it in.

A checkpoint is a local Hugging Face directory (UpdateWeightsFromDisk), the bytes of one
safetensors file (PushWeights, any subset of the model's tensors) or tensors a trainer broadcasts
(UpdateWeightsFromDistributed, weight_sync.py). Everything that can fail
happens before the swap, off the engine thread: the config (architecture and sizes), the
vocabulary files and every tensor's name, shape and kind are checked against the served model,
and each tensor is copied into a new one of its parameter's dtype, device and layout. The engine
thread then only points each parameter at its staged tensor (StagedWeights.install), between two
steps: in-flight requests wait one step boundary, not the copy. The price is room for a second
copy of the updated tensors while an update is staged. With --tp-size, each rank keeps its cut of every full
tensor (parallel/sharding.py), and rank 0's install tells the others how to stage and install theirs.

Only safetensors are read: a pickled checkpoint (.bin, .pt) could run code when loaded.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors

from services.scheduler.model.architecture import load_config
from services.scheduler.parallel.calls import FromDisk, FromSafetensors, FromTensors, Install, RankUpdate
from services.scheduler.parallel.sharding import Sharding

if TYPE_CHECKING:
    from services.scheduler.parallel.group import RankGroup

# Config keys that do not change what the weights mean: where the config was saved from, by which
# version, and the dtype it was saved in (every tensor is cast to the served dtype).
IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype"})
# The files that define the token ids: a checkpoint that brings any must bring the served ones.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
# tokenizer.json's parts that map text to ids (formatting and the other keys may differ between versions).
TOKENIZER_JSON_KEYS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_tokenizer", "decoder")
LOAD_FORMATS = ("", "auto", "safetensors")
# A pushed file holds at most the model in float32 plus its JSON header.
MAX_HEADER_BYTES = 64 * 1024 * 1024
SHOWN = 4  # differences named in a refusal; the rest are counted


class WeightsRefused(Exception):
    """A checkpoint that cannot replace the served weights; the message says why."""


@dataclass
class StagedWeights:
    """Checked tensors in their parameters' dtype, device and layout, ready to swap in."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (served parameter or buffer, its replacement)
    description: str  # what was read, for the reply
    complete: bool = False  # it replaces every tensor of the model
    source: Path | None = None  # the checkpoint directory it was read from (None: pushed or broadcast)
    # With --tp-size, rank 0's: how the other ranks stage their part of the same update, and those ranks.
    parts: tuple[RankUpdate, ...] = ()
    ranks: "RankGroup | None" = None

    def install(self) -> None:
        """Engine thread, between steps: point every parameter at its new tensor (no copy), on every rank."""
        if self.ranks is not None:
            self.ranks.tell(Install(self.parts))
        self.install_here()

    def install_here(self) -> None:
        """This rank's tensors alone (each rank resumes its own: model/occupation.py)."""
        with torch.no_grad():
            for served, new in self.pairs:
                served.data = new


def listed(items: list[str]) -> str:
    """The first SHOWN items, and how many more."""
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _config_of(path: Path) -> dict:
    try:
        config = load_config(path).to_dict()
    except (OSError, ValueError, KeyError) as exc:
        raise WeightsRefused(f"{path}: its config.json does not load: {exc}") from None
    return {key: value for key, value in config.items() if key not in IGNORED_CONFIG_KEYS}


def _generation_eos(path: Path) -> list[int] | None:
    """generation_config.json's eos ids, None without that file or key."""
    file = path / "generation_config.json"
    eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    return None if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _same_vocabulary_file(served: Path, new: Path) -> bool:
    if served.read_bytes() == new.read_bytes():
        return True
    if served.name != "tokenizer.json":
        return False
    ours, theirs = json.loads(served.read_text()), json.loads(new.read_text())
    return all(ours.get(key) == theirs.get(key) for key in TOKENIZER_JSON_KEYS)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        raise WeightsRefused(f"{path}: no safetensors weights" + (
            f" (only {listed(pickled)}: pickled checkpoints are not loaded, they could run code; save with "
            "safe_serialization)" if pickled else ""))
    return files


class ServedWeights:
    """The served model's tensors by checkpoint name, and what a replacement must match."""

    def __init__(self, model: torch.nn.Module, model_dir: Path, eos_token_ids: list[int],
                 sharding: Sharding | None = None, ranks: "RankGroup | None" = None):
        """`sharding`: this tensor-parallel rank's cut of the tensors (each full tensor a replacement brings is cut
        to it); `ranks`: on rank 0, the other ranks, which each update is installed on too."""
        self._tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.sharding = sharding
        self.ranks = ranks
        self._shapes = {name: sharding.full_shape(name, tensor.shape) if sharding else tensor.shape
                        for name, tensor in self._tensors.items()}
        self.model_dir = model_dir
        self._config = _config_of(model_dir)
        self._eos_token_ids = eos_token_ids
        # A tensor under several names (tied embeddings: lm_head.weight is model.embed_tokens.weight) is
        # provided by any one of them.
        names: dict[int, list[str]] = {}
        for name, tensor in self._tensors.items():
            names.setdefault(id(tensor), []).append(name)
        self._names_per_tensor = list(names.values())
        self.max_push_bytes = MAX_HEADER_BYTES + 4 * sum(self._shapes[n[0]].numel() for n in self._names_per_tensor)
        # A broadcast's bound: every name (a trainer's state_dict carries a tied lm_head.weight beside the
        # embedding) in dtypes of up to 8 bytes (float64): what a trainer holds is received whole.
        self.max_broadcast_bytes = 8 * sum(shape.numel() for shape in self._shapes.values())

    # -- reading (a worker thread) -----------------------------------------------------------------------

    def read_checkpoint(self, model_path: str, load_format: str) -> StagedWeights:
        """A whole checkpoint directory, checked and staged; WeightsRefused says why not."""
        if load_format not in LOAD_FORMATS:
            raise WeightsRefused(f"load_format {load_format!r}: only safetensors are loaded (auto, safetensors); "
                                 "pickled formats could run code")
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise WeightsRefused(f"model_path {model_path!r}: not a local Hugging Face checkpoint (no config.json)")
        self._check_config(path)
        self._check_vocabulary(path)
        files = _safetensors_files(path)
        kinds: dict[str, tuple[list[int], bool]] = {}
        try:
            for file in files:
                with safe_open(file, framework="pt") as reader:
                    for name in reader.keys():
                        part = reader.get_slice(name)
                        kinds[name] = (list(part.get_shape()), part.get_dtype().startswith(("F", "BF")))
            self._check_tensors(kinds, complete=True)
            tensors: dict[str, torch.Tensor] = {}
            for file in files:
                with safe_open(file, framework="pt") as reader:
                    tensors.update((name, reader.get_tensor(name)) for name in reader.keys())
        except (OSError, SafetensorError) as exc:
            raise WeightsRefused(f"{path}: its safetensors do not read: {exc}") from None
        return self._stage(tensors, f"{len(tensors)} tensors from {path}", source=path,
                           part=FromDisk(path, load_format))

    def read_safetensors(self, data: bytes) -> StagedWeights:
        """One safetensors file's bytes: any subset of the model's tensors, checked and staged."""
        try:
            tensors = load_safetensors(data)
        except (SafetensorError, ValueError) as exc:
            raise WeightsRefused(f"the pushed bytes are not a safetensors file: {exc}") from None
        if not tensors:
            raise WeightsRefused("the pushed safetensors file holds no tensors")
        return self.stage_copies(tensors, f"{len(tensors)} pushed tensors ({len(data)} bytes)", FromSafetensors(data))

    def stage_copies(self, tensors: dict[str, torch.Tensor], description: str,
                     part: RankUpdate | None = None) -> StagedWeights:
        """Tensors someone else owns (any subset of the model's, possibly none), checked and copied into staged
        ones; `part`: how the other tensor-parallel ranks get theirs (default: these tensors, sent them)."""
        self._check_tensors({name: (list(t.shape), t.is_floating_point()) for name, t in tensors.items()},
                            complete=False)
        if part is None and self.ranks is not None:
            part = FromTensors({name: tensor.detach().cpu() for name, tensor in tensors.items()})
        staged = self._stage(tensors, description, part=part)
        if any(tensor.is_cuda for tensor in tensors.values()):
            torch.cuda.synchronize()  # the copies are done before the caller answers, and the sender reuses its memory
        return staged

    def receive_buffer(self, name: str, dtype: torch.dtype, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """Room for a broadcast tensor: its served parameter's twin when the dtype and shape are the served ones
        (staged as it is, without a copy), else a tensor of what was declared (checked and cast when staged)."""
        served = self._tensors.get(name)
        if (served is not None and served.dtype == dtype and served.shape == shape == self._shapes[name]
                and served.device == device):
            return torch.empty_like(served, requires_grad=False, memory_format=torch.contiguous_format)
        return torch.empty(shape, dtype=dtype, device=device)

    def stage_received(self, tensors: dict[str, torch.Tensor], description: str,
                       part: RankUpdate | None = None) -> StagedWeights:
        """Received tensors (any subset of the model's), checked and staged; `part`: what the other
        tensor-parallel ranks received."""
        self._check_tensors({name: (list(t.shape), t.is_floating_point()) for name, t in tensors.items()},
                            complete=False)
        return self._stage(tensors, description, received=True, part=part)

    # -- checks ------------------------------------------------------------------------------------------

    def _check_config(self, path: Path) -> None:
        theirs = _config_of(path)
        differences = [f"{key} {self._config.get(key)!r} served, {theirs.get(key)!r} in the checkpoint"
                       for key in sorted(self._config.keys() | theirs.keys())
                       if self._config.get(key) != theirs.get(key)]
        if differences:
            raise WeightsRefused(f"{path}: a different architecture or config than the served model's: "
                                 f"{listed(differences)}")
        eos = _generation_eos(path)
        if eos is not None and eos != self._eos_token_ids:
            raise WeightsRefused(f"{path}: generation_config.json's eos_token_id {eos} differs from the served "
                                 f"{self._eos_token_ids}")

    def _check_vocabulary(self, path: Path) -> None:
        for name in VOCABULARY_FILES:
            new, served = path / name, self.model_dir / name
            if not new.is_file():
                continue
            if not served.is_file() or not _same_vocabulary_file(served, new):
                raise WeightsRefused(f"{path}: a different vocabulary than the served model's ({name} differs); "
                                     "the gateway and detokenizer keep the served tokenizer")

    def _check_tensors(self, kinds: dict[str, tuple[list[int], bool]], complete: bool) -> None:
        """Every name known, every shape and kind (floating point or not) the served tensor's; with
        `complete`, every served tensor provided."""
        unknown = sorted(set(kinds) - set(self._tensors))
        if unknown:
            raise WeightsRefused(f"tensors the served model does not have: {listed(unknown)}")
        shapes = [f"{name} {list(self._shapes[name])} served, {shape} given"
                  for name, (shape, _) in sorted(kinds.items()) if list(self._shapes[name]) != shape]
        if shapes:
            raise WeightsRefused(f"tensor shapes differ from the served model's: {listed(shapes)}")
        kind = [name for name, (_, floating) in sorted(kinds.items())
                if self._tensors[name].is_floating_point() != floating]
        if kind:
            raise WeightsRefused(f"tensors of the wrong kind (integer for floating point, or the reverse): "
                                 f"{listed(kind)}")
        missing = [names[0] for names in self._names_per_tensor if not any(name in kinds for name in names)]
        if complete and missing:
            raise WeightsRefused(f"the checkpoint lacks tensors of the served model: {listed(missing)}")

    def merged(self, first: StagedWeights, then: StagedWeights, description: str) -> StagedWeights:
        """`then` staged over `first`, as one update: where both replace a tensor, `then`'s copy (the first's is let
        go now)."""
        latest = {id(served): (served, new) for served, new in first.pairs + then.pairs}
        complete = all(id(tensor) in latest for tensor in self.unique_tensors())
        return StagedWeights(list(latest.values()), description, complete, then.source if then.complete else None,
                             first.parts + then.parts, self.ranks)

    def unique_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the model once (a tied one has several names)."""
        return [tensor for _, tensor in self.named_unique()]

    def named_unique(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the model once, under its first name."""
        return [(names[0], self._tensors[names[0]]) for names in self._names_per_tensor]

    def _stage(self, tensors: dict[str, torch.Tensor], description: str, received: bool = False,
               source: Path | None = None, part: RankUpdate | None = None) -> StagedWeights:
        """Each tensor (this rank's cut of it) as a new one of its parameter's dtype, device and layout; a `received`
        one (receive_buffer's, owned by nobody else) that already is one is taken as it is."""
        pairs = []
        with torch.no_grad():
            for name, tensor in tensors.items():
                served = self._tensors[name]
                if self.sharding is not None:
                    tensor = self.sharding.local(name, tensor)
                if not (received and _same_layout(tensor, served)):
                    tensor = torch.empty_like(served, requires_grad=False).copy_(tensor)
                pairs.append((served, tensor))
        complete = all(any(name in tensors for name in names) for names in self._names_per_tensor)
        if self.ranks is not None and part is None:  # rank 0 alone would swap it in: the ranks would diverge
            raise ValueError(f"{description}: staged without saying how the other tensor-parallel ranks get it")
        parts = (part,) if part is not None and self.ranks is not None else ()
        return StagedWeights(pairs, description, complete, source, parts, self.ranks)


def _same_layout(tensor: torch.Tensor, served: torch.Tensor) -> bool:
    return (tensor.dtype == served.dtype and tensor.device == served.device and tensor.shape == served.shape
            and tensor.stride() == served.stride())
