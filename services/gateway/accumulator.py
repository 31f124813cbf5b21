"""One request's outputs as they arrive, entry by entry, in buffers sized for its whole output.

An entry is a run of the request's consecutive tokens (one per step while it streams,
--output-interval of them otherwise). Each is copied once into the request's buffers:
its token ids, its text delta and, when logprobs were asked, its rows of the message's
LogprobBlock (numpy slices of whole buffers), when top-p replay was asked, its tokens'
nuclei (flatwire_wire.nucleus.NucleusTrack); the prompt's rows come once. Reading hands
out reply.Output views of the buffers: what arrived since the previous read, or the whole
output up to a read. No Python object per token is kept until the request ends (the
garbage collector has nothing to chase).

Tokens are taken by position (flatwire_wire.steps entry_order): an entry already held
(a replay after a hop restarted) is dropped; one past the next expected, one that
overlaps what is held (a replay that changed the entries' bounds), or one without the
logprob rows or nuclei the request asked for (lost beyond the scheduler's replay window)
raises OutputLost.
"""

from collections.abc import Callable
from functools import partial

import numpy as np
from flatwire_wire.logprobs import I32, LogprobBlock, RequestLogprobs
from flatwire_wire.nucleus import Nuclei, NucleusBlock, NucleusTrack
from flatwire_wire.public import WeightVersionSpan
from flatwire_wire.scheduler import LogprobParams
from flatwire_wire.steps import EntryOrder, entry_order, lost_output

from services.gateway.reply import Output


def version_spans(spans: list[WeightVersionSpan], version: str, start: int, count: int) -> None:
    """Record that `count` tokens from position `start` on were made by `version` (runs of one version merge)."""
    if spans and spans[-1].version == version and spans[-1].end == start:
        spans[-1].end = start + count
    else:
        spans.append(WeightVersionSpan(version, start, start + count))


class OutputLost(Exception):
    """Part of a request's output can no longer arrive; the message says which."""


class Accumulator:
    def __init__(self, logprob: LogprobParams, max_tokens: int, top_p: bool = False):
        self.token_ids: list[int] = []
        self._texts: list[str] = []  # one delta per entry
        self._rows = (RequestLogprobs.allocate(max_tokens, logprob.top_logprobs_num, len(logprob.token_ids_logprob))
                      if logprob.return_logprob else None)
        self._ids_columns = list(logprob.token_ids_logprob) or None  # the ids of the ids_logprobs columns
        self._capacity = max_tokens  # rows of _rows
        self._nuclei = NucleusTrack(max_tokens) if top_p else None
        self.prompt: RequestLogprobs | None = None  # the prompt's rows, once they arrived
        self._prompt_read = False
        self._read = 0  # tokens already handed out
        self._texts_read = 0
        self._joined, self._joined_entries = "", 0  # the text of the first entries, for whole outputs
        self.weight_versions: list[WeightVersionSpan] = []  # which weights made the tokens held

    def add(self, position: int, token_ids: list[int], text: str, rows: LogprobBlock | None, i: int,
            weight_version: str, nuclei: NucleusBlock | None = None) -> bool:
        """Take entry i of a message (its rows: request i of `rows`, its nuclei request i of `nuclei`), made by the
        weights labelled `weight_version`: `token_ids` from `position` on; False when it is held already."""
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
        if self._nuclei is not None:
            if nuclei is None or nuclei.tokens[i] != count:
                raise OutputLost(f"the nuclei of output tokens {position}..{position + count - 1} are no longer "
                                 "retained")
            self._nuclei.add(position, nuclei, i)
        self.token_ids.extend(token_ids)
        self._texts.append(text)
        version_spans(self.weight_versions, weight_version, position, count)
        return True

    def end(self, weight_version: str) -> None:
        """The request ended: one that ended without a token was served, if at all, by the version then in force."""
        if not self.weight_versions:
            self.weight_versions.append(WeightVersionSpan(weight_version, 0, 0))

    def take(self) -> tuple[Output, Callable[[], Output] | None]:
        """What arrived since the previous take, and how to build the whole output up to here (None when that is
        what arrived)."""
        start, self._read = self._read, len(self.token_ids)
        texts, self._texts_read = self._texts[self._texts_read:], len(self._texts)
        prompt = None if self._prompt_read else self.prompt
        self._prompt_read = self.prompt is not None
        everything = start == 0 and prompt is self.prompt
        # An event without new tokens has no output rows to render (a whole output has its rows, if none).
        rows = self._logprobs(start, self._read) if self._read > start or everything else None
        new = Output(self.token_ids[start:], "".join(texts), rows, prompt, self._ids_columns,
                     self._top_p(start, self._read))
        return new, (None if everything else partial(self._upto, self._read, self._texts_read))

    def versions(self) -> list[WeightVersionSpan]:
        """The spans so far, as they stand (the last one grows with the next tokens)."""
        return [WeightVersionSpan(span.version, span.start, span.end) for span in self.weight_versions]

    def _upto(self, tokens: int, entries: int) -> Output:
        if entries >= self._joined_entries:  # a stream's next event: join only what came since the last
            self._joined += "".join(self._texts[self._joined_entries:entries])
            self._joined_entries = entries
            text = self._joined
        else:
            text = "".join(self._texts[:entries])
        return Output(self.token_ids[:tokens], text, self._logprobs(0, tokens), self.prompt, self._ids_columns,
                      self._top_p(0, tokens))

    def _top_p(self, start: int, end: int) -> Nuclei | None:
        return self._nuclei.view(start, end) if self._nuclei is not None else None

    def _logprobs(self, start: int, end: int) -> RequestLogprobs | None:
        if self._rows is None:
            return None
        return self._rows.view(start, end, np.asarray(self.token_ids[start:end], dtype=I32))
