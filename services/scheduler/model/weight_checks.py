"""SGLang's weights_checker (sglang/srt/utils/weight_checker.py), which slime's --check-weight-update-equal drives:
snapshot the served weights, reset them to random values, let the trainer update them, and compare them with the
snapshot, to prove that the update brought every tensor, bit for bit. Engine thread: weights change between steps
only. (miles' "checksum" action hashes tensors in a layout of its SGLang fork's own; it is refused by name.)
"""

import torch

from services.scheduler.model.weights import ServedWeights, WeightsRefused, listed


def _random_like(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype.is_floating_point:
        return torch.rand(tensor.shape, device=tensor.device).to(tensor.dtype)
    if tensor.dtype == torch.bool:
        return torch.rand(tensor.shape, device=tensor.device) > 0.5
    info = torch.iinfo(tensor.dtype)
    return torch.randint(info.min, info.max, tensor.shape, device=tensor.device, dtype=tensor.dtype)


class WeightChecker:
    def __init__(self, weights: ServedWeights):
        self.weights = weights
        self._snapshot: dict[str, torch.Tensor] | None = None  # on the host

    def snapshot(self) -> str:
        self._snapshot = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.weights.named_unique()}
        size = sum(tensor.nbytes for tensor in self._snapshot.values())
        return f"Snapshot of {len(self._snapshot)} tensors ({size} bytes) kept on the host."

    def reset_tensors(self) -> str:
        """Every served tensor random, in place (the same addresses: nothing captured needs to know)."""
        tensors = self.weights.named_unique()
        with torch.no_grad():
            for _, tensor in tensors:
                tensor.copy_(_random_like(tensor))
        return f"Reset {len(tensors)} tensors to random values."

    def compare(self, skip: set[str]) -> str:
        """Every served tensor but `skip`'s equal to the snapshot's; WeightsRefused names those that differ."""
        if self._snapshot is None:
            raise WeightsRefused("action: 'compare' needs a 'snapshot' first")
        differ = []
        compared = 0
        for name, tensor in self.weights.named_unique():
            if name in skip:
                continue
            compared += 1
            kept = self._snapshot[name]
            if not torch.equal(tensor.detach().cpu(), kept):
                error = (tensor.detach().cpu().double() - kept.double()).abs().max().item()
                differ.append(f"{name} (max abs error {error:.3g})")
        if differ:
            raise WeightsRefused(f"{len(differ)} of {compared} tensors differ from the snapshot: {listed(differ)}")
        return f"All {compared} tensors equal the snapshot."
