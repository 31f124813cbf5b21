"""The assistant turn's parsers (services/gateway/agents/) on text alone: reasoning, tool calls in each format,
the forced calls of tool_choice, and the rule that a stream, cut anywhere, says what the unary response says."""

import json

import pytest

from services.gateway.agents.reasoning import ReasoningParserName, ThinkBlock
from services.gateway.agents.tool_calls import ForcedCalls, JsonCalls, TaggedCalls
from services.gateway.agents.tool_choice import required_calls_schema
from services.gateway.agents.turn import AssistantTurn


def run(make_turn, text: str, piece: int) -> tuple[str, str, list[tuple[int, str, dict]]]:
    """(reasoning, content, calls) of `text` fed `piece` characters at a time, then ended."""
    turn = make_turn()
    pieces = [turn.feed(text[i:i + piece]) for i in range(0, len(text), piece)] + [turn.end()]
    calls = [(c.index, c.call.name, json.loads(c.call.arguments)) for p in pieces for c in p.calls]
    return "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces), calls


def same_at_every_cut(make_turn, text: str):
    whole = run(make_turn, text, len(text) or 1)
    for piece in (1, 2, 3, 5, 8, 13):
        assert run(make_turn, text, piece) == whole, piece
    return whole


QWEN_CALLS = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def test_qwen_reasoning_content_and_two_calls():
    assert same_at_every_cut(lambda: AssistantTurn(ThinkBlock(ReasoningParserName.QWEN3), TaggedCalls()),
                             QWEN_CALLS) == (
        "The user wants the weather.", "Let me look.",
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {"zone": "CET"})])


def test_one_call_kept_without_parallel_tool_calls():
    _, _, calls = run(lambda: AssistantTurn(None, TaggedCalls(), max_calls=1), QWEN_CALLS, 4)
    assert [name for _, name, _ in calls] == ["get_weather"]


def test_a_malformed_call_is_content_and_a_cut_one_too():
    text = '<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call> then <tool_call>\n{"name": "g"'
    assert same_at_every_cut(lambda: AssistantTurn(None, TaggedCalls()), text) == ("", text, [])


def test_text_without_markup_passes_unchanged():
    text = "  Plain text, with <tags> and a lone </think> and <tool_ but no call.\n\n"
    for make in (lambda: AssistantTurn(ThinkBlock(ReasoningParserName.QWEN3), TaggedCalls()),
                 lambda: AssistantTurn(None, JsonCalls()), lambda: AssistantTurn()):
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
    assert same_at_every_cut(lambda: AssistantTurn(None, JsonCalls()), text) == (
        "", "", [(0, "search", {"q": "a;b"}), (1, "open", {})])
    not_calls = '{"name": "search", "parameters": {"q": 1}} and then some words'
    assert same_at_every_cut(lambda: AssistantTurn(None, JsonCalls()), not_calls) == ("", not_calls, [])


@pytest.mark.parametrize(("function", "text", "calls"), [
    ("get_weather", '{"city": "Rome"}', [(0, "get_weather", {"city": "Rome"})]),
    (None, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
     [(0, "a", {"x": 1}), (1, "b", {})]),
    ("get_weather", '{"city": "Ro', []),  # cut short (length): the text, as content
])
def test_forced_calls(function, text, calls):
    reasoning, content, parsed = same_at_every_cut(lambda: AssistantTurn(None, ForcedCalls(function)), text)
    assert (parsed, content) == (calls, "" if calls else text)


def test_required_schema_lists_every_tool_and_bounds_the_calls():
    schema = json.loads(required_calls_schema({"a": {"type": "object", "properties": {"x": {}}}, "b": None}, False))
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert "maxItems" not in json.loads(required_calls_schema({"a": None}, True))  # parallel_tool_calls
