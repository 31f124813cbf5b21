"""A fixed pool of KV-cache slots, one slot per running request.

Each layer owns one key and one value tensor of shape
[slots, kv_heads, max_context, head_dim]; a request holds one slot from admission
to finish, and its token at position p lives at index p. Zero-filled so that
masked-out positions never carry NaN into attention (0 * NaN is NaN).
"""

import torch


class SlotPool:
    """Which of `num_slots` slots are held; the engine's admission asks it for room."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


class SlotKVCache(SlotPool):
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_context: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(num_slots)
        shape = (num_slots, num_kv_heads, max_context, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
