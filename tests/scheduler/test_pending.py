"""Output waiting to ship: rows put in by step, shipped per request, checked against the rows each step produced."""

import random

import numpy as np
from flatwire_wire.logprobs import LogprobRows

from services.scheduler.output.pending import FIRST_LANES, PendingOutput, PendingStores, shipped_block

K, M = 8, 3  # the step's widths: the widest request's


def _step_rows(n: int, rng: np.random.Generator) -> LogprobRows[np.ndarray]:
    rows = LogprobRows.allocate(n, K, M)
    rows.token_logprobs[:] = rng.standard_normal(n)
    rows.topk_values[:] = rng.standard_normal((n, K))
    rows.topk_ids[:] = rng.integers(0, 1000, (n, K))
    rows.ids_logprobs[:] = rng.standard_normal((n, M))
    return rows


def _run(requests: list[PendingOutput], steps: int, seed: int, end_early: float = 0.0,
         joins: list[int] | None = None, behind: float = 0.0) -> int:
    """Steps of every request (from its step in `joins`, if given) adding a token; ships what is due (or ends,
    with probability `end_early`; the subscribers are behind at a step with probability `behind`) and checks
    each shipped request's rows against those its steps produced. Returns the number of rows checked."""
    rng, chance = np.random.default_rng(seed), random.Random(seed)
    stores = PendingStores()
    expected: list[list[tuple]] = [[] for _ in requests]  # per request: its waiting rows, cut to its widths
    checked = 0
    for step in range(steps):
        step_rows = _step_rows(len(requests), rng)
        with_rows, sources = [], []
        for row, output in enumerate(requests):
            if joins and joins[row] > step:
                continue
            output.add(row)
            if output.widths is not None:
                with_rows.append(output)
                sources.append(row)
                k, m = output.widths
                expected[row].append((step_rows.token_logprobs[row].copy(), step_rows.topk_values[row, :k].copy(),
                                      step_rows.topk_ids[row, :k].copy(), step_rows.ids_logprobs[row, :m].copy()))
        stores.put(with_rows, sources, step_rows)
        del step_rows  # a step's arrays do not outlive it
        late = chance.random() < behind
        shipping = [i for i, output in enumerate(requests)
                    if output.count and (output.due(late) or chance.random() < end_early)]
        if not shipping:
            continue
        order, block = shipped_block([requests[i] for i in shipping])
        assert sorted(order) == list(range(len(shipping)))
        for position, j in enumerate(order):
            i = shipping[j]
            got = block.request(position)
            assert got.token_logprobs.shape[0] == len(expected[i]) == (requests[i].count if requests[i].widths else 0)
            for n, want in enumerate(expected[i]):
                for array, value in zip(got.arrays, want):
                    np.testing.assert_array_equal(array[n], value)
            checked += len(expected[i])
            expected[i] = []
            requests[i].shipped()
    return checked


def test_rows_ship_as_they_were_produced_across_widths_intervals_and_requests_without_logprobs():
    widths = [(K, M), (K, 0), (2, 1), None, (K, M)]
    requests = [PendingOutput(interval, widths[i % len(widths)]) for i, interval in enumerate([1, 1, 4, 4, 7] * 3)]
    assert _run(requests, steps=30, seed=1, end_early=0.1) > 0


def test_staggered_first_entries_ship_early_then_every_interval(monkeypatch):
    requests = [PendingOutput(7, (K, M), first_interval=1 + i % 7) for i in range(21)]
    shipped_at: list[list[int]] = [[] for _ in requests]  # per request: its output length at each ship
    ship = PendingOutput.shipped

    def recording(self):
        shipped_at[requests.index(self)].append(self.first_position + self.count)
        ship(self)

    monkeypatch.setattr(PendingOutput, "shipped", recording)
    assert _run(requests, steps=30, seed=4) == sum(at[-1] for at in shipped_at)
    for i, at in enumerate(shipped_at):
        assert at == list(range(1 + i % 7, 31, 7)), (i, at)


def test_output_that_ships_every_step_waits_up_to_its_lane_while_the_subscribers_are_behind(monkeypatch):
    requests = [PendingOutput(1, widths, lane=4) for widths in [(K, M), (2, 0), None] * 4]
    counts: list[int] = []  # of every entry shipped
    ship = PendingOutput.shipped

    def recording(self):
        counts.append(self.count)
        ship(self)

    monkeypatch.setattr(PendingOutput, "shipped", recording)
    assert _run(requests, steps=40, seed=5, end_early=0.05, behind=0.7) > 0
    assert max(counts) == 4 and 1 in counts  # lanes filled while behind, single rows while not


def test_a_store_grows_past_its_first_lanes_and_keeps_the_rows_it_holds():
    requests = [PendingOutput(5, (K, M)) for _ in range(3 * FIRST_LANES + 1)]
    joins = [i * 4 // len(requests) for i in range(len(requests))]  # the later ones grow it while rows wait
    assert _run(requests, steps=14, seed=2, joins=joins) == 10 * len(requests)


def test_partial_entries_ship_with_their_count_and_a_released_lane_is_reused():
    stores = PendingStores()
    rng = np.random.default_rng(3)
    first, second = PendingOutput(10, (K, M)), PendingOutput(10, (K, M))
    for _ in range(3):
        first.add(1)
        stores.put([first], [0], _step_rows(1, rng))
    lane = first.first_row
    order, block = shipped_block([first])
    assert block.rows == [3] and block.topk == [K] and block.id_counts == [M]
    first.release_lane()  # it ended (or its step failed) without shipping again
    second.add(1)
    stores.put([second], [0], _step_rows(1, rng))
    assert second.first_row == lane
