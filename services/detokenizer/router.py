"""Owner -> outbox, and slicing a step down to one owner's requests.

Each gateway (owner) that subscribed has one outbox, kept while it is away: what
arrives for it between two of its subscriptions (its stream was cut) waits there,
bounded in time by the owner grace period (see server.py). A new subscription of
the same owner takes the outbox over and ends the previous one. For a while after
this process starts (`adopt_for_s`), outputs of owners that have not subscribed yet
get an outbox too: a restarted detokenizer replays requests whose gateways are about
to reconnect. Past that, outputs of owners that never subscribed here are dropped
(they are some other detokenizer's).

The top-k buffers are sliced per owner by StepMessage.slice (byte slicing, and copied whole
when one owner has every request); no element is touched.
"""

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

from flatwire_wire.steps import Finish, StepMessage


@dataclass
class OwnedStep:
    """A scheduler step as the detokenizer annotated it: a text and an owner per entry."""

    step: StepMessage  # as the scheduler sent it
    texts: list[str] = field(default_factory=list)  # per entry of step.rids
    owners: list[str | None] = field(default_factory=list)  # per entry of step.rids; None: dropped
    prompt_owners: list[str | None] = field(default_factory=list)  # per entry of step.prompt_rids
    finished: list[tuple[str, Finish]] = field(default_factory=list)  # (owner, finish)


class Router:
    def __init__(self, adopt_for_s: float = 0.0):
        self._adopt_until = time.monotonic() + adopt_for_s
        self._outboxes: dict[str, asyncio.Queue] = {}  # of StepMessage; None ends the stream reading it
        self._away_since: dict[str, float] = {}  # owners with an outbox and no subscriber -> since when

    def subscribe(self, owner: str) -> asyncio.Queue:
        """The owner's outbox, under a new queue: the previous subscriber's stream ends."""
        queue: asyncio.Queue = asyncio.Queue()
        if previous := self._outboxes.get(owner):
            while not previous.empty():
                queue.put_nowait(previous.get_nowait())
            previous.put_nowait(None)
        self._outboxes[owner] = queue
        self._away_since.pop(owner, None)
        return queue

    def unsubscribe(self, owner: str, queue: asyncio.Queue) -> None:
        if self._outboxes.get(owner) is queue:  # not taken over by a newer subscription
            self._away_since[owner] = time.monotonic()

    def subscribed(self, owner: str) -> bool:
        return owner in self._outboxes and owner not in self._away_since

    def away(self, longer_than: float) -> list[str]:
        """Owners unsubscribed for more than `longer_than` seconds."""
        now = time.monotonic()
        return [owner for owner, since in self._away_since.items() if now - since > longer_than]

    def congested(self, limit: int) -> list[str]:
        """Subscribed owners with more than `limit` messages waiting: their gateways read slower than steps come."""
        return [owner for owner, queue in self._outboxes.items()
                if owner not in self._away_since and queue.qsize() > limit]

    def cut(self, owner: str) -> None:
        """End a subscriber that stayed too slow. What waits for it is dropped (its gateway, finding the same
        detokenizer when it resubscribes, fails the requests that came through here); it is away from now on."""
        queue = self._outboxes[owner]
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)
        self._outboxes[owner] = asyncio.Queue()
        self._away_since[owner] = time.monotonic()

    def close(self) -> None:
        """End every subscriber's stream after what waits for it (the detokenizer is stopping)."""
        for owner, queue in self._outboxes.items():
            if owner not in self._away_since:
                queue.put_nowait(None)

    def forget(self, owner: str) -> None:
        self._outboxes.pop(owner, None)
        self._away_since.pop(owner, None)

    def _outbox(self, owner: str) -> asyncio.Queue | None:
        if owner not in self._outboxes and time.monotonic() < self._adopt_until:
            self._outboxes[owner] = asyncio.Queue()
            self._away_since[owner] = time.monotonic()
        return self._outboxes.get(owner)

    def publish(self, owned: OwnedStep) -> None:
        """Queue for each owner the part of the step that is theirs."""
        rows, prompt_rows = _indices_by_owner(owned.owners), _indices_by_owner(owned.prompt_owners)
        started: dict[str, list] = defaultdict(list)
        for start in owned.step.started:
            started[start.owner].append(start)
        finished: dict[str, list] = defaultdict(list)
        for owner, finish in owned.finished:
            finished[owner].append(finish)
        for owner in rows.keys() | prompt_rows.keys() | started.keys() | finished.keys():
            if (outbox := self._outbox(owner)) is not None:
                outbox.put_nowait(_slice(owned, rows.get(owner, []), prompt_rows.get(owner, []), started[owner],
                                         finished[owner]))


def _indices_by_owner(owners: list[str | None]) -> dict[str, list[int]]:
    indices: dict[str, list[int]] = defaultdict(list)
    for i, owner in enumerate(owners):
        if owner is not None:
            indices[owner].append(i)
    return indices


def _slice(owned: OwnedStep, keep: list[int], keep_prompt: list[int], started: list, finished: list) -> StepMessage:
    texts = owned.texts if len(keep) == len(owned.texts) else [owned.texts[i] for i in keep]
    return owned.step.slice(keep, keep_prompt, started, finished, texts)
