"""The scheduling policy: which requests run each step, and which KV pages they hold.

Each step's batch (step.py) is built in three passes, all bounded by the KV memory (cache/pages.py):
1. every running request that decodes gets one row, and a new page when its next token starts one; when pages run
   short (after the prefix cache gave back what no request holds), the newest running requests are retracted
   until the others fit: their full pages stay in the prefix cache, they wait first in line and resume by a
   prefill of prompt and output so far (most of it a cache hit unless evicted meanwhile);
2. running requests still prefilling get their next chunk, within the step's prefill budget
   (--chunked-prefill-size; with chunking off, --max-prefill-tokens and whole prompts);
3. waiting requests are admitted first come, first served while a request slot is free, the budget lasts and the
   pages their first chunk needs are there beside a reserve for the running requests to grow: each starts from
   the longest prefix of its sequence in the prefix cache (cache/prefix_cache.py), so only the rest is computed.
   A request whose next full page another request is computing right now waits a step, to find it cached.
Requests join and leave between steps; every change of status goes through `_move`, which keeps the lists, the
pages, the request slots and the status in agreement.
"""

import logging
import math
import time
from collections import deque

import numpy as np

from services.scheduler.cache.pages import PagePool
from services.scheduler.cache.prefix_cache import PrefixCache
from services.scheduler.request import ALLOWED, Request, RequestStatus
from services.scheduler.step import Batch, BatchRow

log = logging.getLogger(__name__)

# Tokens of room kept free, beyond what admitted chunks take, for each running request's next tokens (so that
# admission does not retract at the next step what it just let in); at most what the request may still generate.
# One page: bench.kv_capacity measured 64 running a tenth fewer requests to save a few retractions in a thousand.
DECODE_RESERVE_TOKENS = 16


class SlotPool:
    """The request slots (--max-running-requests): each running request's row of per-request sampling state."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


class Scheduler:
    def __init__(self, slots: SlotPool, pages: PagePool, prefix_cache: PrefixCache, prefill_budget: int,
                 chunked: bool, compile_timeout_s: float = math.inf):
        """`compile_timeout_s`: a request COMPILING longer fails (its compile, if it has not started, is dropped)."""
        self.slots = slots
        self.compile_timeout_s = compile_timeout_s
        self.pages = pages
        self.prefix_cache = prefix_cache
        self.prefill_budget = prefill_budget
        self.chunked = chunked  # a prompt longer than what is left of the budget is split across steps
        self.waiting: deque[Request] = deque()  # WAITING and RETRACTED, in the order they are admitted
        self.compiling: list[Request] = []  # COMPILING: in line once their grammar is ready
        self.running: list[Request] = []  # RUNNING, in the order they were admitted
        self.retractions = 0  # requests retracted because pages ran short
        self.prefill_tokens = 0  # tokens whose KV a prefill computed (cache hits excluded)
        self.cached_prompt_tokens = 0  # prompt tokens found in the prefix cache at first admission

    @property
    def requests(self) -> list[Request]:
        """Every request held: running, then waiting, then compiling."""
        return [*self.running, *self.waiting, *self.compiling]

    @property
    def available_pages(self) -> int:
        return self.pages.free + self.pages.evictable

    def add(self, request: Request) -> None:
        """A new request, last in line (once its grammar is compiled, if it is COMPILING)."""
        if request.status is RequestStatus.COMPILING:
            request.compile_deadline = time.monotonic() + self.compile_timeout_s
            self.compiling.append(request)
        else:
            self.waiting.append(request)

    def compile_wait(self) -> float | None:
        """Seconds until the first compiling request's deadline (None: none compiles), for the engine's wait."""
        if not self.compiling:
            return None
        return max(0.0, min(r.compile_deadline for r in self.compiling) - time.monotonic())

    def compiled(self) -> list[tuple[Request, BaseException]]:
        """Compiling requests whose grammar is ready get in line; those whose compile failed are returned, with
        why, for the engine to finish."""
        failed: list[tuple[Request, BaseException]] = []
        now = time.monotonic()
        for request in list(self.compiling):
            matcher = request.compiling
            if matcher is not None and not matcher.done() and now >= request.compile_deadline:
                matcher.cancel()  # a compile already running ends on its own; its result is dropped
                failed.append((request, TimeoutError(f"not compiled within {self.compile_timeout_s:g} s "
                                                     "(--grammar-compile-timeout-s)")))
                continue
            if matcher is None or not matcher.done():
                continue
            if (error := matcher.exception()) is not None:
                failed.append((request, error))
                continue
            request.grammar, request.compiling = matcher.result(), None
            self._move(request, RequestStatus.WAITING)
        return failed

    def find(self, rid: str) -> Request | None:
        return next((r for r in self.requests if r.rid == rid), None)

    def schedule(self, admit: bool = True) -> Batch:
        """The next step's rows (see the module docstring); `admit`: waiting requests may start."""
        rows = self._decode_rows()
        chunks: list[BatchRow] = []  # "alone" below: without another prefill in the step
        budget = self.prefill_budget
        for request in [r for r in self.running if not r.decoding]:
            if budget <= 0 or request.status is not RequestStatus.RUNNING:  # retracted just now
                break
            row = self._chunk(request, budget, alone=not chunks)
            while row is None and not rows and not chunks and self.running[-1] is not request:
                self._preempt(self.running[-1], "to prefill an older request")  # nothing else could progress
                row = self._chunk(request, budget, alone=True)
            if row is None:
                break
            chunks.append(row)
            budget -= row.end - row.start
        # Pages the running requests may need for their next DECODE_RESERVE_TOKENS: kept free by admission
        # (summed once, then per admitted request: admitting hundreds at once stays linear).
        reserve = sum(map(self._reserve, self.running)) if admit and self.waiting else 0
        while admit and self.waiting and self.slots.free and budget > 0:
            row = self._admit(self.waiting[0], budget, alone=not chunks, batch=chunks, reserve=reserve)
            if row is None:
                break
            reserve += self._reserve(row.request)
            chunks.append(row)
            budget -= row.end - row.start
        self.prefill_tokens += sum(r.end - r.start for r in chunks)
        return Batch(rows + chunks)

    def _decode_rows(self) -> list[BatchRow]:
        """A row per decoding request, each with a slot for its next token: retracting the newest requests when
        pages run short."""
        decoding = [r for r in self.running if r.decoding]
        # Those whose next token starts a page (one each: every token before it has its slot).
        page_tokens = self.pages.page_size
        starting = [r for r in decoding if r.length > len(r.page_table) * page_tokens]
        while len(starting) > self.available_pages:
            victim = self.running[-1]
            self._preempt(victim, f"short by {len(starting) - self.available_pages} pages for the decoding requests")
            if victim in decoding:
                decoding.remove(victim)
                if victim in starting:
                    starting.remove(victim)
        if starting:
            if len(starting) > self.pages.free:
                self.prefix_cache.evict(len(starting) - self.pages.free)
            for request, page in zip(starting, self.pages.allocate(len(starting))):
                request.page_table.append(page)
        return [BatchRow(r, r.length - 1, r.length) for r in decoding]

    def _chunk(self, request: Request, budget: int, alone: bool) -> BatchRow | None:
        """The next chunk of a request's prefill within `budget` (all of it when chunking is off, `alone`: even
        past the budget), its pages allocated; None when it does not fit."""
        remaining = request.length - request.computed
        size = min(remaining, budget) if self.chunked else remaining
        if not self.chunked and size > budget and not alone:
            return None
        end = request.computed + size
        if self._new_pages(request, end) > self.available_pages:
            return None
        self._grow(request, end)
        return BatchRow(request, request.computed, end)

    def _admit(self, request: Request, budget: int, alone: bool, batch: list[BatchRow],
               reserve: int) -> BatchRow | None:
        """Start the first request in line from its longest cached prefix, if its first chunk fits and leaves
        the running requests' `reserve` of pages free; None when it has to wait."""
        sequence = request.sequence()
        # At least one token is computed (its logits give the next one), and every prompt position that gets a
        # logprob row needs the hidden state before it.
        limit = len(sequence) - 1
        if request.owes_prompt_logprobs:
            limit = min(limit, request.prompt_logprob_start - 1)
        found = self.prefix_cache.match(sequence, limit)
        request.page_table, request.computed = found, len(found) * self.pages.page_size
        if self._shares_a_prefill(request, sequence, batch):
            self._unadmit(request)
            return None
        row = self._chunk(request, budget, alone)
        if row is None or reserve > self.available_pages:
            self._unadmit(request)
            return None
        if not request.admitted:
            request.cached_tokens = min(request.computed, request.prompt_len)
            self.cached_prompt_tokens += request.cached_tokens
            request.admitted = True
        request.kv_epoch = self.prefix_cache.epoch
        self._move(request, RequestStatus.RUNNING)
        return row

    def _unadmit(self, request: Request) -> None:
        """Let go of what an admission that did not happen took."""
        self.pages.release(request.page_table)
        request.page_table, request.computed = [], 0

    def _shares_a_prefill(self, request: Request, sequence: np.ndarray, batch: list[BatchRow]) -> bool:
        """Whether a request prefilling now computes the next full page of `request`'s sequence: then it waits a
        step and finds that page in the prefix cache (n samples of one prompt prefill it once)."""
        ps = self.pages.page_size
        upto = request.computed + ps
        if not self.prefix_cache.enabled or upto > len(sequence) - 1:
            return False
        for row in batch:
            other = row.request
            if not other.decoding and row.end >= upto and other.length > upto and \
                    np.array_equal(other.sequence()[:upto], sequence[:upto]):
                return True
        return False

    def _preempt(self, request: Request, why: str) -> None:
        log.info("KV memory %s: retracting request %s (%d tokens)", why, request.rid, request.length)
        self.retract(request)
        self.retractions += 1

    def retract(self, request: Request) -> None:
        """A running request drops its KV (its full pages into the prefix cache first) and waits first in line."""
        self._move(request, RequestStatus.RETRACTED)

    def retract_running(self) -> None:
        """Every running request is retracted, each first in line in its order."""
        for request in reversed(self.running):
            self.retract(request)

    def finish(self, request: Request) -> None:
        self._move(request, RequestStatus.FINISHED)

    def computed(self, batch: Batch) -> None:
        """The step ran: each row's tokens now have their KV, and a prefill chunk's full pages go in the prefix cache
        (for the next request with the same prefix: n samples, a conversation's next turn)."""
        for row in batch.rows:
            row.request.computed = row.end
            if row.end - row.start > 1:
                self._commit(row.request)

    # -- pages --

    def _reserve(self, request: Request) -> int:
        """Pages a running request needs beyond its own for its next DECODE_RESERVE_TOKENS tokens."""
        return self._new_pages(request, min(request.length + DECODE_RESERVE_TOKENS,
                                            request.prompt_len + request.max_new_tokens))

    def _new_pages(self, request: Request, end: int) -> int:
        """Pages `request` needs beyond its own to hold positions [0, end)."""
        return max(self.pages.pages_for(end) - len(request.page_table), 0)

    def _grow(self, request: Request, end: int) -> None:
        new = self._new_pages(request, end)
        if new > self.pages.free:
            self.prefix_cache.evict(new - self.pages.free)
        request.page_table.extend(self.pages.allocate(new))

    def _commit(self, request: Request) -> None:
        """Put the full pages of the request's computed tokens in the prefix cache (unless its KV predates the
        cache's epoch: older weights)."""
        full = request.computed // self.pages.page_size
        if full > request.committed_pages and request.kv_epoch == self.prefix_cache.epoch:
            self.prefix_cache.insert(request.sequence(), request.page_table, full)
            request.committed_pages = full

    def _drop_kv(self, request: Request) -> None:
        self._commit(request)
        self.pages.release(request.page_table)
        request.page_table, request.computed, request.committed_pages = [], 0, 0

    def _move(self, request: Request, status: RequestStatus) -> None:
        """The one place a request changes status."""
        if status not in ALLOWED[request.status]:
            raise ValueError(f"request {request.rid}: {request.status.value} cannot become {status.value}")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.slots.release(request.slot)
            request.slot = -1
            self._drop_kv(request)
        elif request.status is RequestStatus.COMPILING:
            self.compiling.remove(request)
        else:
            self.waiting.remove(request)
        if status is RequestStatus.WAITING:
            self.waiting.append(request)
        elif status is RequestStatus.RUNNING:
            request.slot = self.slots.allocate()
            request.sampling_ready = False
            self.running.append(request)
        elif status is RequestStatus.RETRACTED:
            self.waiting.appendleft(request)
        request.status = status
