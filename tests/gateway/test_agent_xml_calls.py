"""The qwen3_coder tool-call parser (Qwen3.5's, Qwen3-Next's and Qwen3-Coder's XML calls) on text alone: calls as
Qwen3.5's chat template writes them, parameters typed by each tool's schema, several calls, content around them,
calls cut short, unary and streamed at every cut; and the template's text choosing the parser."""

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.common.default_model import CHAT_TEMPLATE
from services.common.tokenizer import load_tokenizer
from services.gateway.agents import tool_calls
from services.gateway.agents.tool_calls import (
    ToolCallParserName,
    XmlCalls,
    template_tool_call_parser,
    tool_call_parser,
)
from services.gateway.agents.turn import AssistantTurn
from services.gateway.agents.xml_calls import VALUE_ENDS, read_function, typed
from tests.gateway.qwen35_template import QWEN35_CHAT_TEMPLATE
from tests.gateway.test_agent_parsers import fragments, joined_calls, run, same_at_every_cut

STRING, INTEGER = {"type": "string"}, {"type": "integer"}
WEATHER = {"type": "object", "properties": {
    "city": STRING, "days": INTEGER, "scale": {"type": "number"}, "metric": {"type": "boolean"},
    "units": {"type": "object"}, "hours": {"type": "array", "items": INTEGER}, "note": {"type": ["string", "null"]},
    "mode": {"enum": ["fast", "slow"]}, "level": {"anyOf": [INTEGER, {"type": "null"}]}}}
SCHEMAS: dict[str, dict | None] = {
    "get_weather": WEATHER, "get_time": {"type": "object", "properties": {"zone": STRING}}, "ping": None,
    "write": {"type": "object", "properties": {"path": STRING, "content": STRING}}}


def call_text(name: str, arguments: dict) -> str:
    """A call as Qwen3.5's template writes it: a string as it is, anything else as JSON."""
    parameters = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                         for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def parse(text: str, schemas: dict[str, dict | None] | None = None):
    """(reasoning, content, calls), the same unary and streamed at every cut."""
    schemas = SCHEMAS if schemas is None else schemas
    return same_at_every_cut(lambda: AssistantTurn(None, XmlCalls(schemas)), text,
                             lambda: AssistantTurn(None, XmlCalls(schemas, True)))


def test_content_then_two_calls_as_the_template_writes_them():
    weather = {"city": "Paris", "days": 3}
    text = f"Let me look.\n\n{call_text('get_weather', weather)}\n{call_text('get_time', {'zone': 'CET'})}"
    assert parse(text) == ("", "Let me look.", [(0, "get_weather", weather), (1, "get_time", {"zone": "CET"})])


def test_parameters_are_typed_by_the_schema():
    arguments = {"city": "Paris, \"the\" capital\nof France", "days": 3, "scale": 2.5, "metric": False,
                 "units": {"t": "C", "w": ["km/h"]}, "hours": [6, 12], "note": None, "mode": "fast", "level": 4}
    assert parse(call_text("get_weather", arguments)) == ("", "", [(0, "get_weather", arguments)])


@pytest.mark.parametrize(("schema", "text", "value"), [
    ({"type": "string"}, "42", "42"),  # a string stays text, even one that reads as JSON
    ({"type": "string"}, "null", "null"),
    ({"type": "string"}, "  spaced  ", "  spaced  "),
    (None, "42", "42"),  # a parameter the schema does not name: text (SGLang's and vLLM's reading)
    ({"type": "integer"}, "forty", "forty"),  # not JSON: its text, nothing lost
    ({"type": "integer"}, "2.5", 2.5),  # JSON of another type than the schema's: the JSON
    ({"type": "number"}, "NaN", "NaN"),  # no JSON constant that would be written back as non-JSON
    ({"type": ["string", "integer"]}, "7", 7),
    ({"type": ["string", "integer"]}, "[7]", "[7]"),  # JSON of a type it does not allow: the string
    ({"type": ["string", "null"]}, "null", None),
    ({"type": ["string", "null"]}, '"quoted"', '"quoted"'),
    ({"enum": [1, 2]}, "2", 2),
    ({"oneOf": [{"type": "object"}, {"type": "string"}]}, '{"a": 1}', {"a": 1}),
])
def test_a_value_is_typed_as_its_schema_says(schema, text, value):
    assert typed(text, schema) == value


def test_a_function_without_a_schema_takes_its_parameters_as_text():
    assert parse(call_text("ping", {"host": "a", "count": 3})) == ("", "", [(0, "ping", {"host": "a", "count": "3"})])


def test_content_after_a_call_and_between_calls():
    text = f"First.\n{call_text('get_time', {'zone': 'CET'})}\nthen\n{call_text('ping', {})}\nDone."
    # (The newlines around a call are the content's, as the other parsers keep them; only its ends are trimmed.)
    assert parse(text) == ("", "First.\n\nthen\n\nDone.", [(0, "get_time", {"zone": "CET"}), (1, "ping", {})])


@pytest.mark.parametrize("text", [
    call_text("evil", {"x": "1"}),  # a function the request did not declare: OpenAI never calls one
    "<tool_call>\nnot a function\n</tool_call>",
    "A <tool_ of no call, <function=get_time> outside of one.",
])
def test_what_is_not_a_call_is_content(text):
    assert parse(text) == ("", text, [])


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function> and words\n</tool_call>",
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</tool_call>",  # no </function>
])
def test_a_call_that_breaks_after_its_name_is_content_unary_and_a_call_streamed(text):
    """The stream sent its name and cannot take it back (as with the other parsers)."""
    assert run(lambda: AssistantTurn(None, XmlCalls(SCHEMAS)), text, 4) == ("", text, [])
    assert run(lambda: AssistantTurn(None, XmlCalls(SCHEMAS, True)), text, 4) == (
        "", "", [(0, "get_time", {"zone": "CET"})])


def test_a_parameter_without_its_closing_tag_ends_where_the_next_begins():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n"
            "</tool_call>")
    assert parse(text) == ("", "", [(0, "get_weather", {"city": "Rome", "days": 2})])


def test_a_whole_call_the_output_ended_on_without_its_closing_tag_is_a_call():
    text = call_text("get_time", {"zone": "CET"}).removesuffix("\n</tool_call>")
    assert parse(text) == ("", "", [(0, "get_time", {"zone": "CET"})])


def test_a_call_cut_short_is_content_unary_and_a_call_streamed():
    """max_tokens cut it: unary, the text (as the other parsers); streamed, its name went out, so it stays a call
    with its arguments as far as they were written, closed so that they parse."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n<parameter=city>\nPar"
    assert run(lambda: AssistantTurn(None, XmlCalls(SCHEMAS)), text, 5) == ("", text, [])
    for piece in (1, 4, len(text)):
        assert run(lambda: AssistantTurn(None, XmlCalls(SCHEMAS, True)), text, piece) == (
            "", "", [(0, "get_weather", {"days": 4, "city": "Par"})])


def test_the_name_goes_out_as_soon_as_its_tag_is_complete():
    turn = AssistantTurn(None, XmlCalls(SCHEMAS, True))
    assert turn.feed("Checking.\n\n<tool_call>\n<function=get_wea").calls == []
    [first] = turn.feed("ther>").calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "{")
    assert first.id is not None and first.id.startswith("call_")


def test_a_typed_value_goes_out_whole_and_a_string_as_it_is_written():
    turn = AssistantTurn(None, XmlCalls(SCHEMAS, True))
    turn.feed("<tool_call>\n<function=get_weather>\n")
    pieces = [turn.feed(piece) for piece in ("<parameter=days>\n1", "2", "34567890123456789\n</parameter>\n",
                                             "<parameter=city>\nParis and", " far beyond the river Seine to the sea")]
    sent = [call.arguments for piece in pieces for call in piece.calls]
    assert sent[0] == '"days": 1234567890123456789'  # never "1" or "12": the number whole, once complete
    city = "".join(sent[1:])  # the string's text before its end came
    assert city.startswith(', "city": "Paris')
    assert ', "city": "Paris and far beyond the river Seine to the sea'.startswith(city)


def test_a_string_value_never_streams_what_may_be_its_end():
    """A newline, or the start of a tag, may end the value: it waits until the next text says it does not."""
    body = "<function=write>\n<parameter=content>\nline one\n"
    assert read_function(body, SCHEMAS).arguments == {"content": "line one"}
    assert read_function(body + "</para", SCHEMAS).arguments == {"content": "line one"}
    assert read_function(body + "<b>", SCHEMAS).arguments == {"content": "line one\n<b>"}
    assert read_function(body + "</parameter>", SCHEMAS).arguments == {"content": "line one"}


def test_every_call_is_whole_before_the_next_begins():
    text = "\n".join(call_text(name, {"zone": "CET"} if name == "get_time" else {"city": "Rome", "days": 1})
                     for name in ("get_weather", "get_time", "get_weather"))
    for piece in (1, 3, 7):
        arguments: dict[int, str] = {}
        for fragment in fragments(lambda: AssistantTurn(None, XmlCalls(SCHEMAS, True)), text, piece):
            if fragment.index not in arguments:
                for earlier in arguments.values():
                    json.loads(earlier)  # complete
            arguments[fragment.index] = arguments.get(fragment.index, "") + fragment.arguments
        assert len(arguments) == 3


def test_one_call_kept_without_parallel_tool_calls():
    text = f"{call_text('get_time', {'zone': 'CET'})}\n{call_text('ping', {})}"
    _, _, calls = run(lambda: AssistantTurn(None, XmlCalls(SCHEMAS, True), max_calls=1), text, 4)
    assert [name for _, name, _ in calls] == ["get_time"]


def test_a_long_argument_streams_in_linear_time(monkeypatch):
    """An agent's tool writing a file: the call is read again every eighth of its length, not every piece."""
    arguments = {"path": "a.py", "content": "x = 1\n" * 4000}
    text = call_text("write", arguments)
    read: list[int] = []  # the length of each text read
    monkeypatch.setattr(tool_calls, "read_function",
                        lambda body, schemas: read.append(len(body)) or read_function(body, schemas))
    turn = AssistantTurn(None, XmlCalls(SCHEMAS, True))
    pieces = [turn.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [turn.end()]
    assert sum(read) < 20 * len(text)
    assert joined_calls(pieces) == [(0, "write", arguments)]
    assert len([c for p in pieces for c in p.calls if c.arguments]) > 10


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
VALUES = st.one_of(TEXT, st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
                   st.lists(st.integers(), max_size=3), st.dictionaries(TEXT, st.integers(), max_size=2))
TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", list: "array",
         dict: "object"}


@settings(max_examples=200, deadline=None, derandomize=True)  # the same examples in every CI run
@given(arguments=st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True), VALUES, max_size=5),
       piece=st.integers(1, 9))
def test_streamed_arguments_join_to_the_unary_arguments(arguments, piece):
    """Any arguments, each parameter typed as its value, cut anywhere: the pieces join to what unary gives, and
    that is the arguments the template wrote."""
    text = call_text("f", arguments)
    assume(not any(end in value for value in arguments.values() if isinstance(value, str) for end in VALUE_ENDS))
    schemas = {"f": {"type": "object", "properties": {key: {"type": TYPES[type(value)]}
                                                       for key, value in arguments.items()}}}
    assert run(lambda: AssistantTurn(None, XmlCalls(schemas)), text, len(text)) == ("", "", [(0, "f", arguments)])
    streamed = fragments(lambda: AssistantTurn(None, XmlCalls(schemas, True)), text, piece)
    assert "".join(f.arguments for f in streamed) == json.dumps(arguments, ensure_ascii=False)


def test_the_calls_the_template_renders_read_back(model_dir):
    """Qwen3.5's template, through transformers, writes a history's calls; the parser reads them back."""
    weather = {"city": "Paris\nFrance", "days": 3, "units": {"t": "C"}, "note": None}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": weather}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]}]
    prompt = load_tokenizer(model_dir).apply_chat_template(messages, chat_template=QWEN35_CHAT_TEMPLATE,
                                                           tokenize=False)
    turn = prompt.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    assert parse(turn) == ("", "Looking.", [(0, "get_weather", weather), (1, "get_time", {"zone": "CET"})])


def test_the_template_that_writes_xml_calls_chooses_the_parser():
    assert template_tool_call_parser(QWEN35_CHAT_TEMPLATE) is ToolCallParserName.QWEN3_CODER
    rendered_newlines = "{{- '<tool_call>\n<function=' + name + '>\n' }}{{- '<parameter=' + key }}"
    assert template_tool_call_parser(rendered_newlines) is ToolCallParserName.QWEN3_CODER
    assert template_tool_call_parser(CHAT_TEMPLATE) is None  # Qwen2.5's JSON calls: the flag says which parser
    # Seed-OSS's calls are of the same XML inside other tags: not this parser's.
    assert template_tool_call_parser("{{- '<seed:tool_call>\\n<function=' + n + '>' }}<parameter=") is None
    assert template_tool_call_parser(None) is None


@pytest.mark.parametrize("name", [ToolCallParserName.QWEN3_CODER, ToolCallParserName.QWEN3_XML])
def test_both_names_give_the_xml_parser(name):
    assert isinstance(tool_call_parser(name, SCHEMAS), XmlCalls)
