"""The body of a Qwen3-Coder / Qwen3.5 tool call (SGLang's `qwen3_coder`, vLLM's `qwen3_xml`), as their chat
templates write it between `<tool_call>` and `</tool_call>`:

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>

A value is raw text (the template writes a string as it is and anything else as JSON, each between newlines),
typed back by the tool's JSON schema: a parameter that may only be a string keeps its text; one the schema
types otherwise is read as JSON where the text is JSON (where the schema also allows a string, only when the
JSON has a type it allows), else it keeps its text, so that nothing the model wrote is lost. A parameter the
schema does not name is text (SGLang's and vLLM's reading). A value ends at its `</parameter>`, or where the
next parameter or the function's end begins (a model that left the tag out, as SGLang and vLLM read it).

Read while it is written, a call has its name once `<function=NAME>` is complete; a string parameter grows as
its text arrives (never with a newline or tag start that may yet turn out to end it, so that what is read is
always a prefix of the final value), any other parameter appears once it is complete.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)
# What the end of a value still being written may be the start of: an end, after the template's newline or not.
VALUE_END_STARTS = VALUE_ENDS + tuple("\n" + end for end in VALUE_ENDS)
LONGEST_END_START = max(len(start) for start in VALUE_END_STARTS)


@dataclass
class FunctionRead:
    """What a call's text so far says."""

    name: str | None = None  # once `<function=NAME>` is complete
    arguments: dict[str, object] = field(default_factory=dict)  # the parameters read so far, typed
    whole: bool = False  # a declared function's, ended by `</function>` and nothing but whitespace after it


def read_function(body: str, schemas: Mapping[str, dict | None]) -> FunctionRead:
    """`body`: a call's text after `<tool_call>`, so far or whole; `schemas`: each declared function's parameters
    schema, by name."""
    text = body.lstrip()
    if not text.startswith(FUNCTION_OPEN):
        return FunctionRead()
    name_end = text.find(">", len(FUNCTION_OPEN))
    if name_end < 0:
        return FunctionRead()
    name = text[len(FUNCTION_OPEN):name_end]
    read = FunctionRead(name)
    if name not in schemas:  # never a call: its parameters are not worth reading
        return read
    properties = _properties(schemas[name])
    at = name_end + 1
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if text.startswith(FUNCTION_CLOSE, at):
            read.whole = not text[at + len(FUNCTION_CLOSE):].strip()
            return read
        if not text.startswith(PARAMETER_OPEN, at):  # more to come, or text that is not this format
            return read
        key_end = text.find(">", at)
        if key_end < 0:
            return read
        key, start = text[at + len(PARAMETER_OPEN):key_end], key_end + 1
        schema = properties.get(key)
        end, marker = _value_end(text, start)
        if marker is None:  # still being written
            if _is_text(schema):
                read.arguments[key] = _written_so_far(text[start:])
            return read
        read.arguments[key] = typed(_value(text[start:end]), schema)
        at = end + len(marker) if marker == PARAMETER_CLOSE else end


def _value_end(text: str, start: int) -> tuple[int, str | None]:
    """Where the value from `start` ends and the marker that ends it; (len(text), None) while none has come."""
    found = [(at, marker) for marker in VALUE_ENDS if (at := text.find(marker, start)) >= 0]
    return min(found) if found else (len(text), None)


def _value(raw: str) -> str:
    """The value the template wrote between its newlines."""
    return raw.removeprefix("\n").removesuffix("\n")


def _written_so_far(raw: str) -> str:
    """A value still being written: its text up to what may yet turn out to be its end."""
    text = raw.removeprefix("\n")
    for size in range(min(len(text), LONGEST_END_START), 0, -1):
        if any(start.startswith(text[-size:]) for start in VALUE_END_STARTS):
            return text[:-size]
    return text


def _properties(parameters: dict | None) -> dict:
    properties = (parameters or {}).get("properties")
    return properties if isinstance(properties, dict) else {}


def _types(schema: object) -> set[str]:
    """The JSON types a schema allows (its `type`, its anyOf and oneOf options', its enum values'); empty when it
    does not say."""
    if not isinstance(schema, dict):
        return set()
    kinds = schema.get("type")
    types = {kind for kind in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(kind, str)}
    for options in (schema.get("anyOf"), schema.get("oneOf")):
        for option in options if isinstance(options, list) else []:
            types |= _types(option)
    if not types and isinstance(schema.get("enum"), list):
        types = {_json_type(value) for value in schema["enum"]}
    return types


def _is_text(schema: object) -> bool:
    return _types(schema) <= {"string"}


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    for kind, name in ((float, "number"), (str, "string"), (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def _allows(types: set[str], value: object) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: json.dumps would write them back as non-JSON


def typed(text: str, schema: object) -> object:
    """A parameter's text as its schema types it."""
    types = _types(schema)
    if types <= {"string"}:
        return text
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return text
    # The template writes a string as it is: JSON that reads as one (quoted) is that text.
    return text if isinstance(value, str) or ("string" in types and not _allows(types, value)) else value
