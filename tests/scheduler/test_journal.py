"""The scheduler's step journal: what it keeps, and what a new subscriber is replayed."""

import time

from flatwire_wire.steps import Finish, RequestStart, StepMessage

from services.scheduler.output.journal import StepJournal


def _step(number: int, entries: dict[str, int], started=(), finished=(), padding: int = 0):
    """entries: rid -> position; the token is 100 + position."""
    return StepMessage(step=number, rids=list(entries), positions=list(entries.values()),
                       token_ids=[100 + p for p in entries.values()], counts=[1] * len(entries), texts=["x" * padding],
                       started=[RequestStart(rid=rid, owner="gw") for rid in started],
                       finished=[Finish(rid=rid, output_tokens=tokens) for rid, tokens in finished])


def test_replay_is_the_retained_steps_after_a_head_resuming_older_requests():
    journal = StepJournal(window_s=60, window_bytes=1 << 20)
    journal.record(_step(1, {"a": 0}, started=["a"]))
    journal.record(_step(2, {"a": 1, "b": 0}, started=["b"]))
    head, *steps = journal.replay()
    assert not head.resumed  # every start is retained: the steps alone say everything
    assert [s.step for s in steps] == [1, 2]


def test_requests_whose_start_was_dropped_are_resumed_from_their_ids():
    padding = 1000
    journal = StepJournal(window_s=60, window_bytes=3 * padding)  # about two steps
    journal.record(_step(1, {"a": 0}, started=["a"], padding=padding))
    journal.record(_step(2, {"a": 1, "b": 0}, started=["b"], padding=padding))
    journal.record(_step(3, {"a": 2, "b": 1}, padding=padding))
    journal.record(_step(4, {"a": 3, "b": 2}, finished=[("b", 3)], padding=padding))
    head, *steps = journal.replay()
    assert [s.step for s in steps] == [3, 4]
    assert journal.retained_bytes <= 3 * padding
    resumed = {r.start.rid: list(r.output_ids) for r in head.resumed}
    # Positions before the first retained one, as ids; b finished, but its Finish is still retained.
    assert resumed == {"a": [100, 101], "b": [100]}


def test_a_finished_request_is_forgotten_once_its_finish_is_dropped():
    journal = StepJournal(window_s=0.05, window_bytes=1 << 20)
    journal.record(_step(1, {"a": 0}, started=["a"], finished=[("a", 1)]))
    journal.record(_step(2, {"b": 0}, started=["b"]))
    time.sleep(0.1)
    head, *steps = journal.replay()
    assert steps == []
    assert [(r.start.rid, list(r.output_ids)) for r in head.resumed] == [("b", [100])]


def test_coalesced_entries_resume_from_the_first_retained_entry():
    """Entries of several tokens: the ids before the first retained entry are resumed, the entries kept whole."""
    padding = 1000
    journal = StepJournal(window_s=60, window_bytes=2 * padding + 200)
    journal.record(StepMessage(step=1, rids=["a"], positions=[0], counts=[3], token_ids=[100, 101, 102],
                               started=[RequestStart(rid="a", owner="gw")]))
    for number, position in ((2, 3), (3, 5), (4, 7)):
        journal.record(StepMessage(step=number, rids=["a"], positions=[position], counts=[2],
                                   token_ids=[100 + position, 101 + position], texts=["x" * padding]))
    head, *steps = journal.replay()
    assert [s.step for s in steps] == [3, 4]
    assert [list(r.output_ids) for r in head.resumed] == [[100, 101, 102, 103, 104]]


def test_a_rid_used_again_is_not_forgotten_with_its_earlier_request():
    """A request that reuses the rid of one that finished: when the earlier one's Finish leaves the window, the later
    one stays tracked (it was dropped, and its next entry raised KeyError: the whole step went unpublished)."""
    padding = 1000
    journal = StepJournal(window_s=60, window_bytes=3 * padding)
    journal.record(_step(1, {"busy": 0}, started=["busy"], finished=[("busy", 1)], padding=padding))
    journal.record(_step(2, {"busy": 0}, started=["busy"], padding=padding))
    for number in range(3, 6):  # the first step leaves the window
        journal.record(_step(number, {"busy": number - 2}, padding=padding))
    head, *steps = journal.replay()
    assert [s.step for s in steps] == [4, 5]
    assert [(r.start.rid, list(r.output_ids)) for r in head.resumed] == [("busy", [100, 101])]
