"""One tool call streamed as OpenAI streams it: its first fragment carries its name (as soon as the name is
complete), the next ones pieces of its arguments' JSON text, and the pieces join to the arguments the unary
response gives (json.dumps of the parsed object).

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
    at least an eighth of its length apart: every piece while it is short, and linear work in all for a long one
    (an agent's tool writing a file), where a parse per piece would be quadratic."""

    def __init__(self) -> None:
        self._parsed_at = -1

    def due(self, length: int) -> bool:
        if length - self._parsed_at <= length // 8:
            return False
        self._parsed_at = length
        return True


class StreamedCall:
    def __init__(self, call: int):
        self.call = call
        self.named = False  # its name has gone out: from then on it is a call, whatever follows
        self._sent = ""  # the arguments' text sent so far

    def update(self, name: object, arguments: object) -> list[CallFragment]:
        """`name`: the call's name if complete (else None); `arguments`: its partial arguments value."""
        header: str | None = None
        if not self.named:
            if not isinstance(name, str):
                return []
            header, self.named = name, True
        piece = ""
        if isinstance(arguments, dict):
            stable = json.dumps(arguments, ensure_ascii=False).rstrip(CLOSERS)
            if stable and "\ud800" <= stable[-1] <= "\udbff":  # half of an escaped surrogate pair: the next has it
                stable = stable[:-1]
            if len(stable) > len(self._sent) and stable.startswith(self._sent):
                piece, self._sent = stable[len(self._sent):], stable
        return [CallFragment(self.call, header, piece)] if header is not None or piece else []

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
