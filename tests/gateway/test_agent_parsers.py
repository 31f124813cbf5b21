"""The assistant turn's parsers (services/gateway/agents/) on text alone: reasoning, tool calls in each format,
the forced calls of tool_choice, and the rule that a stream, cut anywhere, says what the unary response says,
its calls' arguments streamed piece by piece."""

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.gateway.agents import tool_calls
from services.gateway.agents.call_stream import partial_json
from services.gateway.agents.reasoning import ReasoningParserName, ThinkBlock
from services.gateway.agents.tool_calls import ForcedCalls, JsonCalls, TaggedCalls
from services.gateway.agents.tool_choice import required_calls_schema
from services.gateway.agents.turn import AssistantTurn


def run(make_turn, text: str, piece: int) -> tuple[str, str, list[tuple[int, str, dict]]]:
    """(reasoning, content, calls) of `text` fed `piece` characters at a time, then ended; each call's fragments
    joined as a client joins them."""
    turn = make_turn()
    pieces = [turn.feed(text[i:i + piece]) for i in range(0, len(text), piece)] + [turn.end()]
    return "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces), joined_calls(pieces)


def joined_calls(pieces) -> list[tuple[int, str, dict]]:
    calls: dict[int, list] = {}
    for delta in (c for p in pieces for c in p.calls):
        if delta.id is not None:
            assert delta.index not in calls and delta.id.startswith("call_")
            calls[delta.index] = [delta.name, delta.arguments]
        else:
            calls[delta.index][1] += delta.arguments
    return [(index, name, json.loads(arguments)) for index, (name, arguments) in sorted(calls.items())]


def same_at_every_cut(make_turn, text: str, streamed_turn=None):
    """The unary parse (make_turn); the streamed one (streamed_turn, when given) says the same at every cut."""
    whole = run(make_turn, text, len(text) or 1)
    for make in (make_turn, streamed_turn or make_turn):
        for piece in (1, 2, 3, 5, 8, 13):
            assert run(make, text, piece) == whole, piece
    return whole


NAMES = frozenset({"get_weather", "get_time", "f", "g", "search", "open", "a", "b", "write"})  # the declared tools
QWEN_CALLS = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def test_qwen_reasoning_content_and_two_calls():
    def turn(stream: bool = False) -> AssistantTurn:
        return AssistantTurn(ThinkBlock(ReasoningParserName.QWEN3), TaggedCalls(NAMES, stream))

    assert same_at_every_cut(turn, QWEN_CALLS, lambda: turn(True)) == (
        "The user wants the weather.", "Let me look.",
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {"zone": "CET"})])


def test_a_call_of_an_undeclared_function_is_content():
    """OpenAI never calls a function the request did not declare: such a call is the model's text."""
    tagged = '<tool_call>\n{"name": "evil", "arguments": {}}\n</tool_call>'
    assert same_at_every_cut(lambda: AssistantTurn(None, TaggedCalls(NAMES)), tagged,
                             lambda: AssistantTurn(None, TaggedCalls(NAMES, True))) == ("", tagged, [])
    llama = '{"name": "evil", "parameters": {}}'
    assert same_at_every_cut(lambda: AssistantTurn(None, JsonCalls(NAMES)), llama,
                             lambda: AssistantTurn(None, JsonCalls(NAMES, True))) == ("", llama, [])


def test_one_call_kept_without_parallel_tool_calls():
    _, _, calls = run(lambda: AssistantTurn(None, TaggedCalls(NAMES), max_calls=1), QWEN_CALLS, 4)
    assert [name for _, name, _ in calls] == ["get_weather"]


def test_a_malformed_call_is_content_and_a_cut_one_too():
    text = '<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call> then <tool_call>\n{"name": "g"'
    assert same_at_every_cut(lambda: AssistantTurn(None, TaggedCalls(NAMES)), text) == ("", text, [])


def test_text_without_markup_passes_unchanged():
    text = "  Plain text, with <tags> and a lone </think> and <tool_ but no call.\n\n"
    for make in (lambda: AssistantTurn(ThinkBlock(ReasoningParserName.QWEN3), TaggedCalls(NAMES)),
                 lambda: AssistantTurn(None, JsonCalls(NAMES)), lambda: AssistantTurn()):
        assert same_at_every_cut(make, text) == ("", text, [])


def test_deepseek_r1_starts_inside_the_reasoning():
    make = lambda: AssistantTurn(ThinkBlock(ReasoningParserName.DEEPSEEK_R1))  # noqa: E731
    assert same_at_every_cut(make, "Thinking hard.\n</think>\n\nThe answer.") == ("Thinking hard.", "The answer.", [])
    assert same_at_every_cut(make, "<think>\nAgain.</think>Answer") == ("Again.", "Answer", [])
    assert same_at_every_cut(make, "never closed") == ("never closed", "", [])  # ran out while reasoning


def test_held_reasoning_comes_whole_when_it_ends():
    turn = AssistantTurn(ThinkBlock(ReasoningParserName.QWEN3), stream_reasoning=False)
    first, second = turn.feed("<think>one two"), turn.feed(" three</think>answer")
    assert (first.reasoning, second.reasoning, second.content) == ("", "one two three", "answer")


def test_llama3_json_calls():
    text = ' <|python_tag|>{"name": "search", "parameters": {"q": "a;b"}}; {"name": "open", "parameters": {}}'
    assert same_at_every_cut(lambda: AssistantTurn(None, JsonCalls(NAMES)), text,
                             lambda: AssistantTurn(None, JsonCalls(NAMES, True))) == (
        "", "", [(0, "search", {"q": "a;b"}), (1, "open", {})])
    not_calls = '{"name": "search", "parameters": {"q": 1}} and then some words'
    assert same_at_every_cut(lambda: AssistantTurn(None, JsonCalls(NAMES)), not_calls) == ("", not_calls, [])
    # Streamed, the call went out before the words came: it stays a call (as SGLang's llama3 parser streams it).
    assert run(lambda: AssistantTurn(None, JsonCalls(NAMES, True)), not_calls, 4) == ("", "", [(0, "search", {"q": 1})])


@pytest.mark.parametrize(("function", "text", "calls"), [
    ("get_weather", '{"city": "Rome"}', [(0, "get_weather", {"city": "Rome"})]),
    (None, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
     [(0, "a", {"x": 1}), (1, "b", {})]),
    # Cut short (max_tokens): still the call, with its arguments as far as they go, unary as streamed.
    ("get_weather", '{"city": "Ro', [(0, "get_weather", {"city": "Ro"})]),
    (None, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": "tw',
     [(0, "a", {"x": 1}), (1, "b", {"y": "tw"})]),
    ("get_weather", ' ', []),  # nothing of it yet: the text, as content
    (None, '[{"name": "get_w', []),
])
def test_forced_calls(function, text, calls):
    reasoning, content, parsed = same_at_every_cut(lambda: AssistantTurn(None, ForcedCalls(NAMES, function)), text,
                                                   lambda: AssistantTurn(None, ForcedCalls(NAMES, function, True)))
    assert (parsed, content) == (calls, "" if calls else text)


def test_required_schema_lists_every_tool_and_bounds_the_calls():
    schema = json.loads(required_calls_schema({"a": {"type": "object", "properties": {"x": {}}}, "b": None}, False))
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert "maxItems" not in json.loads(required_calls_schema({"a": None}, True))  # parallel_tool_calls


def fragments(make_turn, text: str, piece: int = 3):
    turn = make_turn()
    return [c for p in [turn.feed(text[i:i + piece]) for i in range(0, len(text), piece)] + [turn.end()]
            for c in p.calls]


ARGUMENTS = {"city": "Paris, \"the\" capital", "days": [1, 2.5, -3e2], "units": {"t": "C"}, "ok": True,
             "note": None, "ünïcode": "日本"}


@pytest.mark.parametrize(("parser", "text"), [
    (lambda: TaggedCalls(NAMES, True),
     f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}\n</tool_call>'),
    (lambda: JsonCalls(NAMES, True), f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(ARGUMENTS)}}}'),
    (lambda: ForcedCalls(NAMES, None, True), json.dumps([{"name": "get_weather", "parameters": ARGUMENTS}])),
    (lambda: ForcedCalls(NAMES, "get_weather", True), json.dumps(ARGUMENTS)),
], ids=["tagged", "llama3", "required", "named"])
def test_streamed_arguments_arrive_in_pieces_before_the_call_ends(parser, text):
    streamed = fragments(lambda: AssistantTurn(None, parser()), text)
    assert streamed[0].name == "get_weather" and streamed[0].id is not None
    assert all(f.id is None and f.name is None for f in streamed[1:])
    assert len([f for f in streamed if f.arguments]) > 5  # piece by piece, not whole at the end
    assert "".join(f.arguments for f in streamed) == json.dumps(ARGUMENTS, ensure_ascii=False)


def test_a_streamed_call_goes_out_once_its_name_is_complete():
    turn = AssistantTurn(None, TaggedCalls(NAMES, True))
    assert turn.feed('<tool_call>\n{"name": "get_wea').calls == []  # half a name: nothing yet
    [first] = turn.feed('ther", "arguments": {"ci').calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "{")
    assert turn.feed('ty": "Pa').calls == []  # parsed again once 16 more characters came
    [more] = turn.feed('ris, the capital').calls
    assert (more.id, more.arguments) == (None, '"city": "Paris, the capital')


def test_a_streamed_call_that_breaks_after_its_name_stays_a_call():
    """The stream cannot take back what it sent: unary, the same text is content."""
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": 1, oops}}\n</tool_call>'
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": "Ro'
    for text, readable in ((broken, {"a": 1}), (cut, {"a": "Ro"})):
        assert run(lambda: AssistantTurn(None, TaggedCalls(NAMES)), text, 4) == ("", text, [])
        streamed = fragments(lambda: AssistantTurn(None, TaggedCalls(NAMES, True)), text)
        assert streamed[0].name == "f"
        # Closed so that a client can parse them. Cut: all that reads as JSON when the output ends. Broken: what the
        # last parse before it broke read (the call is parsed again every eighth of its length at most).
        sent = json.loads("".join(f.arguments for f in streamed))
        assert sent == readable if text is cut else sent.items() <= readable.items()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None, derandomize=True)  # the same examples in every CI run
@given(arguments=st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=5), piece=st.integers(1, 9),
       indent=st.sampled_from([None, 2]))
def test_streamed_arguments_join_to_the_unary_arguments(arguments, piece, indent):
    """Any arguments object, written compact or indented, cut anywhere: the pieces join to what unary gives."""
    text = f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(arguments, indent=indent)}}}\n</tool_call>'
    assume(TaggedCalls.CLOSE not in text[:-len(TaggedCalls.CLOSE)])  # the format cannot hold its own end tag
    unary = run(lambda: AssistantTurn(None, TaggedCalls(NAMES)), text, len(text))
    assert unary == ("", "", [(0, "f", arguments)])
    streamed = fragments(lambda: AssistantTurn(None, TaggedCalls(NAMES, True)), text, piece)
    assert "".join(f.arguments for f in streamed) == json.dumps(arguments, ensure_ascii=False)


def test_a_long_argument_streams_in_linear_time(monkeypatch):
    """An agent's tool writing a file: the call is parsed again every eighth of its length, not every piece."""
    arguments = {"path": "a.py", "content": "x = 1\n" * 4000}
    text = f'<tool_call>\n{{"name": "write", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    parsed: list[int] = []  # the length of each text parsed
    monkeypatch.setattr(tool_calls, "partial_json",
                        lambda text, **kw: parsed.append(len(text)) or partial_json(text, **kw))
    turn = AssistantTurn(None, TaggedCalls(NAMES, True))
    pieces = [turn.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [turn.end()]
    assert sum(parsed) < 20 * len(text)  # a parse per piece would read it len(text) / 8 times over
    assert joined_calls(pieces) == [(0, "write", arguments)]
    assert len([c for p in pieces for c in p.calls if c.arguments]) > 10


@pytest.mark.parametrize(("parser", "text"), [
    (lambda: ForcedCalls(NAMES, None, True), json.dumps([{"name": "a", "parameters": {"x": "one"}},
                                                        {"name": "b", "parameters": {"y": "two"}},
                                                        {"name": "a", "parameters": {}}])),
    (lambda: JsonCalls(NAMES, True), '{"name": "a", "parameters": {"x": "one"}}; {"name": "b", "parameters": '
                                     '{"y": "two"}}; {"name": "a", "parameters": {}}'),
], ids=["required", "llama3"])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_parallel_calls_end_before_the_next_begins(parser, text, piece):
    """OpenAI's order, which the openai SDK's stream helper relies on (it parses a call's arguments as final once
    a later index appears): every call's arguments are whole before the next call's first fragment."""
    streamed = fragments(lambda: AssistantTurn(None, parser()), text, piece)
    arguments: dict[int, str] = {}
    for fragment in streamed:
        if fragment.index not in arguments:
            for earlier in arguments.values():
                json.loads(earlier)  # complete
        arguments[fragment.index] = arguments.get(fragment.index, "") + fragment.arguments
    assert [json.loads(arguments[i]) for i in sorted(arguments)] == [{"x": "one"}, {"y": "two"}, {}]


@pytest.mark.parametrize(("text", "calls"), [
    # The model stopped after a whole call, without the closing tag (vLLM's hermes parser reads it so).
    ('<tool_call>\n{"name": "search", "arguments": {"q": "z"}}', [(0, "search", {"q": "z"})]),
    ('<tool_call>\n{"name": "search", "arguments": null}\n</tool_call>', [(0, "search", {})]),  # as SGLang
    ('<tool_call>\n{"name": "search", "arguments": "{\\"q\\": 1}"}\n</tool_call>', [(0, "search", {"q": 1})]),
    ('<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>', []),  # not arguments: content
    ('<tool_call>\n{"name": "search", "arguments": "no json"}\n</tool_call>', []),
])
def test_whole_calls_read_the_same_unary_and_streamed(text, calls):
    reasoning, content, parsed = same_at_every_cut(lambda: AssistantTurn(None, TaggedCalls(NAMES)), text,
                                                   lambda: AssistantTurn(None, TaggedCalls(NAMES, True)))
    assert (parsed, content) == (calls, "" if calls else text)


def test_required_cut_short_answers_its_calls_so_far():
    """max_tokens cut the list: the calls before the cut are the answer, unary as streamed, not the list's text;
    a call whose arguments have not begun is not one yet."""
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": 2}}, {"name": "a", "param'
    assert same_at_every_cut(lambda: AssistantTurn(None, ForcedCalls(NAMES, None)), text,
                             lambda: AssistantTurn(None, ForcedCalls(NAMES, None, True))) == (
        "", "", [(0, "a", {"x": 1}), (1, "b", {"y": 2})])
    # A function the request did not declare (the grammar allows none) is never called.
    undeclared = '[{"name": "a", "parameters": {"x": 1}}, {"name": "elsewhere", "parameters": {}}, {"na'
    assert same_at_every_cut(lambda: AssistantTurn(None, ForcedCalls(NAMES, None)), undeclared,
                             lambda: AssistantTurn(None, ForcedCalls(NAMES, None, True))) == (
        "", "", [(0, "a", {"x": 1})])


def test_deepseek_r1_after_a_prompt_that_closed_the_block_is_all_answer():
    text = "plain answer"
    assert run(lambda: AssistantTurn(ThinkBlock(ReasoningParserName.DEEPSEEK_R1)), text, 3) == (text, "", [])
    assert run(lambda: AssistantTurn(ThinkBlock(ReasoningParserName.DEEPSEEK_R1, prompt_closed_it=True)), text,
               3) == ("", text, [])
