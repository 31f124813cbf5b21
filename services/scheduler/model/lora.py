"""Batched LoRA: requests on different adapters, and on the base model, in one step (S-LoRA's and Punica's batched
low-rank matmuls, as SGLang and vLLM serve many adapters of one model).

Each LoRA target of the model (a Linear of its decoder layers named by --lora-target-modules: q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj) gets a forward hook that adds, to every token's output, its adapter's
B A x. The step's adapters sit in `slots` (--max-loras-per-batch) device buffers per target: A [slots, r, in] and
B transposed [slots, r, out], r = --max-lora-rank (an adapter of lower rank is padded with zeros; its scaling is
already in B: model/lora_adapter.py). `prepare` gives each of a step's tokens its adapter's slot (copying an
adapter into a slot when it is not in one: the least recently used slot no adapter of the step holds); the hook
then computes, over the n slots in use, x @ A[:n]^T ([tokens, n r]), keeps each token's own slot's columns (the
others filled with zeros, whatever they hold; a base-model token keeps none) and adds that @ B[:n] ([n r, out]) to
the output: two dense matmuls and a fill per target, exact zeros from every other slot. A target no adapter of the
step adapts is skipped. Torch only, on the CPU and CUDA alike: no fused kernel (SGLang's csgmv, Punica's BGMV) yet.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.scheduler.model.lora_adapter import LoraAdapter


@dataclass(eq=False)
class Target:
    """One adapted Linear: its slots' A [slots, r, in] and B^T [slots, r, out], and which slots hold weights."""

    a: torch.Tensor
    b: torch.Tensor
    held: list[bool]
    active: bool = False  # a slot of this step holds weights for it


class LoraLayers:
    def __init__(self, model: torch.nn.Module, kinds: frozenset[str], slots: int, max_rank: int):
        """Hooks on the model's Linear modules named `kinds` (the output embeddings excepted); `slots` adapters per
        step, of rank up to `max_rank`."""
        self.slots = slots
        self.max_rank = max_rank
        head = model.get_output_embeddings()
        modules = {name: module for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head
                   and name.rsplit(".", 1)[-1] in kinds}
        if not modules:
            raise ValueError(f"--lora-target-modules: the model has no Linear module named {', '.join(sorted(kinds))}")
        self.features = {name: (module.in_features, module.out_features) for name, module in modules.items()}
        self.targets: dict[str, Target] = {}
        for name, module in modules.items():
            weight = module.weight
            target = Target(torch.zeros(slots, max_rank, module.in_features, dtype=weight.dtype, device=weight.device),
                            torch.zeros(slots, max_rank, module.out_features, dtype=weight.dtype, device=weight.device),
                            [False] * slots)
            self.targets[name] = target
            module.register_forward_hook(self._hook(target))
        self.device = next(iter(modules.values())).weight.device
        self.dtype = next(iter(modules.values())).weight.dtype
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> its slot, least recently used first
        self._off: torch.Tensor | None = None  # [tokens, n r]: not the token's slot; None: no token has an adapter
        self._used = 0  # n: the slots [0, n) this step reads

    @property
    def bytes(self) -> int:
        return sum(t.a.numel() * t.a.element_size() + t.b.numel() * t.b.element_size() for t in self.targets.values())

    def _hook(self, target: Target):
        def add_lora(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            off = self._off
            if off is None or not target.active:
                return
            x = args[0].reshape(-1, args[0].shape[-1])
            n, r = self._used, self.max_rank
            shrunk = (x @ target.a[:n].reshape(n * r, -1).T).masked_fill_(off, 0)
            output.view(-1, output.shape[-1]).addmm_(shrunk, target.b[:n].reshape(n * r, -1))
        return add_lora

    def prepare(self, adapters: Sequence[LoraAdapter | None], counts: np.ndarray) -> None:
        """The next forward's tokens: row i's `counts[i]` tokens run on `adapters[i]` (None: the base model)."""
        step = list({adapter.id: adapter for adapter in adapters if adapter is not None}.values())
        if not step:
            self._off = None
            return
        if len(step) > self.slots:  # the scheduling policy admits no more (engine/policy.py)
            raise RuntimeError(f"{len(step)} adapters in one step: --max-loras-per-batch is {self.slots}")
        wanted = {adapter.id for adapter in step}
        for adapter in step:
            if adapter.id in self._slot_of:
                self._slot_of.move_to_end(adapter.id)
            else:
                self._load(self._free_slot(wanted), adapter)
        slot_of_row = np.array([-1 if a is None else self._slot_of[a.id] for a in adapters], dtype=np.int64)
        token_slots = torch.from_numpy(np.repeat(slot_of_row, counts)).to(self.device)
        self._used = used = int(slot_of_row.max()) + 1
        columns = torch.arange(used, device=self.device).repeat_interleave(self.max_rank)
        self._off = columns[None, :] != token_slots[:, None]
        in_use = set(slot_of_row[slot_of_row >= 0].tolist())
        for target in self.targets.values():
            target.active = any(target.held[slot] for slot in in_use)

    def finish(self) -> None:
        """The forward is over: a later one (the start's check) runs on the base model unless prepared."""
        self._off = None

    def _free_slot(self, wanted: set[int]) -> int:
        """A slot for a new adapter of the step: an empty one, else the least recently used one whose adapter the
        step does not run."""
        taken = set(self._slot_of.values())
        if free := [slot for slot in range(self.slots) if slot not in taken]:
            return free[0]
        victim = next(adapter_id for adapter_id in self._slot_of if adapter_id not in wanted)
        return self._slot_of.pop(victim)

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        for name, target in self.targets.items():
            weights = adapter.weights.get(name)
            target.a[slot].zero_()
            target.b[slot].zero_()
            target.held[slot] = weights is not None
            if weights is not None:
                a, b = weights
                target.a[slot, :a.shape[0]].copy_(a)
                target.b[slot, :a.shape[0]].copy_(b.T)
        self._slot_of[adapter.id] = slot

    def forget(self, adapter: LoraAdapter) -> None:
        """An adapter no request runs on any more: its slot is free."""
        self._slot_of.pop(adapter.id, None)
