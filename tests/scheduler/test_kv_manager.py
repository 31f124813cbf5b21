"""The KV manager alone (kv/manager.py over kv/pages.py and kv/prefix_cache.py): allocate, match, commit, free,
evict and flush, for full-attention groups and sliding-window groups; every page accounted for after each step
(held by requests, cached, or free), as mini-sglang's cache-allocation tests check."""

import numpy as np
import pytest
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest

from services.scheduler.kv.manager import FRESH, KVManager, longest_sequence
from services.scheduler.kv.prefix_cache import DROPPED
from services.scheduler.kv.states import StateSlots
from services.scheduler.request import Request
from services.scheduler.submit import SubmitLimits, parse_request

PAGE = 4
LIMITS = SubmitLimits(1000, 1 << 20, 8, (), output_interval=50)


def request(rid: str, tokens: list[int], logprob_start_len: int = -1) -> Request:
    return parse_request(TokenizedRequest(rid=rid, input_ids=tokens, sampling=SamplingParams(max_new_tokens=64),
                                          logprob=LogprobParams(return_logprob=logprob_start_len >= 0,
                                                                logprob_start_len=logprob_start_len)), LIMITS)


def tokens(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, length).tolist()


def run_prefill(kv: KVManager, r: Request) -> None:
    """Match, then compute the rest of the prompt in one row (its full pages committed, as after a chunk)."""
    kv.match(r)
    kv.allocate(r, r.length)
    kv.computed(r, r.length, commit=True)


def decode(kv: KVManager, r: Request, steps: int) -> None:
    """`steps` decode rows of one token each: the token sampled last is computed, and one more is sampled."""
    for token in range(steps):
        r.append_output(token)
        kv.allocate(r, r.length)
        kv.computed(r, r.length, commit=False)


def check_accounting(kv: KVManager, requests: list[Request]) -> None:
    """Every page is free, or held: by the requests that list it and the cache if it caches it."""
    pages = kv.pages
    held: dict[int, int] = {}
    for r in requests:
        for table in r.kv.tables:
            for page in table:
                if page != DROPPED:
                    held[page] = held.get(page, 0) + 1
    cached = {page for node in kv.prefix_cache._nodes() for page in node.pages if page != DROPPED}
    for page in range(1, pages.num_pages):
        assert pages.refs[page] == held.get(page, 0) + (page in cached), page
    assert pages.free == sum(1 for page in range(1, pages.num_pages) if pages.refs[page] == 0)
    assert pages.evictable == sum(1 for page in cached if pages.refs[page] == 1)
    assert kv.prefix_cache.cached_pages == len(cached)


def test_allocate_commit_match_and_free():
    kv = KVManager(32, PAGE)
    first = request("a", tokens(0, 10))
    run_prefill(kv, first)
    assert len(first.kv.tables[0]) == 3 and first.kv.committed_pages == 2
    check_accounting(kv, [first])
    again = request("b", tokens(0, 10) + [5, 6])
    assert kv.match(again) == 8  # the two full pages
    assert again.kv.tables[0] == first.kv.tables[0][:2]
    kv.free(first)
    check_accounting(kv, [again])
    kv.free(again, commit=False)
    check_accounting(kv, [])
    assert kv.pages.free + kv.pages.evictable == kv.pages.usable


def test_match_stops_before_the_first_position_that_owes_a_logprob_row():
    kv = KVManager(32, PAGE)
    run_prefill(kv, request("a", tokens(1, 17)))
    assert kv.match(request("b", tokens(1, 17), logprob_start_len=9)) == 8  # row 9 needs the hidden state of 8


def test_eviction_gives_back_least_recently_used_leaves_when_pages_run_short():
    kv = KVManager(9, PAGE)  # 8 usable pages
    old, new = request("old", tokens(2, 12)), request("new", tokens(3, 12))
    for r in (old, new):
        run_prefill(kv, r)
        kv.free(r)
    assert kv.pages.free == 2 and kv.pages.evictable == 6
    big = request("big", tokens(4, 20))  # 5 pages: evicts the older prompt's
    run_prefill(kv, big)
    check_accounting(kv, [big])
    assert kv.match(request("x", tokens(3, 12))) == 8 and kv.match(request("y", tokens(2, 12))) == 0


def test_flush_forgets_the_cache_and_old_kv_is_never_cached():
    kv = KVManager(32, PAGE)
    running = request("running", tokens(5, 9))
    run_prefill(kv, running)
    kv.flush()
    assert kv.prefix_cache.cached_pages == 0 and kv.match(request("b", tokens(5, 9))) == 0
    decode(kv, running, 4)
    kv.free(running)  # its KV predates the flush: not cached
    assert kv.prefix_cache.cached_pages == 0
    check_accounting(kv, [])


def test_a_window_group_keeps_only_the_pages_its_window_sees():
    """Window 8 over pages of 4: a decoding row keeps at most the window's pages, the one it starts in and the one
    being filled; a full group keeps every page."""
    kv = KVManager(64, PAGE, windows=(8, 0), prefix_cache=False)
    r = request("r", tokens(6, 20))
    run_prefill(kv, r)
    for _ in range(30):
        decode(kv, r, 1)
        window, full = r.kv.tables
        assert sum(page != DROPPED for page in window) <= 8 // PAGE + 2
        assert DROPPED not in full and len(full) == kv.pages.pages_for(r.length)
        check_accounting(kv, [r])
    kv.free(r)
    assert kv.pages.free == kv.pages.usable


def test_a_windowed_prefix_resumes_only_where_the_window_pages_are_held():
    """A cached prefix serves a window group only up to a point whose window the cache still holds; pages evicted
    from the window (tombstones) shorten the match, and a request that computes them again fills them in."""
    kv = KVManager(64, PAGE, windows=(8, 0))
    prompt = tokens(7, 24)
    first = request("first", prompt)
    run_prefill(kv, first)
    kv.free(first)
    again = request("again", prompt + [1])
    assert kv.match(again) == 24
    assert again.kv.tables[0][:4] == [DROPPED] * 4  # positions before 17 are outside the window of position 24
    kv.free(again, commit=False)
    # Every interior node's window page, then the last node whole (its two pages): no window is left whole, so
    # nothing can be resumed from.
    assert kv.prefix_cache.evict(6) == 7
    assert kv.prefix_cache.nodes == 5 and all(node.pages[0] == DROPPED for node in kv.prefix_cache._nodes())
    check_accounting(kv, [])
    late = request("late", prompt + [1])
    assert kv.match(late) == 0
    kv.free(late, commit=False)
    refill = request("refill", prompt)
    run_prefill(kv, refill)
    kv.free(refill)
    check_accounting(kv, [])
    assert kv.match(request("end", prompt + [1])) == 24


def test_eviction_drops_window_pages_of_interior_nodes_before_whole_leaves():
    kv = KVManager(64, PAGE, windows=(8, 0))
    r = request("r", tokens(8, 24))
    run_prefill(kv, r)
    kv.free(r)
    assert kv.prefix_cache.evict(2) == 2
    assert kv.prefix_cache.nodes == 6  # no node removed: two interior window pages went
    nodes = sorted(kv.prefix_cache._nodes(), key=lambda node: node.last_use)
    assert all(node.pages[1] != DROPPED for node in nodes)
    check_accounting(kv, [])


@pytest.mark.parametrize("windows,pages,expected", [
    ((0,), 11, 40),  # 10 usable pages of 4 tokens
    ((0, 0), 11, 20),  # two full groups: a token takes a page slot in each
    ((8, 0), 11, 20),  # the window group holds at most (chunk + window) / 4 + 2 = 5 pages: 5 are left for the rest
    ((8,), 11, 1 << 62),  # every group windowed: any length fits in 5 pages
    ((8,), 4, 12),  # not the 4 pages a longer sequence reaches: the longest whose pages fit
])
def test_longest_sequence(windows, pages, expected):
    assert longest_sequence(pages, PAGE, windows, prefill_budget=4) == expected


def test_linear_attention_state_resumes_only_at_a_checkpoint():
    """A model with linear-attention layers: a row that reaches a page's end takes a checkpoint (a state slot after
    the running ones), which the prefix cache keeps with that page's node; a request resumes its state only at a node
    that keeps one, starting from a copy of it; every slot is free again once nothing holds it."""
    states = StateSlots(running=2, checkpoints=3)
    kv = KVManager(64, PAGE, states=states)
    first = request("first", tokens(9, 10))
    first.slot = 0
    kv.match(first)
    kv.allocate(first, first.length)
    assert first.kv.restore == FRESH and first.kv.capture == (2, 2)  # the state after 8 tokens, into slot 2
    kv.computed(first, first.length, commit=True)
    assert first.kv.captured is None and states.refs[2] == 1  # the cache keeps it
    decode(kv, first, 3)  # positions 10, 11, 12: the row ending at 12 takes the state after page 3
    assert first.kv.captured == (3, 3)
    kv.free(first)  # page 3's node keeps it
    assert states.free == 1
    again = request("again", tokens(9, 10) + [0, 1, 2, 7])  # its prompt continues the first's output
    assert kv.match(again) == 12 and again.kv.restore == 3 and states.refs[3] == 2
    kv.allocate(again, again.length)
    kv.computed(again, again.length, commit=True)  # the row started from it: the request lets go of it
    assert states.refs[3] == 1 and again.kv.restore is None
    kv.free(again)
    short = request("short", tokens(9, 7))  # pages hold up to 4, but no checkpoint after page 1: resumes nowhere
    assert kv.match(short) == 0
    kv.free(short, commit=False)
    kv.flush()
    assert states.free == states.checkpoints
    check_accounting(kv, [])
