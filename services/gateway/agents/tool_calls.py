"""Tool calls parsed out of the model's text, in the formats SGLang's --tool-call-parser names.

- `qwen25` (also `qwen`, and vLLM's `hermes`): any number of
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks; the text around them is content.
- `llama3`: Llama 3's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), several separated by `;`; any other output is content.
- `qwen3_coder` (also vLLM's `qwen3_xml`): Qwen3.5's, Qwen3-Next's and Qwen3-Coder's `<tool_call>` blocks around
  an XML function, `<function=NAME>` with a `<parameter=KEY>` block per argument, typed by the tool's schema
  (xml_calls.py). A server without --tool-call-parser reads a model's output with it when its chat template
  writes calls so (template_tool_call_parser).

With `tool_choice` required or naming a function, the output is JSON that the grammar forced
(tool_choice.py), whatever the model's format: ForcedCalls reads it, and cut short (max_tokens) it is still
the calls it had begun, unary as streamed.

A parser is fed the text piece by piece and then ended; it hands on content as soon as it cannot be the
start of a call, and calls as fragments (call_stream.py). Unary (`stream=False`), each call goes out whole once
complete, and a call it cannot read, one cut short, or one of a function the request did not declare (OpenAI
never calls one) is content: malformed model output never fails the request; a whole call the output ended on
without its closing tag is a call. Streamed, a call goes out from the moment its name is complete (and
declared) and its arguments have begun as an object, its arguments piece by piece (as OpenAI streams them); one
that breaks after that stays a call, with the arguments that went out (a stream cannot take back what it
sent). So a streamed llama3 output that starts as a call is calls, where unary reads
the whole output first: JSON followed by words is content.
"""

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from typing import Protocol

from services.gateway.agents.call_stream import (
    CallFragment,
    ParseSchedule,
    StreamedCall,
    StreamedCalls,
    ToolCall,
    partial_json,
)
from services.gateway.agents.text_scan import split_at_marker
from services.gateway.agents.xml_calls import PARAMETER_OPEN, read_function

PYTHON_TAG = "<|python_tag|>"


class ToolCallParserName(StrEnum):
    QWEN25 = "qwen25"
    QWEN = "qwen"
    HERMES = "hermes"
    LLAMA3 = "llama3"
    QWEN3_CODER = "qwen3_coder"
    QWEN3_XML = "qwen3_xml"  # vLLM's name for it


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallFragment] = field(default_factory=list)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> Parsed: ...

    def end(self) -> Parsed: ...


def _call_of(value: object, argument_keys: tuple[str, ...], functions: frozenset[str]) -> ToolCall | None:
    """{"name": one of `functions`, <argument key>: object} -> a call; anything else None."""
    if not isinstance(value, dict) or value.get("name") not in functions:
        return None
    arguments: object = next((value[key] for key in argument_keys if key in value), {})
    if arguments is None:  # "arguments": null: a call without any (as SGLang reads it)
        arguments = {}
    elif isinstance(arguments, str):  # some models write the arguments as a JSON string
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
    """qwen25 / hermes: `<tool_call>{json}</tool_call>` blocks among content. A block's body is read by `_whole`
    and `_partial` (JSON here; a subclass reads another format in the same blocks)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self, functions: frozenset[str], stream: bool = False) -> None:
        self._functions = functions
        self._stream = stream
        self._held = ""
        self._open: StreamedCall | None = None  # the block being read
        self._parses = ParseSchedule()  # of its body
        self._calls = 0

    def feed(self, text: str) -> Parsed:
        parsed, pending = Parsed(), self._held + text
        while True:
            if self._open is None:
                before, opened, pending = split_at_marker(pending, self.OPEN)
                parsed.content += before
                if opened is None:
                    break
                self._open, self._parses = StreamedCall(self._calls), ParseSchedule()
            body, closed, rest = split_at_marker(pending, self.CLOSE)
            if closed is None:  # the call is not complete yet: all of it is held
                if self._stream:
                    parsed.calls += self._update(body)
                break
            call = self._whole(body)
            if call is not None:
                parsed.calls += self._open.finish(call)
            elif self._open.named:  # broken after its name went out: what of its arguments reads as JSON
                parsed.calls += self._close(body)
            else:
                parsed.content += self.OPEN + body + self.CLOSE
            self._calls += self._open.named
            pending, self._open = rest, None
        self._held = pending
        return parsed

    def _whole(self, body: str) -> ToolCall | None:
        """The call a block's whole body is; None if it is not one."""
        return _call_of(_json(body.strip()), self.ARGUMENT_KEYS, self._functions)

    def _partial(self, body: str) -> tuple[object, object]:
        """(its name where complete, its arguments so far) of a block's body so far."""
        assert self._open is not None
        value = partial_json(body.lstrip())
        if not isinstance(value, dict):
            return None, None
        named = None if self._open.named else partial_json(body.lstrip(), complete_strings=True)
        name = named.get("name") if isinstance(named, dict) else None
        return name, next((value[key] for key in self.ARGUMENT_KEYS if key in value), None)

    def _update(self, body: str, force: bool = False) -> list[CallFragment]:
        assert self._open is not None
        if not self._parses.due(len(body)) and not force:
            return []
        name, arguments = self._partial(body)
        return self._open.update(name if name in self._functions else None, arguments)

    def _close(self, body: str) -> list[CallFragment]:
        assert self._open is not None
        return self._update(body, force=True) + self._open.close()

    def end(self) -> Parsed:
        held, self._held = self._held, ""
        if self._open is None:
            return Parsed(held)
        if (call := self._whole(held)) is not None:
            calls = self._open.finish(call)  # whole but never closed (the model stopped at its end): a call
        elif self._open.named:  # cut short after its name went out: it stays a call
            calls = self._close(held)
        else:
            calls = []
        self._open = None
        return Parsed(calls=calls) if calls else Parsed(self.OPEN + held)  # a call cut short is content


class XmlCalls(TaggedCalls):
    """qwen3_coder / qwen3_xml: `<tool_call>` blocks around Qwen3-Coder's XML function (xml_calls.py), its
    parameters typed by the tool's schema. Streamed, the name goes out as soon as `<function=NAME>` is complete."""

    def __init__(self, schemas: Mapping[str, dict | None], stream: bool = False) -> None:
        super().__init__(frozenset(schemas), stream)
        self._schemas = schemas

    def _whole(self, body: str) -> ToolCall | None:
        read = read_function(body, self._schemas)
        if not read.whole or read.name is None:
            return None
        return ToolCall(read.name, json.dumps(read.arguments, ensure_ascii=False))

    def _partial(self, body: str) -> tuple[object, object]:
        read = read_function(body, self._schemas)
        return read.name, read.arguments

    def _update(self, body: str, force: bool = False) -> list[CallFragment]:
        assert self._open is not None
        # Read at every piece until the name is out, so that it goes out as soon as it is complete (the text
        # before it is short).
        return super()._update(body, force or not self._open.named)


class JsonCalls:
    """llama3: the whole output is the calls (JSON objects, `;` between them), or none of it is. Streamed, an
    output that starts as one (`{` or the python tag) is read as calls, as SGLang's llama3 parser reads it."""

    ARGUMENT_KEYS = ("parameters", "arguments")

    def __init__(self, functions: frozenset[str], stream: bool = False) -> None:
        self._functions = functions
        self._stream = stream
        self._text = ""
        self._calls: bool | None = None  # None until the output's first characters tell
        self._streamed = StreamedCalls()
        self._parses = ParseSchedule()

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
        return Parsed(calls=self._update()) if self._calls and self._stream else Parsed()

    def _update(self, force: bool = False) -> list[CallFragment]:
        if not self._parses.due(len(self._text)) and not force:
            return []
        items, tail = _complete_objects(self._body())
        complete = [_call_of(item, self.ARGUMENT_KEYS, self._functions) for item in items]
        names: list[object] = [item.get("name") if isinstance(item, dict) else None for item in items]
        if tail:
            item, named = partial_json(tail), partial_json(tail, complete_strings=True)
            items.append(item)
            names.append(named.get("name") if isinstance(named, dict) else None)
        known: list[object] = [name if name in self._functions else None for name in names]
        return self._streamed.update(known, items, self.ARGUMENT_KEYS, complete)

    def _body(self) -> str:
        return self._text.strip().removeprefix(PYTHON_TAG)

    def end(self) -> Parsed:
        calls = _json_sequence(self._body(), self._functions) if self._calls else None
        if calls:
            parsed = Parsed(calls=self._streamed.finish(calls))
        elif self._streamed.named:  # broken or cut short after a name went out: the calls stay
            parsed = Parsed(calls=self._update(force=True) + self._streamed.close())
        else:
            parsed = Parsed(self._text)
        self._text = ""
        return parsed


def _complete_objects(text: str, separator: str = ";") -> tuple[list[object], str]:
    """The JSON values that `text` holds complete (`separator` and whitespace between them), and what follows
    them."""
    decoder, at = json.JSONDecoder(), 0
    values: list[object] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == separator):
            at += 1
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            return values, text[at:]
        values.append(value)
        at = end


def _json_sequence(text: str, functions: frozenset[str]) -> list[ToolCall] | None:
    """JSON objects separated by `;` (and whitespace) -> calls; None unless every one is a call."""
    values, tail = _complete_objects(text)
    calls = [_call_of(value, JsonCalls.ARGUMENT_KEYS, functions) for value in values]
    return [call for call in calls if call is not None] if calls and all(calls) and not tail else None


class ForcedCalls:
    """tool_choice required (a JSON array of {"name", "parameters"}) or a named function (its arguments'
    JSON object): the grammar makes the output that JSON, so the calls stream from it (with `stream`)."""

    def __init__(self, functions: frozenset[str], function: str | None, stream: bool = False):
        self._functions = functions
        self._function = function
        self._stream = stream
        self._text = ""
        self._streamed = StreamedCalls()
        self._parses = ParseSchedule()

    def feed(self, text: str) -> Parsed:
        self._text += text
        return Parsed(calls=self._update()) if self._stream else Parsed()

    def _update(self, force: bool = False) -> list[CallFragment]:
        if not self._parses.due(len(self._text)) and not force:
            return []
        value = partial_json(self._text)
        if self._function is not None:
            return self._streamed.call(0).update(self._function, value)
        if not isinstance(value, list):
            return []
        named = partial_json(self._text, complete_strings=True)
        names = [item.get("name") if isinstance(item, dict) else None for item in named] if isinstance(
            named, list) else []
        known = [name if name in self._functions else None for name in names]
        complete = [_call_of(item, ("parameters",), self._functions) for item in value[:-1]]  # a later one began
        return self._streamed.update(known, value, ("parameters",), complete)

    def end(self) -> Parsed:
        value = _json(self._text)
        if self._function is not None:  # (the grammar makes it an object: None is text that does not parse)
            calls = [_call_of({"name": self._function, "arguments": value}, ("arguments",), self._functions)
                     if value is not None else None]
        else:
            calls = [_call_of(item, ("parameters",), self._functions) for item in value] if isinstance(
                value, list) else []
        if calls and all(calls):
            parsed = Parsed(calls=self._streamed.finish([call for call in calls if call is not None]))
        else:
            # Cut short (max_tokens): every call whose name is complete, with its arguments as far as they were
            # written (closed), unary as streamed: a forced call stays a call (OpenAI's answer too, with
            # finish_reason length). Nothing named yet is content.
            fragments = self._update(force=True)
            parsed = Parsed(calls=fragments + self._streamed.close()) if self._streamed.named else Parsed(self._text)
        self._text = ""
        return parsed


def tool_call_parser(name: ToolCallParserName, schemas: Mapping[str, dict | None],
                     stream: bool = False) -> ToolCallParser:
    """The parser for the output of a request that declared the functions `schemas` names (each one's parameters
    schema)."""
    if name is ToolCallParserName.LLAMA3:
        return JsonCalls(frozenset(schemas), stream)
    if name in (ToolCallParserName.QWEN3_CODER, ToolCallParserName.QWEN3_XML):
        return XmlCalls(schemas, stream)
    return TaggedCalls(frozenset(schemas), stream)


# How a chat template writes a call as `<tool_call>` around `<function=NAME>` (then `<parameter=KEY>` values);
# its newline is an escape in a Jinja string, or a real one.
XML_CALL_TEMPLATE = re.compile(r"<tool_call>(?:\\n|\s)*<function=")


@cache
def template_tool_call_parser(template: str | None) -> ToolCallParserName | None:
    """The parser for the format a model's chat template writes calls in, where it is one that only one parser
    reads (Qwen3.5's, Qwen3-Next's and Qwen3-Coder's XML); None for any other."""
    if template and XML_CALL_TEMPLATE.search(template) and PARAMETER_OPEN in template:
        return ToolCallParserName.QWEN3_CODER
    return None
