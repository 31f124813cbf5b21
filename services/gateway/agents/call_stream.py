"""One tool call streamed as OpenAI streams it: its first fragment carries its name (as soon as the name is
complete and its arguments have begun as an object), the next ones pieces of its arguments' JSON text, and the
pieces join to the arguments the unary response gives (json.dumps of the parsed object). Of several calls, each
is whole before the next begins.

Arguments stream from a partial parse of the text so far (partial-json-parser, as SGLang does): the dump of
the partial object, cut before its trailing closing marks, is a prefix of the final dump, because a number
(or Infinity, NaN) enters the partial object only once complete and a string grows only at its end. The prefix
that grew since the last piece is the next piece.
"""

import json
import logging
from dataclasses import dataclass

from partial_json_parser import Allow, loads

log = logging.getLogger(__name__)

PARTIAL = Allow.ALL & ~Allow.NUM & ~Allow.INFINITY & ~Allow.NAN
COMPLETE_STRINGS = PARTIAL & ~Allow.STR  # a name read under this is never half of one
CLOSERS = '}]"'


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class CallFragment:
    """A piece of a parser's `call`-th call: the first has its name, each a piece of its arguments' text."""

    call: int
    name: str | None = None
    arguments: str = ""


def partial_json(text: str, complete_strings: bool = False) -> object:
    """The JSON value that `text` starts (None when it cannot be one)."""
    try:
        return loads(text, COMPLETE_STRINGS if complete_strings else PARTIAL)
    except Exception:  # malformed text raises ValueError, IndexError or an AssertionError in the parser
        return None


class ParseSchedule:
    """When text that grows piece by piece is worth parsing whole again. A parse reads all of it, so parses come
    at least an eighth of its length apart (linear work in all for a long call, an agent's tool writing a file,
    where a parse per piece would be quadratic), and at least MIN_GROWTH characters apart (a parse costs tens of
    microseconds: per token, it cost a short call three times its unary parse)."""

    MIN_GROWTH = 16  # characters: about four tokens

    def __init__(self) -> None:
        self._parsed_at = -self.MIN_GROWTH

    def due(self, length: int) -> bool:
        if length - self._parsed_at < max(self.MIN_GROWTH, length // 8):
            return False
        self._parsed_at = length
        return True


class StreamedCall:
    def __init__(self, call: int):
        self.call = call
        self.named = False  # its name has gone out: from then on it is a call, whatever follows
        self._sent = ""  # the arguments' text sent so far
        self._arguments: dict = {}  # the last partial value read

    def update(self, name: object, arguments: object) -> list[CallFragment]:
        """`name`: the call's name if complete (else None); `arguments`: its partial arguments value. The name
        goes out once the arguments have begun as an object: a call whose arguments are something else (null, a
        list, JSON in a string) is read whole at its end, as the unary response reads it."""
        header: str | None = None
        if not self.named:
            if not isinstance(name, str) or not isinstance(arguments, dict):
                return []
            header, self.named = name, True
        piece = ""
        if isinstance(arguments, dict):
            self._arguments = arguments
            stable = json.dumps(arguments, ensure_ascii=False).rstrip(CLOSERS)
            if stable and "\ud800" <= stable[-1] <= "\udbff":  # half of an escaped surrogate pair: the next has it
                stable = stable[:-1]
            if len(stable) > len(self._sent) and stable.startswith(self._sent):
                piece, self._sent = stable[len(self._sent):], stable
        return [CallFragment(self.call, header, piece)] if header is not None or piece else []

    def close(self) -> list[CallFragment]:
        """The call will not grow (it broke, or the output ended): the rest of the last arguments read, closed so
        that what was sent parses."""
        closed = json.dumps(self._arguments, ensure_ascii=False)
        if not self.named or len(closed) <= len(self._sent) or not closed.startswith(self._sent):
            return []
        piece, self._sent = closed[len(self._sent):], closed
        return [CallFragment(self.call, arguments=piece)]

    def finish(self, call: ToolCall) -> list[CallFragment]:
        """The rest of the complete `call`: its name too if it never went out."""
        header = None if self.named else call.name
        self.named = True
        if not call.arguments.startswith(self._sent):  # a key written twice: the stream showed the first value
            log.warning("tool call %d: its streamed arguments %r are not a prefix of %r", self.call, self._sent,
                        call.arguments)
            return [CallFragment(self.call, header)] if header is not None else []
        rest, self._sent = call.arguments[len(self._sent):], call.arguments
        return [CallFragment(self.call, header, rest)] if header is not None or rest else []


class StreamedCalls:
    """The calls of one output that holds several (a JSON list, or llama3's `;`-separated objects), each streamed
    as a StreamedCall."""

    def __init__(self) -> None:
        self._calls: list[StreamedCall] = []

    @property
    def named(self) -> bool:
        return any(call.named for call in self._calls)

    def update(self, names: list[object], items: list[object], argument_keys: tuple[str, ...],
               complete: list[ToolCall | None]) -> list[CallFragment]:
        """`items`: the calls' partial values so far; `names`: each one's name where complete; `complete`: the
        first items as calls where they are complete ones. A complete call goes out whole before the next one
        begins, as OpenAI streams parallel calls: a client may take a call's arguments as final (and parse
        them) once a later index appears."""
        fragments = []
        for i, item in enumerate(items):
            if i < len(complete) and (call := complete[i]) is not None:
                fragments += self.call(i).finish(call)
            elif isinstance(item, dict):
                fragments += self.call(i).update(names[i] if i < len(names) else None,
                                                 next((item[key] for key in argument_keys if key in item), None))
        return fragments

    def close(self) -> list[CallFragment]:
        return [fragment for call in self._calls for fragment in call.close()]

    def finish(self, calls: list[ToolCall]) -> list[CallFragment]:
        return [fragment for i, call in enumerate(calls) for fragment in self.call(i).finish(call)]

    def call(self, i: int) -> StreamedCall:
        while len(self._calls) <= i:
            self._calls.append(StreamedCall(len(self._calls)))
        return self._calls[i]
