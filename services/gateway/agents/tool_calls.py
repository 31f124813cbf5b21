"""Tool calls parsed out of the model's text, in the formats SGLang's --tool-call-parser names.

- `qwen25` (also `qwen`, and vLLM's `hermes`): any number of
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks; the text around them is content.
- `llama3`: Llama 3's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), several separated by `;`; any other output is content.

With `tool_choice` required or naming a function, the output is JSON that the grammar forced
(tool_choice.py), whatever the model's format: ForcedCalls reads it.

A parser is fed the text piece by piece (a stream) and then ended; it hands on content as soon as it
cannot be the start of a call, and each call once it is complete. A call it cannot read is content:
malformed model output never fails the request.
"""

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from services.gateway.agents.text_scan import split_at_marker

PYTHON_TAG = "<|python_tag|>"


class ToolCallParserName(StrEnum):
    QWEN25 = "qwen25"
    QWEN = "qwen"
    HERMES = "hermes"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> Parsed: ...

    def end(self) -> Parsed: ...


def _call_of(value: object, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": str, <argument key>: object} -> a call; anything else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: object = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class TaggedCalls:
    """qwen25 / hermes: `<tool_call>{json}</tool_call>` blocks among content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._held = ""
        self._inside = False

    def feed(self, text: str) -> Parsed:
        parsed, pending = Parsed(), self._held + text
        while True:
            if not self._inside:
                before, opened, pending = split_at_marker(pending, self.OPEN)
                parsed.content += before
                if opened is None:
                    break
                self._inside = True
            body, closed, rest = split_at_marker(pending, self.CLOSE)
            if closed is None:
                break  # the call is not complete yet: all of it is held
            call = _call_of(_json(body.strip()), ("arguments", "parameters"))
            if call is None:
                parsed.content += self.OPEN + body + self.CLOSE
            else:
                parsed.calls.append(call)
            pending, self._inside = rest, False
        self._held = pending
        return parsed

    def end(self) -> Parsed:
        held, self._held = self._held, ""
        return Parsed((self.OPEN if self._inside else "") + held)  # a call cut short is content


class JsonCalls:
    """llama3: the whole output is the calls (JSON objects, `;` between them), or none of it is."""

    def __init__(self) -> None:
        self._text = ""
        self._calls: bool | None = None  # None until the output's first characters tell

    def feed(self, text: str) -> Parsed:
        if self._calls is False:
            return Parsed(text)
        self._text += text
        if self._calls is None:
            head = self._text.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._calls = True
            elif not PYTHON_TAG.startswith(head):  # (an empty head starts every string)
                self._calls = False
                held, self._text = self._text, ""
                return Parsed(held)
        return Parsed()

    def end(self) -> Parsed:
        text, self._text = self._text, ""
        calls = _json_sequence(text.strip().removeprefix(PYTHON_TAG)) if self._calls else None
        return Parsed(calls=calls) if calls else Parsed(text)


def _json_sequence(text: str) -> list[ToolCall] | None:
    """JSON objects separated by `;` (and whitespace) -> calls; None unless every one is a call."""
    decoder, at = json.JSONDecoder(), 0
    calls: list[ToolCall] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_of(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


class ForcedCalls:
    """tool_choice required (a JSON array of {"name", "parameters"}) or a named function (its arguments'
    JSON object): read when the output ends."""

    def __init__(self, function: str | None):
        self._function = function
        self._text = ""

    def feed(self, text: str) -> Parsed:
        self._text += text
        return Parsed()

    def end(self) -> Parsed:
        text, self._text = self._text, ""
        value = _json(text)
        if self._function is not None:
            call = _call_of({"name": self._function, "arguments": value}, ("arguments",))
            return Parsed(calls=[call]) if call else Parsed(text)
        calls = [_call_of(item, ("parameters",)) for item in value] if isinstance(value, list) else []
        if calls and all(calls):
            return Parsed(calls=[call for call in calls if call is not None])
        return Parsed(text)


def tool_call_parser(name: ToolCallParserName) -> ToolCallParser:
    return JsonCalls() if name is ToolCallParserName.LLAMA3 else TaggedCalls()
