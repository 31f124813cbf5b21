"""Owner -> subscriber queues, and slicing a step down to one owner's requests.

The top-k buffers are sliced per owner with select_requests (byte slicing, and no
copy at all when one owner has every request); no element is touched.
"""

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

from services.common.arrays import select_requests
from services.common.pb import scheduler_pb2


@dataclass
class OwnedStep:
    """A scheduler step as the detokenizer annotated it: a text and an owner per entry."""

    step: scheduler_pb2.StepOutput  # as the scheduler sent it
    texts: list[str] = field(default_factory=list)  # per entry of step.rids
    owners: list[str | None] = field(default_factory=list)  # per entry of step.rids; None: dropped
    prompt_owners: list[str | None] = field(default_factory=list)  # per entry of step.prompt_rids
    finished: list[tuple[str | None, scheduler_pb2.Finish]] = field(default_factory=list)  # None: every owner


class Router:
    def __init__(self):
        self._queues: dict[str, set[asyncio.Queue]] = defaultdict(set)

    def subscribe(self, owner: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[owner].add(queue)
        return queue

    def unsubscribe(self, owner: str, queue: asyncio.Queue) -> None:
        self._queues[owner].discard(queue)
        if not self._queues[owner]:
            del self._queues[owner]

    def subscribed(self, owner: str) -> bool:
        return owner in self._queues

    def publish(self, owned: OwnedStep) -> None:
        """Send each subscribed owner the part of the step that is theirs; others' parts are dropped."""
        if not self._queues:
            return
        rows, prompt_rows = self._indices_by_owner(owned.owners), self._indices_by_owner(owned.prompt_owners)
        started: dict[str, list] = defaultdict(list)
        for start in owned.step.started:
            if start.owner in self._queues:
                started[start.owner].append(start)
        finished: dict[str, list] = defaultdict(list)
        for owner, finish in owned.finished:
            for target in (self._queues if owner is None else (owner,) if owner in self._queues else ()):
                finished[target].append(finish)
        for owner in rows.keys() | prompt_rows.keys() | started.keys() | finished.keys():
            message = _slice(owned, rows.get(owner, []), prompt_rows.get(owner, []), started[owner],
                             finished[owner])
            for queue in self._queues[owner]:
                queue.put_nowait(message)

    def _indices_by_owner(self, owners: list[str | None]) -> dict[str, list[int]]:
        indices: dict[str, list[int]] = defaultdict(list)
        for i, owner in enumerate(owners):
            if owner in self._queues:
                indices[owner].append(i)
        return indices


def _slice(owned: OwnedStep, keep: list[int], keep_prompt: list[int], started: list,
           finished: list) -> scheduler_pb2.StepOutput:
    step = owned.step
    message = scheduler_pb2.StepOutput(
        step=step.step,
        started=started,
        rids=[step.rids[i] for i in keep],
        token_ids=[step.token_ids[i] for i in keep],
        texts=[owned.texts[i] for i in keep],
        prompt_rids=[step.prompt_rids[i] for i in keep_prompt],
        finished=finished,
    )
    if keep and step.output.rows:
        message.output.CopyFrom(select_requests(step.output, keep))
    if keep_prompt:
        message.prompt.CopyFrom(select_requests(step.prompt, keep_prompt))
    return message
