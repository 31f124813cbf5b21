"""The one owner of the KV memory's bookkeeping (vLLM's KVCacheManager): the pages (pages.py), the prefix cache
(prefix_cache.py), and each request's `KVState`.

The scheduling policy (engine/policy.py) decides who runs; it asks the manager what a request finds cached
(`match`), whether the pages a row needs are there (`pages_needed`, `available`), takes them (`allocate`), reports
what a step computed (`computed`) and lets go of a request's memory (`free`); it never touches a page itself. The
pool's tensors (pool.py) are the model's: the manager hands out the page numbers that index them.

A model's layers come in groups (specs.py), each with a page table per request. A sliding-window group needs only
the pages of the window before the row it computes next: the pages before it are given back as the sequence
grows (DROPPED in its table), for any group to use. A model's linear-attention layers keep a state per request in
its request slot (states.py); a row that reaches a page boundary also takes a checkpoint of it there, which the
prefix cache keeps with that page's node, and a request that matches a cached prefix starts from the checkpoint.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.kv.pages import PagePool
from services.scheduler.kv.prefix_cache import DROPPED, PrefixCache, first_visible_page
from services.scheduler.kv.states import NO_STATE, StateSlots

FRESH = -1  # KVState.restore: the request's linear-attention state starts from zeros

if TYPE_CHECKING:
    from services.scheduler.request import Request
    from services.scheduler.step import BatchRow


@dataclass
class KVState:
    """One request's KV memory: per layer group, the pages that hold its sequence (prompt, then output; token p in
    table[p // page_size] at offset p % page_size, DROPPED before a window group's window; every group's table as
    long as the others), and how far they are filled."""

    tables: list[list[int]] = field(default_factory=list)
    computed: int = 0  # leading tokens whose KV the pages hold
    committed_pages: int = 0  # leading full pages put in the prefix cache
    epoch: int = 0  # the prefix cache's epoch when the KV began: KV of older weights is never cached
    # Linear-attention state (a model with such layers): where the request's next row starts from (FRESH: zeros; a
    # checkpoint slot: its copy; None: the state its slot holds), and checkpoints (pages, slot) after that many
    # pages: the one the next row takes, and the last one taken that the prefix cache does not keep yet.
    restore: int | None = FRESH
    capture: tuple[int, int] | None = None
    captured: tuple[int, int] | None = None


def longest_sequence(num_pages: int, page_size: int, windows: tuple[int, ...], prefill_budget: int) -> int:
    """The longest sequence that fits the pool alone: its pages in every full-attention group, and in a window group
    those one prefill chunk (at most `prefill_budget` tokens) and the window before it reach."""
    usable = num_pages - 1

    def pages(tokens: int) -> int:
        whole = -(-tokens // page_size)
        return sum(min(whole, (min(tokens, prefill_budget) + window) // page_size + 2) if window else whole
                   for window in windows)

    high = usable * page_size
    if all(windows):  # every group keeps a window: past a chunk and a window, a longer sequence needs no more
        high = prefill_budget + max(windows) + page_size
        if pages(high) <= usable:
            return 1 << 62
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if pages(middle) <= usable else (low, middle - 1)
    return low


@dataclass(frozen=True)
class KVStats:
    pages_total: int  # that can hold KV (the padding page excluded)
    pages_held: int  # by requests (some also cached)
    pages_cached: int  # in the prefix cache
    page_size: int


class KVManager:
    def __init__(self, num_pages: int, page_size: int, windows: tuple[int, ...] = (0,), prefix_cache: bool = True,
                 states: StateSlots | None = None):
        """`num_pages`: of the pool, the padding page 0 included; `windows`: each layer group's window (0: full
        attention); `prefix_cache`: False, every request computes its whole sequence; `states`: the linear-attention
        state slots, for a model that has such layers."""
        self.windows = windows
        self.pages = PagePool(num_pages, page_size)
        self.states = states
        self.prefix_cache = PrefixCache(self.pages, list(windows), enabled=prefix_cache, states=states)

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.pages.capacity_tokens

    @property
    def available(self) -> int:
        """Pages an allocation can get: the free ones and those only the prefix cache holds."""
        return self.pages.free + self.pages.evictable

    def match(self, request: "Request") -> int:
        """Start a request's KV from the longest cached prefix of its sequence (its pages held once more for it);
        how many tokens that is. The last token is always computed (its logits give the next one), and so is every
        prompt position before one that gets a logprob row (a row comes from the hidden state before it)."""
        sequence = request.sequence()
        limit = len(sequence) - 1
        if request.owes_prompt_logprobs:
            limit = min(limit, request.prompt_logprob_start - 1)
        tables, state = self.prefix_cache.match(sequence, limit)
        request.kv = KVState(tables, len(tables[0]) * self.page_size, epoch=self.prefix_cache.epoch,
                             restore=FRESH if state == NO_STATE else state)
        return request.kv.computed

    def _span(self, request: "Request", window: int, end: int) -> tuple[int, int]:
        """The pages [first, last) a group of `window` needs for the request's next row, up to position `end`."""
        return first_visible_page(request.kv.computed, window, self.page_size), self.pages.pages_for(end)

    def pages_needed(self, request: "Request", end: int) -> int:
        """Pages `request` needs beyond its own for its next row, up to position `end`."""
        tables = request.kv.tables
        if tables and len(tables[0]) * self.page_size >= end:  # most decode steps: the pages it holds reach `end`
            return 0
        needed = 0
        for window, table in zip(self.windows, request.kv.tables or [[] for _ in self.windows]):
            first, last = self._span(request, window, end)
            needed += max(last - max(len(table), first), 0)
        return needed

    def allocate(self, request: "Request", end: int) -> None:
        """Pages for the request's next row, up to position `end`, evicting cached ones if the free ones are short
        (the caller checked `available`)."""
        kv = request.kv
        if not kv.tables:
            kv.tables = [[] for _ in self.windows]
        if new := self.pages_needed(request, end):
            if new > self.pages.free:
                self.prefix_cache.evict(new - self.pages.free)
            fresh = iter(self.pages.allocate(new))
            for window, table in zip(self.windows, kv.tables):
                first, last = self._span(request, window, end)
                table.extend([DROPPED] * (first - len(table)))
                table.extend(next(fresh) for _ in range(last - len(table)))
        boundary = end // self.page_size
        if self.states is not None and boundary * self.page_size > kv.computed and kv.capture is None:
            slot = self.states.allocate()
            if slot is None and self.prefix_cache.evict_state():
                slot = self.states.allocate()
            if slot is not None:  # else no checkpoint here: a later boundary takes one
                kv.capture = (boundary, slot)

    def computed(self, request: "Request", end: int, commit: bool) -> None:
        """A step computed the request's KV up to position `end`: a window group gives back the pages its next query
        no longer sees; `commit`: its full pages go in the prefix cache now (after a prefill chunk: for the next
        request with the same prefix, n samples or a session's next turn), those given back included."""
        kv = request.kv
        kv.computed = end
        if kv.restore is not None:  # the row started from it: the checkpoint is the request's no more
            if kv.restore != FRESH:
                self.states.release(kv.restore)  # type: ignore[union-attr]
            kv.restore = None
        if kv.capture is not None:
            self._release_captured(kv)
            kv.captured, kv.capture = kv.capture, None
        if commit:
            self.commit(request)
        for window, table in zip(self.windows, kv.tables):
            if not window:
                continue
            first = first_visible_page(end, window, self.page_size)
            if passed := [page for page in table[:first] if page != DROPPED]:
                self.pages.release(passed)
                table[:first] = [DROPPED] * min(first, len(table))

    def commit(self, request: "Request") -> None:
        """Put the full pages of the request's computed tokens in the prefix cache, unless its KV predates the
        cache's epoch (older weights)."""
        kv = request.kv
        full = kv.computed // self.page_size
        if full > kv.committed_pages and kv.epoch == self.prefix_cache.epoch:
            if self.prefix_cache.insert(request.sequence(), kv.tables, full, kv.captured):
                kv.captured = None  # the cache keeps it
            kv.committed_pages = full

    def free(self, request: "Request", commit: bool = True) -> None:
        """The request lets go of its pages (its full pages put in the prefix cache first, unless `commit` is
        False: an admission that did not happen computed nothing)."""
        if commit:
            self.commit(request)
        kv = request.kv
        for table in kv.tables:
            self.pages.release([page for page in table if page != DROPPED])
        if self.states is not None:
            self._release_captured(kv)
            for slot in (kv.restore, kv.capture and kv.capture[1]):
                if slot not in (None, FRESH):
                    self.states.release(slot)  # type: ignore[arg-type]
        request.kv = KVState()

    def _release_captured(self, kv: KVState) -> None:
        """Let go of the last checkpoint taken, which the prefix cache did not keep."""
        if kv.captured is not None:
            self.states.release(kv.captured[1])  # type: ignore[union-attr]
            kv.captured = None

    def flush(self) -> None:
        """Forget every cached page (the weights changed)."""
        self.prefix_cache.flush()

    def next_page_in(self, request: "Request", prefills: "list[BatchRow]") -> bool:
        """Whether one of `prefills` (a step's prefill rows) computes the next full page of the request's
        sequence: then it may wait a step and find that page cached (n samples of one prompt prefill it once)."""
        upto = request.kv.computed + self.page_size
        sequence = request.sequence()
        if not self.prefix_cache.enabled or upto > len(sequence) - 1:
            return False
        for row in prefills:
            other = row.request
            if not other.decoding and row.end >= upto and other.length > upto and \
                    np.array_equal(other.sequence()[:upto], sequence[:upto]):
                return True
        return False

    def stats(self) -> KVStats:
        pages = self.pages
        return KVStats(pages_total=pages.usable, pages_held=pages.usable - pages.free - pages.evictable,
                       pages_cached=self.prefix_cache.cached_pages, page_size=pages.page_size)
