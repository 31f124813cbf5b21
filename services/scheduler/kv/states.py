"""The linear-attention state slots (kv/specs.py:RecurrentSpec): which are free, and who holds the others.

A running request's state lives in the slot of its request slot (0 .. running - 1: the policy's SlotPool hands
those out). The slots after them are checkpoints: a request's state at a page boundary, taken as a step crosses it
(model/linear_attention.py), that the prefix cache keeps with the node of that page, so that a request whose prompt
shares the prefix starts from it (a recurrent state cannot be cut at any token, as KV can: it is resumed only
where a checkpoint was taken, SGLang's hybrid radix cache, vLLM's aligned mamba cache). A checkpoint is held by the
node that keeps it and by each request about to start from it; it is free when the last one lets go.
"""

NO_STATE = 0  # a node without a checkpoint (a checkpoint's slot is never 0: request slots come first)


class StateSlots:
    def __init__(self, running: int, checkpoints: int):
        """`running`: request slots, each its request's state; `checkpoints`: slots after them for checkpoints."""
        self.running = running
        self.checkpoints = checkpoints
        self.refs = [0] * (running + checkpoints)
        self._free = list(range(running + checkpoints - 1, running - 1, -1))

    @property
    def total(self) -> int:
        return self.running + self.checkpoints

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free checkpoint slot, held once by the caller; None when every one is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.refs[slot] = 1
        return slot

    def retain(self, slot: int) -> None:
        self.refs[slot] += 1

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        assert self.refs[slot] >= 0, f"state slot {slot} released more often than held"
        if self.refs[slot] == 0:
            self._free.append(slot)
