"""A model served with Qwen3.5's chat template (tests/gateway/qwen35_template.py) through the real `openai` client:
a gateway started without --tool-call-parser reads its XML tool calls (the template names the format), typed by
the tools' schemas, unary and streamed; forced calls; the reasoning block its prompt opens (--reasoning-parser
deepseek-r1) split out, and never taking a forced call's JSON.

The default model's checkpoint with this template in place of its own; its random weights write what SGLang's
`regex` field makes them write, so that what is tested is the parse of real output.
"""

import json

import pytest

from harness.http import exact_regex
from services.gateway.agents.xml_calls import read_function
from tests.gateway.qwen35_template import QWEN35_CHAT_TEMPLATE
from tests.gateway.test_agents import agent_client, chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
THOUGHT = "The user wants the weather.\n</think>\n\n"
WEATHER_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
               "</parameter>\n</function>\n</tool_call>"
TIME_CALL = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def qwen35(stack, model_dir, tmp_path_factory):
    """The default checkpoint with Qwen3.5's template (the gateway reads only its tokenizer and template)."""
    checkpoint = tmp_path_factory.mktemp("qwen35-template")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).symlink_to(model_dir / name)
    (checkpoint / "chat_template.jinja").write_text(QWEN35_CHAT_TEMPLATE)
    with agent_client(stack, "--model", str(checkpoint), "--reasoning-parser", "deepseek-r1") as client:
        yield client


@pytest.fixture(scope="module")
def model(qwen35) -> str:
    return qwen35.models.list().data[0].id


def calls_of(got) -> list[tuple[str, dict]]:
    """(name, arguments) of a unary response's calls or a streamed one's."""
    if isinstance(got, dict):
        return [(c["name"], json.loads(c["arguments"])) for c in got["calls"]]
    return [(c.function.name, json.loads(c.function.arguments)) for c in got.choices[0].message.tool_calls or []]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_templates_xml_calls_without_a_flag(qwen35, model, stream):
    got = chat(qwen35, model, stream=stream, tools=[WEATHER, TIME], regex=exact_regex(THOUGHT + WEATHER_CALL))
    assert calls_of(got) == [("get_weather", {"city": "Paris", "days": 3})]  # days typed by its schema
    if stream:
        assert (got["finish"], got["content"], got["reasoning"]) == ("tool_calls", "", "The user wants the weather.")
        assert got["calls"][0]["id"].startswith("call_") and got["calls"][0]["pieces"] > 1
    else:
        choice = got.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."


def test_the_openai_stream_helper_joins_the_streamed_call_into_the_unary_one(qwen35, model):
    unary = chat(qwen35, model, tools=[WEATHER, TIME], regex=exact_regex(THOUGHT + WEATHER_CALL))
    with qwen35.chat.completions.stream(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[WEATHER, TIME], max_tokens=512, temperature=0,
                                        extra_body={"regex": exact_regex(THOUGHT + WEATHER_CALL)}) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in unary.choices[0].message.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_content_and_parallel_calls(qwen35, model, stream):
    text = f"{THOUGHT}Checking both.\n\n{WEATHER_CALL}\n{TIME_CALL}"
    got = chat(qwen35, model, stream=stream, tools=[WEATHER, TIME], regex=exact_regex(text))
    content = got["content"] if stream else got.choices[0].message.content
    assert content == "Checking both."
    assert calls_of(got) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]


def test_a_call_cut_by_max_tokens(qwen35, model):
    """Unary, a call cut short is the text (as the other parsers); streamed, its name went out: it stays a call,
    its arguments as far as they were written. finish_reason says length either way."""
    fields = {"tools": [WEATHER], "regex": exact_regex(WEATHER_CALL), "max_tokens": 12,
              "chat_template_kwargs": {"enable_thinking": False}}
    unary = chat(qwen35, model, **fields).choices[0]
    assert unary.finish_reason == "length" and unary.message.tool_calls is None
    assert WEATHER_CALL.startswith(unary.message.content) and "<function=get_weather>" in unary.message.content
    streamed = chat(qwen35, model, stream=True, **fields)
    assert streamed["finish"] == "length" and [c["name"] for c in streamed["calls"]] == ["get_weather"]
    schemas = {"get_weather": WEATHER["function"]["parameters"]}
    written = read_function(unary.message.content.removeprefix("<tool_call>"), schemas).arguments
    assert json.loads(streamed["calls"][0]["arguments"]) == written


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_forced_calls_are_calls_not_the_reasoning_the_prompt_opened(qwen35, model, stream, tool_choice):
    """The grammar makes the output JSON from its first token: none of it is reasoning, though the prompt opened
    a <think> block."""
    got = chat(qwen35, model, stream=stream, tools=[TIME], tool_choice=tool_choice, parallel_tool_calls=False)
    assert calls_of(got) == [("get_time", {"zone": "CET"})]
    reasoning = got["reasoning"] if stream else got.choices[0].message.model_extra["reasoning_content"]
    assert not reasoning


def test_the_template_renders_the_tools_and_opens_the_reasoning(qwen35, model):
    ids = chat(qwen35, model, tools=[WEATHER], max_tokens=1, return_token_ids=True).model_extra["prompt_token_ids"]
    prompt = qwen35.completions.create(model=model, prompt=ids, max_tokens=0, echo=True).choices[0].text
    assert '"name": "get_weather"' in prompt and "<function=example_function_name>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_a_history_with_an_earlier_call_renders_as_the_template_writes_calls(qwen35, model):
    """The assistant's earlier call comes back as OpenAI's JSON text; the template iterates its arguments as an
    object, and renders them as the model writes a call."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = qwen35.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=1,
                                           extra_body={"return_token_ids": True})
    prompt = qwen35.completions.create(model=model, prompt=reply.model_extra["prompt_token_ids"], max_tokens=0,
                                       echo=True).choices[0].text
    assert WEATHER_CALL.removesuffix("\n") in prompt, prompt
