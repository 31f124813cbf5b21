"""One request's outputs as they arrive, entry by entry, in buffers sized for its whole output.

An entry is a run of the request's consecutive tokens (one per step while it streams,
--output-interval of them otherwise). Each is copied once into the request's buffers:
its token ids, its text delta and, when logprobs were asked, its rows of the message's
LogprobBlock (numpy slices of whole buffers). Reading hands out views of the buffers,
so nothing is joined, and no Python object per token is kept until the request ends
(the garbage collector has nothing to chase).

Tokens are taken by position (flatwire_wire.steps entry_order): an entry already held
(a replay after a hop restarted) is dropped; one past the next expected, one that
overlaps what is held (a replay that changed the entries' bounds), or one without the
logprob rows the request asked for (lost beyond the scheduler's replay window) raises
OutputLost.
"""

import numpy as np
from flatwire_wire.logprobs import I32, LogprobBlock, RequestLogprobs
from flatwire_wire.public import WeightVersionSpan
from flatwire_wire.scheduler import LogprobParams
from flatwire_wire.steps import EntryOrder, entry_order, lost_output

from services.gateway.result import version_spans


class OutputLost(Exception):
    """Part of a request's output can no longer arrive; the message says which."""


class Accumulator:
    def __init__(self, logprob: LogprobParams, max_tokens: int):
        self.token_ids: list[int] = []
        self._texts: list[str] = []  # one delta per entry
        self._rows = (RequestLogprobs.allocate(max_tokens, logprob.top_logprobs_num, len(logprob.token_ids_logprob))
                      if logprob.return_logprob else None)
        self._capacity = max_tokens  # rows of _rows
        self._read = 0  # tokens already handed out
        self._texts_read = 0
        self.weight_versions: list[WeightVersionSpan] = []  # which weights made the tokens held

    def add(self, position: int, token_ids: list[int], text: str, rows: LogprobBlock | None, i: int,
            weight_version: str) -> bool:
        """Take entry i of a message (its rows: request i of `rows`), made by the weights labelled
        `weight_version`: `token_ids` from `position` on; False when it is held already."""
        have, count = len(self.token_ids), len(token_ids)
        if position != have:  # (the usual entry is the next one: entry_order's first case, without the call)
            order = entry_order(position, count, have)
            if order is EntryOrder.HELD:
                return False
            raise OutputLost(lost_output(order, position, count, have))
        if self._rows is not None:
            if rows is None or rows.rows[i] != count:
                raise OutputLost(f"the logprobs of output tokens {position}..{position + count - 1} are no longer "
                                 "retained")
            if position + count > self._capacity:
                raise OutputLost(f"more output tokens than the {self._capacity} asked for arrived")
            rows.copy_request(i, self._rows, position)
        self.token_ids.extend(token_ids)
        self._texts.append(text)
        version_spans(self.weight_versions, weight_version, position, count)
        return True

    @property
    def unread(self) -> int:
        return len(self.token_ids) - self._read

    @property
    def read_any(self) -> bool:
        return self._read > 0

    def take(self) -> tuple[list[int], str, RequestLogprobs | None]:
        """Tokens, text and logprob rows that arrived since the previous take."""
        start, self._read = self._read, len(self.token_ids)
        texts, self._texts_read = self._texts[self._texts_read:], len(self._texts)
        return self.token_ids[start:], "".join(texts), self._logprobs(start, self._read)

    def whole(self) -> tuple[list[int], str, RequestLogprobs | None]:
        return list(self.token_ids), "".join(self._texts), self._logprobs(0, len(self.token_ids))

    def _logprobs(self, start: int, end: int) -> RequestLogprobs | None:
        if self._rows is None:
            return None
        return self._rows.view(start, end, np.asarray(self.token_ids[start:end], dtype=I32))
