"""The step journal: what a new StreamSteps subscriber needs to lose nothing.

The scheduler keeps the step messages it published in the last `window_s` seconds
(at most `window_bytes` of them) and, for every request those steps or the running
batch still concern, its start and output ids. A new subscription (a detokenizer
that restarted, or one whose stream was cut) first receives a replay: one message
resuming each request whose first steps were already dropped, then the retained
steps as they were sent. Downstream hops drop positions they already have, so a
subscriber that was away for less than the window misses nothing.
docs/reliability.md has the invariants.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from flatwire_wire.steps import RequestResume, RequestStart, StepMessage


@dataclass
class _Tracked:
    start: RequestStart
    output_ids: list[int] = field(default_factory=list)


@dataclass
class _Retained:
    at: float  # time.monotonic() when published
    size: int  # serialized bytes
    message: StepMessage
    finished: list[_Tracked]  # the requests its Finishes end: forgotten with it (a rid may be used again meanwhile)


class StepJournal:
    def __init__(self, window_s: float, window_bytes: int):
        self.window_s = window_s
        self.window_bytes = window_bytes
        self._steps: deque[_Retained] = deque()
        self._bytes = 0
        # Running requests, and finished ones whose Finish is still retained.
        self._requests: dict[str, _Tracked] = {}

    @property
    def retained_bytes(self) -> int:
        return self._bytes

    def record(self, message: StepMessage) -> None:
        """Called with every published step, in order."""
        for start in message.started:
            self._requests[start.rid] = _Tracked(start)
        for rid, tokens in message.entries():
            self._requests[rid].output_ids.extend(tokens)
        finished = [self._requests[finish.rid] for finish in message.finished if finish.rid in self._requests]
        retained = _Retained(time.monotonic(), len(message.encoded), message, finished)
        self._steps.append(retained)
        self._bytes += retained.size
        self._evict(retained.at)

    def replay(self) -> list[StepMessage]:
        """The messages a new subscriber gets before the live steps."""
        self._evict(time.monotonic())
        started: set[str] = set()  # requests whose whole life the retained steps carry
        covered: dict[str, int] = {}  # rid -> the first position the retained steps carry
        for retained in self._steps:
            started.update(start.rid for start in retained.message.started)
            for rid, position in zip(retained.message.rids, retained.message.positions):
                covered.setdefault(rid, position)
        resumed = [RequestResume(start=tracked.start, output_ids=tracked.output_ids[:covered.get(rid, None)])
                   for rid, tracked in self._requests.items() if rid not in started]
        return [StepMessage(resumed=resumed), *(retained.message for retained in self._steps)]

    def _evict(self, now: float) -> None:
        while self._steps and (now - self._steps[0].at > self.window_s or self._bytes > self.window_bytes):
            dropped = self._steps.popleft()
            self._bytes -= dropped.size
            for tracked in dropped.finished:
                if self._requests.get(tracked.start.rid) is tracked:  # not a later request of the same rid
                    del self._requests[tracked.start.rid]
