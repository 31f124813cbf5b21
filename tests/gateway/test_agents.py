"""Agents through /v1/chat/completions with the real `openai` client: tools rendered by the chat template,
tool calls parsed back (a gateway started with --tool-call-parser qwen25 --reasoning-parser qwen3), tool_choice
required and named constrained by the grammar, reasoning split out, chat_template_kwargs, unary and streamed.

The default model has random weights: where a test needs the model to write a tool call or a <think> block,
SGLang's `regex` field makes it write exactly that text, so that what is tested is the parse of real output.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from harness.http import exact_regex
from harness.stack import another_gateway

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'



@contextmanager
def agent_client(stack, *gateway_args: str) -> Iterator[openai.OpenAI]:
    """The `openai` client of one more gateway on the stack, started with `gateway_args`."""
    with another_gateway(stack, *gateway_args) as http:
        with openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            yield client


@pytest.fixture(scope="module")
def agent(stack):
    with agent_client(stack, "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3") as client:
        yield client


@pytest.fixture(scope="module")
def model(agent) -> str:
    return agent.models.list().data[0].id


def chat(client, model, stream=False, **fields):
    """The response (unary) or (message fields merged from every delta, finish_reason) (streamed)."""
    extra = {key: fields.pop(key) for key in ("regex", "chat_template_kwargs", "separate_reasoning",
                                               "stream_reasoning", "return_token_ids") if key in fields}
    fields.setdefault("messages", ASK)
    fields.setdefault("max_tokens", 512)  # JSON may hold up to 32 whitespace characters between elements
    fields.setdefault("temperature", 0)
    response = client.chat.completions.create(model=model, stream=stream, extra_body=extra, **fields)
    if not stream:
        return response
    content, reasoning, calls, finish, empty = "", "", {}, None, 0
    for chunk in response:
        choice = chunk.choices[0]
        delta = choice.delta
        empty += not (delta.role or delta.content or getattr(delta, "reasoning_content", None) or delta.tool_calls
                      or choice.finish_reason)
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": "",
                                                  "pieces": 0})
            if entry["pieces"]:  # OpenAI's later fragments: index and arguments only
                assert call.id is None and call.function.name is None
            entry["arguments"] += call.function.arguments or ""
            entry["pieces"] += 1
        finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)], "finish": finish,
            "empty": empty}


def test_auto_tool_call_parsed_unary_and_streamed(agent, model):
    response = chat(agent, model, tools=[WEATHER, TIME], regex=exact_regex(CALL_TEXT))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")
    streamed = chat(agent, model, stream=True, tools=[WEATHER, TIME], regex=exact_regex(CALL_TEXT))
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [("get_weather", {"city": "Paris"})]
    assert streamed["calls"][0]["id"].startswith("call_")
    # The name once the arguments have begun (as an object), then the arguments as the model writes them.
    assert streamed["calls"][0]["pieces"] > 1
    assert streamed["empty"] == 0  # the tokens of text the parser held made no events of their own
    # The openai package's own stream accumulator merges the fragments into the unary message's call.
    with agent.chat.completions.stream(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=512,
                                       temperature=0, extra_body={"regex": exact_regex(CALL_TEXT)}) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.id[:5], c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        ("call_", "get_weather", call.function.arguments)]


def test_parallel_calls_and_content_around_them(agent, model):
    second = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    text = f"Checking both.\n{CALL_TEXT}\n{second}"
    for stream in (False, True):
        got = chat(agent, model, stream=stream, tools=[WEATHER, TIME], regex=exact_regex(text))
        if not stream:
            message = got.choices[0].message
            got = {"content": message.content, "calls": [{"name": c.function.name, "arguments": c.function.arguments}
                                                         for c in message.tool_calls]}
        assert got["content"] == "Checking both."
        assert [c["name"] for c in got["calls"]] == ["get_weather", "get_time"]


def test_malformed_call_is_returned_as_content(agent, model):
    text = "<tool_call>\nnot json\n</tool_call>"
    choice = chat(agent, model, tools=[WEATHER], regex=exact_regex(text)).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")


def test_tool_choice_none_leaves_the_text_alone(agent, model):
    choice = chat(agent, model, tools=[WEATHER], tool_choice="none", regex=exact_regex(CALL_TEXT)).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (CALL_TEXT, None)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_is_constrained_to_its_arguments(agent, model, stream):
    got = chat(agent, model, stream=stream, tools=[WEATHER, TIME],
               tool_choice={"type": "function", "function": {"name": "get_time"}})
    if not stream:
        got = {"finish": got.choices[0].finish_reason,
               "calls": [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in got.choices[0].message.tool_calls]}
    assert got["finish"] == "stop"  # OpenAI's for a named function (tool_calls for auto and required)
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == [("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_a_forced_call_cut_short_reads_the_same_unary_and_streamed(agent, model, tool_choice):
    """max_tokens cut the forced JSON: a call once its name is known and its arguments have begun (with them as
    far as they go), unary as streamed; the text before that."""
    cut_calls = []
    for max_tokens in (1, 6, 24, 48):
        fields = {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": max_tokens}
        unary = chat(agent, model, **fields).choices[0]
        streamed = chat(agent, model, stream=True, **fields)
        calls = [(call.function.name, call.function.arguments) for call in unary.message.tool_calls or []]
        assert calls == [(call["name"], call["arguments"]) for call in streamed["calls"]], max_tokens
        assert (unary.message.content or "") == streamed["content"], max_tokens
        assert unary.finish_reason == streamed["finish"], max_tokens
        if unary.finish_reason == "length":
            cut_calls += calls
    assert cut_calls, "no cut came after a call began"


def test_required_tool_choice_calls_one_of_the_tools(agent, model):
    # (Without parallel_tool_calls: a random model, free to, writes calls until max_tokens.)
    for seed in (1, 2, 3):
        response = chat(agent, model, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                        temperature=1, seed=seed)
        message = response.choices[0].message
        assert response.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert (call.function.name, arguments) in (("get_weather", {"city": "Paris"}),
                                                       ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"}))


def test_tool_history_renders_through_the_template(agent, model):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    response = chat(agent, model, messages=history, tools=[WEATHER], max_tokens=1, return_token_ids=True)
    prompt = agent.completions.create(model=model, prompt=response.model_extra["prompt_token_ids"], max_tokens=0,
                                      echo=True).choices[0].text
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the tools' signatures
    assert CALL_TEXT in prompt  # the assistant's call
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


REASONED = "<think>\nParis is in France.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_separated(agent, model, stream):
    got = chat(agent, model, stream=stream, regex=exact_regex(REASONED))
    if not stream:
        message = got.choices[0].message
        got = {"content": message.content, "reasoning": message.model_extra["reasoning_content"]}
    assert (got["reasoning"], got["content"]) == ("Paris is in France.", "It is sunny.")


def test_separate_reasoning_false_keeps_the_text_whole(agent, model):
    message = chat(agent, model, regex=exact_regex(REASONED), separate_reasoning=False).choices[0].message
    assert message.content == REASONED


def test_reasoning_then_a_tool_call(agent, model):
    text = "<think>\nI need the tool.\n</think>\n\n" + CALL_TEXT
    message = chat(agent, model, tools=[WEATHER], regex=exact_regex(text)).choices[0].message
    assert message.model_extra["reasoning_content"] == "I need the tool."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_chat_template_kwargs_reach_the_template(agent, model):
    def prompt_ids(**kwargs) -> list[int]:
        return chat(agent, model, max_tokens=1, return_token_ids=True, **kwargs).model_extra["prompt_token_ids"]

    thinking, not_thinking = prompt_ids(), prompt_ids(chat_template_kwargs={"enable_thinking": False})
    assert not_thinking[:len(thinking)] == thinking and len(not_thinking) > len(thinking)
    tail = agent.completions.create(model=model, prompt=not_thinking[len(thinking):], max_tokens=0, echo=True)
    assert tail.choices[0].text == "<think>\n\n</think>\n\n"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_tool_fields_are_refused(agent, model, fields, param):
    fields.setdefault("tools", [WEATHER])
    with pytest.raises(openai.BadRequestError) as refused:
        chat(agent, model, **fields)
    assert refused.value.body["param"].split(".")[0].split("[")[0] == param


def test_auto_needs_a_tool_call_parser(openai_client, served_model):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(openai_client, served_model, tools=[WEATHER])
    assert refused.value.body["param"] == "tools" and "--tool-call-parser" in refused.value.body["message"]
    message = chat(openai_client, served_model, tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False).choices[0].message
    assert message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize(("messages", "tool_choice", "param", "says"), [
    ([*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
      {"role": "tool", "content": "sunny"}], None, "messages[2].tool_call_id", "tool_call_id"),
    ([{"role": "function", "name": "get_weather", "content": "sunny"}], None, "messages[0].role", "not supported"),
    (ASK, {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice",
     "not supported"),
], ids=["tool-without-call-id", "function-role", "allowed-tools"])
def test_history_and_choices_it_cannot_take_are_refused_by_name(agent, model, messages, tool_choice, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(agent, model, messages=messages, tools=[WEATHER], **({"tool_choice": tool_choice} if tool_choice else {}))
    assert refused.value.body["param"] == param and says in refused.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_of_reasoning_alone_has_null_content(agent, model, stream):
    """The output ran out inside its <think> block: all of it is reasoning, and content is null (as SGLang)."""
    got = chat(agent, model, stream=stream, regex=exact_regex("<think>\nstill thinking"))
    if stream:
        assert (got["reasoning"], got["content"]) == ("still thinking", "")
    else:
        message = got.choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == ("still thinking", None)


def test_deepseek_r1_reads_the_answer_of_a_prompt_that_closed_thinking(stack):
    """deepseek-r1's output starts inside the block the prompt opened, unless the prompt closed it too
    (enable_thinking false): then all of it is the answer, none lost to reasoning_content."""
    with another_gateway(stack, "--reasoning-parser", "deepseek-r1") as http:
        model = http.get("/v1/models").json()["data"][0]["id"]

        def message(**fields) -> dict:
            body = {"model": model, "messages": ASK, "max_tokens": 16, "temperature": 0,
                    "regex": exact_regex("plain answer"), **fields}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["message"]

        thinking, answering = message(), message(chat_template_kwargs={"enable_thinking": False})
    assert (thinking["reasoning_content"], thinking["content"]) == ("plain answer", None)
    assert (answering["reasoning_content"], answering["content"]) == (None, "plain answer")
