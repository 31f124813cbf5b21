"""A request's output since it last shipped: what its next StepMessage entry carries.

A request ships its tokens every `interval` tokens (1 while streaming) and when it ends, so a client that waits for
the whole output costs the hops one entry per interval instead of one per token. Its first entry may ship sooner
(`first_interval`): requests admitted together (an RL rollout's batch) whose first entries are staggered ship a
few each step, rather than all of them on the same step every `interval` (a message of every request's rows at
once, a step that stalls, and a burst of work for every hop after it).

A request that ships every step (it streams, or the detokenizer matches its stop strings) holds its output back
while a step subscriber is behind (it has not taken the last message), up to its lane (--stream-coalesce-tokens):
the tokens would wait in that queue anyway, and as fewer, larger entries they cost every hop less per token (a
hop's work is mostly per entry), which is what lets a hop that fell behind catch up.

Its logprob rows wait in a lane of a PendingRows store shared by the requests of its width (lane, k, m), so
that the per-request work of a step is Python bookkeeping only: one step's rows go in with one fancy-indexed copy
per array and store (PendingStores.put), and the rows that ship come out the same way (shipped_block). No step's
host arrays outlive the step (the model may reuse them). A request takes a lane with its first row after a ship
and gives it back when the entry ships: lanes are held only by output that waits.

A request with top-p replay keeps its tokens' nuclei (flatwire_wire.nucleus) as their sizes and the ids' bytes,
copied out of the step's host arrays as each token comes: a nucleus's size is known only once its token is drawn.
"""

import numpy as np
from flatwire_wire.logprobs import I32, LogprobBlock, LogprobRows
from flatwire_wire.nucleus import NucleusBlock

FIRST_LANES = 16  # a store doubles when its lanes run out (and keeps its size: at most the peak of waiting output)


class PendingRows:
    """Lanes of `lane` rows of one width (k, m): a lane is rows [first, first + lane)."""

    def __init__(self, lane: int, k: int, m: int):
        self.lane, self.k, self.m = lane, k, m
        self.rows = LogprobRows.allocate(FIRST_LANES * lane, k, m)
        self._free = list(range((FIRST_LANES - 1) * lane, -1, -lane))  # first rows, taken from the end

    def take(self) -> int:
        """A free lane's first row."""
        if not self._free:
            held = self.rows.n
            rows = LogprobRows.allocate(2 * held, self.k, self.m)
            rows.put(0, self.rows)
            self.rows = rows
            self._free.extend(range(2 * held - self.lane, held - 1, -self.lane))
        return self._free.pop()

    def give_back(self, first_row: int) -> None:
        self._free.append(first_row)


class PendingOutput:
    def __init__(self, interval: int, widths: tuple[int, int] | None, first_interval: int | None = None,
                 lane: int | None = None, top_p: bool = False):
        """`widths`: (k, m) of its logprob rows; None without logprobs; `first_interval`: tokens of its first
        entry (1 to `interval`; `interval` when None); `lane`: most tokens an entry holds, while the subscribers
        are behind (at least `interval`; `interval` when None); `top_p`: its tokens' nuclei ship with them."""
        self.interval = interval
        self.lane = max(lane or interval, interval)
        self.widths = widths
        self._due_at = first_interval or interval
        self.first_position = 0  # of token_ids[0] in the request's output
        self.token_ids: list[int] = []
        self.store: PendingRows | None = None  # whose lane holds its rows (from its first row after a ship)
        self.first_row = 0  # of that lane
        self.top_p = top_p
        self.nucleus_sizes: list[int] = []  # per pending token, with top_p
        self.nucleus_ids = bytearray()  # <i4, their ids

    @property
    def count(self) -> int:
        return len(self.token_ids)

    def due(self, behind: bool = False) -> bool:
        """Whether its entry ships now: an interval's worth is pending, or, for output held back while a subscriber
        is behind (`behind`: it has not taken the last message), a lane's worth."""
        held_back = behind and self.lane > self.interval  # (a staggered first entry keeps its stagger)
        return len(self.token_ids) >= (self.lane if held_back else self._due_at)

    def add(self, token: int) -> None:
        """A new token (its logprob row, if it has one, comes through PendingStores.put; its nucleus through
        add_nucleus)."""
        self.token_ids.append(token)

    def add_nucleus(self, ids: np.ndarray) -> None:
        """The latest token's nucleus (int32 ids, a view of the step's host arrays: copied)."""
        self.nucleus_sizes.append(len(ids))
        self.nucleus_ids += ids.tobytes()

    def shipped(self) -> None:
        """Its entry was built: start the next one."""
        self.first_position += len(self.token_ids)
        self.token_ids = []
        self.nucleus_sizes, self.nucleus_ids = [], bytearray()
        self._due_at = self.interval
        self.release_lane()

    def release_lane(self) -> None:
        """Give its lane back (it ships, or ends without shipping)."""
        if self.store is not None:
            self.store.give_back(self.first_row)
            self.store = None


class PendingStores:
    """The engine's PendingRows stores, one per width."""

    def __init__(self) -> None:
        self._stores: dict[tuple[int, int, int], PendingRows] = {}

    def put(self, pending: list[PendingOutput], sources: list[int], step_rows: LogprobRows[np.ndarray]) -> None:
        """The logprob rows of the tokens just added to `pending` (each its latest): row `sources[i]` of the step's
        rows, cut to its width."""
        targets = []
        for output in pending:
            if output.store is None:
                output.store = self._of(output)
                output.first_row = output.store.take()
            targets.append(output.first_row + len(output.token_ids) - 1)
        for store, members in _by_store(pending):
            assert store is not None, "every output here has taken a lane"
            into, k, m = store.rows, store.k, store.m
            at = np.array(targets if members is None else [targets[i] for i in members])
            rows = sources if members is None else [sources[i] for i in members]
            # Every row of the step (sources ascend): the step's arrays as they are, not gathered first.
            of = slice(None) if len(rows) == len(step_rows.token_logprobs) else np.array(rows)
            into.token_logprobs[at] = step_rows.token_logprobs[of]
            into.topk_values[at] = step_rows.topk_values[of, :k]
            into.topk_ids[at] = step_rows.topk_ids[of, :k]
            if m:
                into.ids_logprobs[at] = step_rows.ids_logprobs[of, :m]

    def _of(self, output: PendingOutput) -> PendingRows:
        k, m = output.widths  # type: ignore[misc]
        if (store := self._stores.get((output.lane, k, m))) is None:
            store = self._stores[output.lane, k, m] = PendingRows(output.lane, k, m)
        return store


def shipped_block(pending: list[PendingOutput]) -> tuple[list[int], LogprobBlock]:
    """The order to ship `pending` in (those of one store together) and the block of their rows in that order."""
    order: list[int] = []
    rows: list[int] = []
    topk: list[int] = []
    id_counts: list[int] = []
    pieces: list[tuple] = []
    for store, members in _by_store(pending):
        members = list(range(len(pending))) if members is None else members
        order += members
        if store is None:  # without logprobs: no rows
            rows += [0] * len(members)
            topk += [0] * len(members)
            id_counts += [0] * len(members)
            continue
        counts = [len(pending[i].token_ids) for i in members]
        rows += counts
        topk += [store.k] * len(members)
        id_counts += [store.m] * len(members)
        held = store.rows
        if all(count == 1 for count in counts):  # one row each (streaming, keeping up): gathered at once
            at = np.array([pending[i].first_row for i in members])
            pieces.append(tuple(array[at] for array in held.arrays))
        else:  # each lane's first `count` rows, by memoryview slices (much cheaper than numpy's)
            views = [memoryview(array) for array in held.arrays]
            for i, count in zip(members, counts):
                first = pending[i].first_row
                pieces.append(tuple(view[first:first + count] for view in views))
    return order, LogprobBlock.of_pieces(rows, topk, id_counts, pieces)


def shipped_nuclei(pending: list[PendingOutput]) -> NucleusBlock:
    """The nuclei of `pending`'s tokens, in that order (none for an output without top-p replay)."""
    replayed = [output for output in pending if output.top_p]
    return NucleusBlock.of_pieces([len(output.token_ids) if output.top_p else 0 for output in pending],
                                  [(np.array(output.nucleus_sizes, dtype=I32).tobytes(), bytes(output.nucleus_ids))
                                   for output in replayed])


def _by_store(pending: list[PendingOutput]) -> list[tuple[PendingRows | None, list[int] | None]]:
    """The outputs grouped by store (None: without logprobs): indices into `pending`, or None for all of them."""
    first = pending[0].store if pending else None
    if all(output.store is first for output in pending):  # the usual step: one width
        return [(first, None)]
    groups: dict[PendingRows | None, list[int]] = {}
    for i, output in enumerate(pending):
        groups.setdefault(output.store, []).append(i)
    return list(groups.items())
