"""One request's outputs as they arrive, step by step, joined only when read.

Each step contributes a token, a text delta and, when logprobs were asked, four
byte ranges of the step's LogprobBlock (memoryview slices: no copy, no numpy
object per step). Reading a range of steps joins their bytes once and views them
as arrays, so a 1000-token request costs one join per array, not 1000 concatenations.

Tokens are taken by position: one already held (a replay after a hop restarted) is
dropped; one past the next expected, or one without the logprob rows the request
asked for (lost beyond the scheduler's replay window), raises OutputLost.
"""

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from services.common.arrays import F32, I32
from services.common.pb import scheduler_pb2
from services.gateway.result import LogprobTrack

ARRAYS = ("token_logprobs", "topk_values", "topk_ids", "ids_logprobs")


@dataclass
class StepBlock:
    """A step's LogprobBlock prepared for slicing: its buffers and each request's byte offsets."""

    buffers: tuple[memoryview, ...]  # in ARRAYS order
    offsets: tuple[list[int], ...]  # byte offset of each request (n + 1 each; f4/i4: 4 bytes), in ARRAYS order

    @classmethod
    def of(cls, block) -> "StepBlock":
        # Plain Python over the (few) requests: cheaper than numpy for a step's handful of counts.
        rows = list(block.rows)
        topk = [4 * r * k for r, k in zip(rows, block.topk)]
        ids = [4 * r * m for r, m in zip(rows, block.id_counts)]
        topk_offsets = [0, *accumulate(topk)]
        offsets = ([0, *accumulate(4 * r for r in rows)], topk_offsets, topk_offsets, [0, *accumulate(ids)])
        return cls(tuple(memoryview(getattr(block, name)) for name in ARRAYS), offsets)

    def ranges(self, i: int) -> tuple[memoryview, ...]:
        (lp, values, ids, id_lp), (lp_at, topk_at, _, ids_at) = self.buffers, self.offsets
        j = i + 1
        return (lp[lp_at[i]:lp_at[j]], values[topk_at[i]:topk_at[j]], ids[topk_at[i]:topk_at[j]],
                id_lp[ids_at[i]:ids_at[j]])


def track_of(ranges: list[tuple[memoryview, ...]], token_ids: list[int], k: int, m: int) -> LogprobTrack:
    """Join per-step byte ranges into a LogprobTrack of len(token_ids) rows."""
    n = len(token_ids)
    joined = [b"".join(step[a] for step in ranges) for a in range(len(ARRAYS))]
    return LogprobTrack(
        token_ids=np.asarray(token_ids, dtype=I32),
        token_logprobs=np.frombuffer(joined[0], dtype=F32),
        topk_values=np.frombuffer(joined[1], dtype=F32).reshape(n, k),
        topk_ids=np.frombuffer(joined[2], dtype=I32).reshape(n, k),
        ids_logprobs=np.frombuffer(joined[3], dtype=F32).reshape(n, m),
    )


class OutputLost(Exception):
    """Part of a request's output can no longer arrive; the message says which."""


@dataclass
class Accumulator:
    logprob: scheduler_pb2.LogprobParams
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ranges: list[tuple[memoryview, ...]] = field(default_factory=list)  # per step, when return_logprob
    read: int = 0  # steps already handed out as chunks

    def add(self, position: int, token_id: int, text: str, block: StepBlock | None, i: int) -> bool:
        """Take the token at `position`; False when it is held already."""
        have = len(self.token_ids)
        if position < have:
            return False
        if position > have:
            raise OutputLost(f"output tokens {have}..{position - 1} never arrived")
        if self.logprob.return_logprob:
            if block is None:
                raise OutputLost(f"the logprobs of output token {position} are no longer retained")
            self.ranges.append(block.ranges(i))
        self.token_ids.append(token_id)
        self.texts.append(text)
        return True

    @property
    def unread(self) -> int:
        return len(self.token_ids) - self.read

    def take(self) -> tuple[list[int], str, LogprobTrack | None]:
        """Tokens, text and logprob rows of the steps not taken before."""
        start, self.read = self.read, len(self.token_ids)
        return self.token_ids[start:], "".join(self.texts[start:]), self._track(start)

    def whole(self) -> tuple[list[int], str, LogprobTrack | None]:
        return list(self.token_ids), "".join(self.texts), self._track(0)

    def _track(self, start: int) -> LogprobTrack | None:
        if not self.logprob.return_logprob:
            return None
        k, m = self.logprob.top_logprobs_num, len(self.logprob.token_ids_logprob)
        return track_of(self.ranges[start:], self.token_ids[start:], k, m)
