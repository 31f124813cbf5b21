"""What one scheduler step ships, hop by hop: StepMessage and its parts, and the rule every hop applies to the
positions of a request's entries (docs/architecture.md, wire rules 1, 4 and 5).

An *entry* is a run of one request's consecutive output tokens: entry i of a StepMessage carries counts[i]
tokens of request rids[i], from its output position positions[i] on, at token_ids[starts[i]:starts[i] +
counts[i]], and (when the request asked for logprobs) request i of the `output` block: its rows; (when it asked for
top-p replay) request i of the `top_p` block: its tokens' nuclei.
"""

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from flatwire_wire.codec import from_proto, to_proto, twin
from flatwire_wire.lazy import lazy
from flatwire_wire.logprobs import LogprobBlock, decode_block, write_block
from flatwire_wire.nucleus import NucleusBlock, decode_nucleus_block, write_nucleus_block
from flatwire_wire.pb import arrays_pb2, scheduler_pb2


class FinishReason(enum.IntEnum):
    """Why a request ended (arrays.proto); an enum until the edge that renders it."""

    UNSPECIFIED = arrays_pb2.FINISH_REASON_UNSPECIFIED
    LENGTH = arrays_pb2.FINISH_REASON_LENGTH  # max_new_tokens or the context was reached
    STOP_TOKEN = arrays_pb2.FINISH_REASON_STOP_TOKEN  # an eos or stop_token_ids token was sampled
    STOP_STRING = arrays_pb2.FINISH_REASON_STOP_STRING  # a stop string matched (set by the detokenizer)
    ABORT = arrays_pb2.FINISH_REASON_ABORT  # aborted on a client's behalf
    # A server-side fault: never rendered as a finished response (HTTP 503, gRPC UNAVAILABLE).
    ERROR = arrays_pb2.FINISH_REASON_ERROR

    @property
    def api_name(self) -> str:
        """SGLang's and OpenAI's word for it: "length", "stop" or "abort"."""
        return _API_NAMES[self]


_API_NAMES = {FinishReason.LENGTH: "length", FinishReason.STOP_TOKEN: "stop", FinishReason.STOP_STRING: "stop",
              FinishReason.ABORT: "abort", FinishReason.ERROR: "error", FinishReason.UNSPECIFIED: ""}


@twin(scheduler_pb2.DetokenizeParams)
@dataclass
class DetokenizeParams:
    """Carried through the scheduler untouched, for the detokenizer."""

    skip_special_tokens: bool = False
    spaces_between_special_tokens: bool = False
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    min_new_tokens: int = 0  # stop strings match only once the output has this many tokens
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output


@twin(scheduler_pb2.RequestStart)
@dataclass
class RequestStart:
    """A request the scheduler accepted, announced before its first token (its owner and detokenize params)."""

    rid: str
    owner: str
    detokenize: DetokenizeParams = field(default_factory=DetokenizeParams)
    prompt_tokens: int = 0


@twin(scheduler_pb2.Finish)
@dataclass
class Finish:
    rid: str
    reason: FinishReason = FinishReason.UNSPECIFIED
    matched_token: int = 0  # STOP_TOKEN: the token that matched
    matched_stop: str = ""  # STOP_STRING: the string that matched
    message: str = ""  # ABORT, ERROR: why
    # Output tokens the request produced, all told: a hop holds its whole output only with positions
    # 0..output_tokens-1 (wire rule 5).
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens its first prefill found in the prefix cache
    # With return_routed_experts: int32 [tokens, layers, top_k] packed (routed_experts_of reads it).
    routed_experts: bytes = b""
    routed_experts_shape: list[int] = field(default_factory=list)
    # ERROR: a step that ran the request raised (HTTP 500, gRPC INTERNAL), not the scheduler going away (503).
    step_failed: bool = False

    def routed_experts_of(self) -> np.ndarray | None:
        """The routed experts as int32 [tokens, layers, top_k]; None when the request did not ask."""
        if not self.routed_experts_shape:
            return None
        return np.frombuffer(self.routed_experts, dtype="<i4").reshape(self.routed_experts_shape)


@twin(scheduler_pb2.RequestResume)
@dataclass
class RequestResume:
    """For a new step subscriber: a request whose first steps are no longer retained, and its output so far up
    to the first position the retained steps carry."""

    start: RequestStart
    output_ids: list[int]


class StepMessage:
    """One step's StepOutput (scheduler.proto), as every hop handles it; sliced per owner by the detokenizer.

    The one message every hop handles per step, so it is a typed view of the parsed protobuf message rather than a
    copy of it: its repeated fields read straight from the parsed buffer (sequences), its twins and logprob blocks
    are converted once, on first use. A message is built whole (the constructor takes every field) and not changed.
    """

    def __init__(self, step: int = 0, started: Sequence[RequestStart] = (), rids: Sequence[str] = (),
                 token_ids: Sequence[int] = (), output: LogprobBlock | None = None, prompt_rids: Sequence[str] = (),
                 prompt: LogprobBlock | None = None, finished: Sequence[Finish] = (), texts: Sequence[str] = (),
                 positions: Sequence[int] = (), resumed: Sequence[RequestResume] = (), counts: Sequence[int] = (),
                 weight_version: str = "", made_at_unix_us: int = 0, top_p: NucleusBlock | None = None):
        """Fields as scheduler.proto's StepOutput; entry i (of rids, positions, counts, texts) carries counts[i]
        tokens from output position positions[i] on, its rows are request i of `output` and its nuclei request i
        of `top_p`."""
        self._message = scheduler_pb2.StepOutput(
            step=step, started=[to_proto(s) for s in started], rids=rids, token_ids=token_ids, prompt_rids=prompt_rids,
            finished=[to_proto(f) for f in finished], texts=texts, positions=positions,
            resumed=[to_proto(r) for r in resumed], counts=counts, weight_version=weight_version,
            made_at_unix_us=made_at_unix_us)
        if output is not None:
            write_block(self._message.output, output)
        if prompt is not None:
            write_block(self._message.prompt, prompt)
        if top_p is not None:
            write_nucleus_block(self._message.top_p, top_p)
        # Kept as given: no conversion back when they are read.
        self.__dict__.update(started=list(started), finished=list(finished), resumed=list(resumed), output=output,
                             prompt=prompt, top_p=top_p)

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepMessage":
        return cls._of(scheduler_pb2.StepOutput.FromString(data))

    @classmethod
    def _of(cls, parsed: scheduler_pb2.StepOutput) -> "StepMessage":
        message = cls.__new__(cls)
        message._message = parsed
        return message

    def slice(self, keep: list[int], keep_prompt: list[int], started: Sequence[RequestStart],
              finished: Sequence[Finish], texts: Sequence[str]) -> "StepMessage":
        """The message cut down to entries `keep` and prompt rows `keep_prompt` (in their order), with `texts` for
        the kept entries and the given starts and finishes: the part of a step one gateway gets. The logprob
        and nucleus blocks are byte-sliced, and copied whole when every entry is kept."""
        m = self._message
        every = keep == list(range(len(m.rids)))
        sliced = scheduler_pb2.StepOutput(
            step=m.step, weight_version=m.weight_version, made_at_unix_us=m.made_at_unix_us,
            started=[to_proto(s) for s in started],
            finished=[to_proto(f) for f in finished], texts=texts,
            rids=m.rids if every else [m.rids[i] for i in keep],
            positions=m.positions if every else [m.positions[i] for i in keep],
            counts=m.counts if every else [m.counts[i] for i in keep],
            token_ids=m.token_ids if every else [t for i in keep for t in self.entry_tokens(i)],
            prompt_rids=[m.prompt_rids[i] for i in keep_prompt])
        if keep and m.HasField("output"):
            if every:
                sliced.output.CopyFrom(m.output)
            else:
                write_block(sliced.output, self.output.select(keep))  # type: ignore[union-attr]
        if keep and m.HasField("top_p"):
            if every:
                sliced.top_p.CopyFrom(m.top_p)
            else:
                write_nucleus_block(sliced.top_p, self.top_p.select(keep))  # type: ignore[union-attr]
        if keep_prompt and m.HasField("prompt"):
            write_block(sliced.prompt, self.prompt.select(keep_prompt))  # type: ignore[union-attr]
        message = StepMessage._of(sliced)
        message.__dict__.update(started=list(started), finished=list(finished))
        return message

    def to_bytes(self) -> bytes:
        return self.encoded

    # -- the fields (scheduler.proto documents each) --

    @property
    def step(self) -> int:
        return self._message.step

    @property
    def rids(self) -> Sequence[str]:  # per entry
        return self._message.rids

    @property
    def token_ids(self) -> Sequence[int]:  # the entries' tokens, concatenated
        return self._message.token_ids

    @property
    def positions(self) -> Sequence[int]:  # per entry: its first token's output position
        return self._message.positions

    @property
    def counts(self) -> Sequence[int]:  # per entry: its tokens (at least 1)
        return self._message.counts

    @property
    def texts(self) -> Sequence[str]:  # per entry, set by the detokenizer
        return self._message.texts

    @property
    def prompt_rids(self) -> Sequence[str]:  # requests whose prompt rows come in `prompt`
        return self._message.prompt_rids

    @property
    def weight_version(self) -> str:
        """The weights that produced every token of the entries (wire rule 6); "" in messages a detokenizer
        rebuilt from a RequestResume."""
        return self._message.weight_version

    @property
    def made_at_unix_us(self) -> int:  # when the scheduler made it (its clock); 0: not stamped
        return self._message.made_at_unix_us

    @lazy
    def started(self) -> list[RequestStart]:
        return [from_proto(RequestStart, s) for s in self._message.started]

    @lazy
    def finished(self) -> list[Finish]:
        return [from_proto(Finish, f) for f in self._message.finished]

    @lazy
    def resumed(self) -> list[RequestResume]:  # the first message of a subscription only
        return [from_proto(RequestResume, r) for r in self._message.resumed]

    @lazy
    def output(self) -> LogprobBlock | None:
        """Request i: entry i's rows; None when no entry's request asked for logprobs."""
        return decode_block(self._message.output) if self._message.HasField("output") else None

    @lazy
    def top_p(self) -> NucleusBlock | None:
        """Request i: entry i's nuclei; None when no entry's request asked for top-p replay."""
        return decode_nucleus_block(self._message.top_p) if self._message.HasField("top_p") else None

    @lazy
    def prompt(self) -> LogprobBlock | None:
        return decode_block(self._message.prompt) if self._message.HasField("prompt") else None

    # -- reading it --

    @lazy
    def starts(self) -> list[int]:
        """Where each entry's tokens start in token_ids."""
        return [0, *accumulate(self.counts)][:len(self.counts)]

    def entry_tokens(self, i: int) -> list[int]:
        start = self.starts[i]
        return list(self.token_ids[start:start + self.counts[i]])

    def entries(self) -> Iterator[tuple[str, list[int]]]:
        """Each entry's rid and tokens, in order: for a hop that takes every entry (a slice of the protobuf field
        per entry, as entry_tokens takes, costs several times this)."""
        token_ids, end = list(self._message.token_ids), 0
        for rid, count in zip(self._message.rids, self._message.counts):
            start, end = end, end + count
            yield rid, token_ids[start:end]

    def touched_rids(self) -> set[str]:
        """Every request the message concerns: what to fail when handling it went wrong."""
        return {*self.rids, *self.prompt_rids, *(f.rid for f in self.finished), *(r.start.rid for r in self.resumed)}

    @lazy
    def encoded(self) -> bytes:
        """The serialized message, made once (the journal sizes it, every subscriber is sent it)."""
        return self._message.SerializeToString()

    def __repr__(self) -> str:
        return f"StepMessage({str(self._message).strip()!r})"


# StepMessage's, which its test checks
STEP_FIELDS = ("step", "started", "rids", "token_ids", "output", "prompt_rids", "prompt", "finished", "texts",
               "positions", "resumed", "counts", "weight_version", "made_at_unix_us", "top_p")


def decode_step(data: bytes) -> StepMessage:
    return StepMessage.from_bytes(data)


def encode_step(message: StepMessage) -> bytes:
    return message.encoded


class EntryOrder(enum.Enum):
    """Where an entry falls against the next output position a hop expects of its request (wire rule 4)."""

    NEXT = "next"  # it starts there: take it
    HELD = "held"  # held already, whole (a replay repeats entries with their bounds): drop it
    GAP = "gap"  # it starts past it: the positions between never arrived
    OVERLAP = "overlap"  # it starts before and ends past it: a replay that changed the bounds


def entry_order(position: int, count: int, expected: int) -> EntryOrder:
    if position == expected:
        return EntryOrder.NEXT
    if position > expected:
        return EntryOrder.GAP
    return EntryOrder.OVERLAP if position + count > expected else EntryOrder.HELD


def lost_output(order: EntryOrder, position: int, count: int, expected: int) -> str:
    """Why a request whose entry falls as `order` (GAP or OVERLAP) cannot be whole."""
    if order is EntryOrder.GAP:
        return f"output tokens {expected}..{position - 1} never arrived"
    return f"output tokens {position}..{position + count - 1} arrived again with other bounds"
