"""One choice's assistant turn: the model's text, piece by piece, split into reasoning, content and tool
calls by the parsers the request and the server chose. The unary response is its pieces merged (a call's
fragments joined), so a stream and the unary response say the same thing, except for a call that breaks after
its name was streamed (tool_calls.py)."""

import uuid
from dataclasses import dataclass, field

from services.gateway.agents.reasoning import ThinkBlock
from services.gateway.agents.text_scan import TrimmedStream
from services.gateway.agents.tool_calls import Parsed, ToolCallParser


@dataclass(frozen=True)
class CallDelta:
    """A piece of the turn's `index`-th call (OpenAI's tool_calls[].index): the first has its id and name, each a
    piece of its arguments' JSON text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class TurnPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: "TurnPiece") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class AssistantTurn:
    """`think`: the reasoning parser (None: no separation); `tools`: the tool-call parser (None: no tools);
    `stream_reasoning=False` holds the reasoning back until it is complete (SGLang's stream_reasoning);
    `max_calls` keeps the first calls only (parallel_tool_calls false: one)."""

    def __init__(self, think: ThinkBlock | None = None, tools: ToolCallParser | None = None,
                 stream_reasoning: bool = True, max_calls: int | None = None):
        self._think, self._tools = think, tools
        self._stream_reasoning = stream_reasoning
        self._held_reasoning = ""
        self._max_calls = max_calls
        self._content = TrimmedStream(strip_leading=False) if tools is not None else None
        self.calls = 0  # calls started

    @property
    def separates_reasoning(self) -> bool:
        return self._think is not None

    def feed(self, text: str) -> TurnPiece:
        if self._think is None:
            return self._answer(text)
        reasoning, answer = self._think.feed(text)
        piece = self._reasoning(reasoning, done=self._think.closed)
        piece.extend(self._answer(answer))
        return piece

    def end(self) -> TurnPiece:
        piece = TurnPiece()
        if self._think is not None:
            reasoning, answer = self._think.end()
            piece.extend(self._reasoning(reasoning, done=True))
            piece.extend(self._answer(answer))
        if self._tools is not None:
            piece.extend(self._parsed(self._tools.end(), end=True))
        return piece

    def _reasoning(self, reasoning: str, done: bool) -> TurnPiece:
        if self._stream_reasoning:
            return TurnPiece(reasoning=reasoning)
        self._held_reasoning += reasoning
        if not done:
            return TurnPiece()
        held, self._held_reasoning = self._held_reasoning, ""
        return TurnPiece(reasoning=held)

    def _answer(self, text: str) -> TurnPiece:
        if self._tools is None:
            return TurnPiece(content=text)
        return self._parsed(self._tools.feed(text), end=False) if text else TurnPiece()

    def _parsed(self, parsed: Parsed, end: bool) -> TurnPiece:
        assert self._content is not None
        content = self._content.feed(parsed.content)
        calls = []
        for fragment in parsed.calls:
            if self._max_calls is not None and fragment.call >= self._max_calls:
                continue
            if fragment.name is not None:
                self.calls += 1
            calls.append(CallDelta(fragment.call, call_id() if fragment.name is not None else None, fragment.name,
                                   fragment.arguments))
        if end:  # whitespace around calls is not content
            content += self._content.end(keep_trailing=not self.calls)
        return TurnPiece(content=content, calls=calls)
