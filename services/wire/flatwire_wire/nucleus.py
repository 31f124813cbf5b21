"""Top-p replay's layout: the nucleus each sampled token was drawn from, as flat ragged arrays (the ids top-k, top-p
and min-p kept: what the sampler could draw; a greedy token's is itself), in its forms and the conversions between
them. A trainer masks its own logits to each token's nucleus, so that it recomputes the token's probability over
the support the rollout sampled from (slime's top-p replay).

- Nuclei: a run of one request's tokens' nuclei: `offsets` (tokens + 1 of them, from 0) into `token_ids`, token i's
  ids being token_ids[offsets[i]:offsets[i + 1]] (ascending): slime's `top_p_token_ids` / `top_p_token_offsets`,
  what every API renders. A step's replay rows take the same form on the scheduler.
- NucleusBlock: the wire form (arrays.proto's): several requests' runs, as per-token sizes and ids concatenated in
  request order, so that a hop slices it per request by bytes, without rebasing offsets.
- NucleusTrack: one request's nuclei at the gateway, filled entry by entry in buffers that grow as they must (a
  nucleus's size is known only once its token is drawn).
"""

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from flatwire_wire.lazy import lazy
from flatwire_wire.logprobs import I32
from flatwire_wire.pb import arrays_pb2


@dataclass
class Nuclei:
    """Consecutive tokens' nuclei: token i's ids are token_ids[offsets[i]:offsets[i + 1]]."""

    offsets: np.ndarray  # [tokens + 1] int32, from 0
    token_ids: np.ndarray  # [offsets[-1]] int32

    @classmethod
    def of_sizes(cls, sizes: np.ndarray, token_ids: np.ndarray) -> "Nuclei":
        offsets = np.zeros(len(sizes) + 1, dtype=I32)
        np.cumsum(sizes, out=offsets[1:])
        return cls(offsets, token_ids)

    @classmethod
    def empty(cls) -> "Nuclei":
        return cls(np.zeros(1, I32), np.zeros(0, I32))

    @property
    def tokens(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets).astype(I32, copy=False)

    def of_token(self, i: int) -> np.ndarray:
        return self.token_ids[self.offsets[i]:self.offsets[i + 1]]

    @classmethod
    def concatenate(cls, parts: list["Nuclei"]) -> "Nuclei":
        """A stream's chunks joined."""
        return cls.of_sizes(np.concatenate([part.sizes for part in parts]),
                            np.concatenate([part.token_ids for part in parts]))


@dataclass
class NucleusBlock:
    """The wire form: request i owns tokens[i] tokens; each token's size, then the ids, concatenated in order."""

    tokens: list[int]
    sizes: bytes  # <i4 [sum tokens]
    token_ids: bytes  # <i4 [sum sizes]

    @classmethod
    def of_pieces(cls, tokens: list[int], pieces: list[tuple[bytes, bytes]]) -> "NucleusBlock":
        """Requests with `tokens` tokens each, and pieces that hold their sizes and ids in order (each a request's,
        or several consecutive requests'), as bytes of int32."""
        return cls(tokens, b"".join(sizes for sizes, _ in pieces), b"".join(ids for _, ids in pieces))

    def __len__(self) -> int:
        return len(self.tokens)

    @lazy
    def _sizes(self) -> np.ndarray:
        return np.frombuffer(self.sizes, I32)

    @lazy
    def _bounds(self) -> tuple[list[int], list[int]]:
        """Each request's first token and first id (len + 1 each, from 0)."""
        token_starts = [0, *accumulate(self.tokens)]
        id_starts = np.zeros(len(self._sizes) + 1, dtype=np.int64)
        np.cumsum(self._sizes, out=id_starts[1:])
        return token_starts, id_starts[token_starts].tolist()

    def request(self, i: int) -> Nuclei:
        """Request i's nuclei, its ids a view of the block's bytes."""
        tokens, ids = self._bounds
        return Nuclei.of_sizes(self._sizes[tokens[i]:tokens[i + 1]],
                               np.frombuffer(self.token_ids, I32)[ids[i]:ids[i + 1]])

    def select(self, keep: list[int]) -> "NucleusBlock":
        """The block restricted to requests `keep`, in that order, by byte slicing (itself when it keeps all)."""
        if keep == list(range(len(self.tokens))):
            return self
        tokens, ids = self._bounds
        sizes, token_ids = memoryview(self.sizes), memoryview(self.token_ids)
        return NucleusBlock([self.tokens[i] for i in keep],
                            b"".join(sizes[4 * tokens[i]:4 * tokens[i + 1]] for i in keep),
                            b"".join(token_ids[4 * ids[i]:4 * ids[i + 1]] for i in keep))


class NucleusTrack:
    """One request's nuclei as they arrive, entry by entry, in position order: offsets sized for its whole output,
    ids in a buffer that doubles when it fills (the views handed out keep the buffer they were made of)."""

    def __init__(self, max_tokens: int):
        self._offsets = np.zeros(max_tokens + 1, dtype=I32)
        self._ids = np.empty(1024, dtype=I32)
        self.tokens = 0

    def add(self, position: int, block: NucleusBlock, i: int) -> None:
        """Request i of `block`: the nuclei of the tokens from `position` (the next one) on."""
        part = block.request(i)
        first, end = self._offsets[position], self._offsets[position] + len(part.token_ids)
        if end > len(self._ids):
            grown = np.empty(max(2 * len(self._ids), int(end)), dtype=I32)
            grown[:first] = self._ids[:first]
            self._ids = grown
        self._ids[first:end] = part.token_ids
        self._offsets[position + 1:position + 1 + part.tokens] = part.offsets[1:] + first
        self.tokens = position + part.tokens

    def view(self, start: int, end: int) -> Nuclei:
        """Tokens start..end-1: offsets rebased to 0, ids a view."""
        first = self._offsets[start]
        return Nuclei(self._offsets[start:end + 1] - first, self._ids[first:self._offsets[end]])


def decode_nucleus_block(message: arrays_pb2.NucleusBlock) -> NucleusBlock:
    return NucleusBlock(list(message.tokens), message.sizes, message.token_ids)


def write_nucleus_block(target: arrays_pb2.NucleusBlock, block: NucleusBlock) -> None:
    """Fill a message's (empty) NucleusBlock field in place (as logprobs.write_block, for the same reason)."""
    target.tokens.extend(block.tokens)
    target.sizes = block.sizes
    target.token_ids = block.token_ids
