"""One request's outputs as they arrive, entry by entry, in buffers sized for its whole output.

An entry is a run of the request's consecutive tokens (one per step while it streams,
--output-interval of them otherwise). Each is copied once into the request's buffers:
its token ids, its text delta and, when logprobs were asked, its rows of the message's
LogprobBlock (numpy slices of whole buffers). Reading hands out views of the buffers,
so nothing is joined, and no Python object per token is kept until the request ends
(the garbage collector has nothing to chase).

Tokens are taken by position: an entry already held (a replay after a hop restarted)
is dropped; one past the next expected, one that overlaps what is held (a replay that
changed the entries' bounds), or one without the logprob rows the request asked for
(lost beyond the scheduler's replay window) raises OutputLost.
"""

from dataclasses import dataclass

import numpy as np

from services.common.arrays import I32, BlockOffsets, LogprobArrays, block_offsets, decode_block, request_slice
from services.common.pb import arrays_pb2, scheduler_pb2
from services.gateway.result import LogprobTrack, VersionSpan, version_spans


@dataclass
class MessageRows:
    """A message's LogprobBlock as numpy views, and where each entry's rows are."""

    arrays: LogprobArrays
    offsets: BlockOffsets

    @classmethod
    def of(cls, block: arrays_pb2.LogprobBlock) -> "MessageRows":
        arrays = decode_block(block)
        return cls(arrays, block_offsets(arrays.rows, arrays.topk, arrays.id_counts))

    def entry(self, i: int) -> LogprobArrays:
        return request_slice(self.arrays, self.offsets, i)


class OutputLost(Exception):
    """Part of a request's output can no longer arrive; the message says which."""


class Accumulator:
    def __init__(self, logprob: scheduler_pb2.LogprobParams, max_tokens: int):
        self.token_ids: list[int] = []
        self._texts: list[str] = []  # one delta per entry
        self._rows = (LogprobTrack.allocate(max_tokens, logprob.top_logprobs_num, len(logprob.token_ids_logprob))
                      if logprob.return_logprob else None)
        self._read = 0  # tokens already handed out
        self._texts_read = 0
        self.weight_versions: list[VersionSpan] = []  # which weights made the tokens held

    def add(self, position: int, token_ids: list[int], text: str, rows: MessageRows | None, i: int,
            weight_version: str) -> bool:
        """Take entry i of a message, made by the weights labelled `weight_version`: `token_ids` from `position`
        on; False when it is held already."""
        have, count = len(self.token_ids), len(token_ids)
        if position < have:
            if position + count > have:
                raise OutputLost(f"output tokens {position}..{position + count - 1} arrived again with other bounds")
            return False
        if position > have:
            raise OutputLost(f"output tokens {have}..{position - 1} never arrived")
        if self._rows is not None:
            entry = rows.entry(i) if rows is not None else None
            if entry is None or entry.rows[0] != count:
                raise OutputLost(f"the logprobs of output tokens {position}..{position + count - 1} are no longer "
                                 "retained")
            if position + count > len(self._rows.token_logprobs):
                raise OutputLost(f"more output tokens than the {len(self._rows.token_logprobs)} asked for arrived")
            self._rows.put(position, entry)
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

    def take(self) -> tuple[list[int], str, LogprobTrack | None]:
        """Tokens, text and logprob rows that arrived since the previous take."""
        start, self._read = self._read, len(self.token_ids)
        texts, self._texts_read = self._texts[self._texts_read:], len(self._texts)
        return self.token_ids[start:], "".join(texts), self._track(start, self._read)

    def whole(self) -> tuple[list[int], str, LogprobTrack | None]:
        return list(self.token_ids), "".join(self._texts), self._track(0, len(self.token_ids))

    def _track(self, start: int, end: int) -> LogprobTrack | None:
        if self._rows is None:
            return None
        return self._rows.view(start, end, np.asarray(self.token_ids[start:end], dtype=I32))
