"""The scheduling policy: which requests run each step.

Requests wait in line (first come, first served) and are admitted while a KV slot is free and the step's
prefill budget (--max-tokens-per-step) allows; a prompt longer than the whole budget is admitted alone, so
nothing starves. Admitted requests run until they finish; a new request never waits for running ones to finish,
only for a free slot. Every change of a request's status goes through `_move`, which keeps the lists, the KV
slots and the status in agreement.
"""

from collections import deque

from services.scheduler.model.kv_cache import SlotPool
from services.scheduler.request import ALLOWED, Request, RequestStatus


class Scheduler:
    def __init__(self, cache: SlotPool, max_tokens_per_step: int):
        self.cache = cache
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Request] = deque()  # WAITING and RETRACTED, in the order they are admitted
        self.running: list[Request] = []  # RUNNING, in the order they were admitted

    @property
    def requests(self) -> list[Request]:
        """Every request held: running, then waiting."""
        return [*self.running, *self.waiting]

    def add(self, request: Request) -> None:
        """A new request, last in line."""
        self.waiting.append(request)

    def find(self, rid: str) -> Request | None:
        return next((r for r in self.requests if r.rid == rid), None)

    def admit(self) -> list[Request]:
        """Start the requests first in line that fit: a free slot each, their prefills within the step's budget."""
        admitted: list[Request] = []
        budget = self.max_tokens_per_step
        while self.waiting and self.cache.free_slots:
            request = self.waiting[0]
            size = len(request.prefill_ids)
            if admitted and size > budget:
                break
            self._move(request, RequestStatus.RUNNING)
            budget -= size
            admitted.append(request)
        return admitted

    def retract_running(self) -> None:
        """Every running request drops its KV and waits, first in line and in its order, to be prefilled again."""
        for request in reversed(self.running):
            self._move(request, RequestStatus.RETRACTED)

    def finish(self, request: Request) -> None:
        self._move(request, RequestStatus.FINISHED)

    def _move(self, request: Request, status: RequestStatus) -> None:
        """The one place a request changes status."""
        if status not in ALLOWED[request.status]:
            raise ValueError(f"request {request.rid}: {request.status.value} cannot become {status.value}")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.cache.release(request.slot)
            request.slot = -1
        else:
            self.waiting.remove(request)
        if status is RequestStatus.RUNNING:
            request.slot = self.cache.allocate()
            self.running.append(request)
        elif status is RequestStatus.RETRACTED:
            self.waiting.appendleft(request)
        request.status = status
