"""Issue 11's rule for request fields: what the server accepts it honours; what it cannot honour yet is refused
with a 400 naming the field, unless its value asks for nothing (the neutral value real clients send)."""

import openai
import pytest

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
GENERATE = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

# OpenAI's fields flatwire cannot honour yet: (field, a value it refuses, the neutral values it accepts).
OPENAI_FIELDS = [
    ("logit_bias", {"7872": -100}, [None, {}]),
    ("presence_penalty", 0.5, [None, 0, 0.0]),
    ("frequency_penalty", -1.0, [None, 0]),
    ("response_format", {"type": "json_object"}, [None, {"type": "text"}]),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], [None, []]),
    ("tool_choice", "auto", [None, "none"]),
    ("best_of", 2, [None, 1]),
]
# SGLang's sampling_params fields likewise.
SAMPLING_FIELDS = [
    ("frequency_penalty", 0.5, [None, 0.0]),
    ("presence_penalty", 1.0, [None, 0]),
    ("repetition_penalty", 1.2, [None, 1.0, 1]),
    ("min_new_tokens", 1, [None, 0]),
    ("json_schema", '{"type": "object"}', [None]),
    ("regex", "[a-z]+", [None]),
    ("ebnf", 'root ::= "a"', [None]),
    ("n", 2, [None, 1]),
]


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def assert_refused(response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == field
    assert error["message"].startswith(field + ":") and "not supported" in error["message"]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("field", "value", "neutral"), OPENAI_FIELDS, ids=[f[0] for f in OPENAI_FIELDS])
def test_openai_field_refused_unless_neutral(http, model, endpoint, field, value, neutral):
    base = {**(CHAT if "chat" in endpoint else COMPLETION), "model": model}
    assert_refused(http.post(endpoint, json={**base, field: value}), field)
    for ok in neutral:
        response = http.post(endpoint, json={**base, field: ok})
        assert response.status_code == 200, (ok, response.text)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("field", "value", "neutral"), SAMPLING_FIELDS[:-1], ids=[f[0] for f in SAMPLING_FIELDS[:-1]])
def test_sglang_extension_refused_on_openai_routes_unless_neutral(http, model, endpoint, field, value, neutral):
    base = {**(CHAT if "chat" in endpoint else COMPLETION), "model": model}
    assert_refused(http.post(endpoint, json={**base, field: value}), field)
    assert http.post(endpoint, json={**base, field: neutral[-1]}).status_code == 200


@pytest.mark.parametrize(("field", "value", "neutral"), SAMPLING_FIELDS, ids=[f[0] for f in SAMPLING_FIELDS])
def test_sampling_params_field_refused_unless_neutral(http, field, value, neutral):
    params = GENERATE["sampling_params"]
    assert_refused(http.post("/generate", json={**GENERATE, "sampling_params": {**params, field: value}}),
                   f"sampling_params.{field}")
    for ok in neutral:
        response = http.post("/generate", json={**GENERATE, "sampling_params": {**params, field: ok}})
        assert response.status_code == 200, (ok, response.text)


def test_generate_top_level_n(http):
    assert_refused(http.post("/generate", json={**GENERATE, "n": 5}), "n")
    for ok in (None, 1):
        assert http.post("/generate", json={**GENERATE, "n": ok}).status_code == 200


def test_openai_client_sees_a_typed_error(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="Hello", max_tokens=2, logit_bias={"7872": -100})
    assert refused.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=2,
                                       response_format={"type": "json_object"})
    assert refused.value.body["param"] == "response_format"
    # Neutral values, as lm-eval and bench_serving send them, are fine.
    response = client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=2,
                                              presence_penalty=0, frequency_penalty=0, logit_bias={},
                                              response_format={"type": "text"}, tool_choice="none")
    assert response.choices[0].finish_reason == "length"


def test_seeded_chat_choices_are_distinct_and_reproducible(client, model):
    def choices() -> list[str]:
        response = client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=16,
                                                  n=3, seed=5, temperature=1)
        assert [c.index for c in response.choices] == [0, 1, 2]
        return [c.message.content for c in response.choices]

    first = choices()
    assert len(set(first)) == 3, first
    assert choices() == first


def test_seeded_completion_choices_are_distinct_and_reproducible(client, model):
    def choices() -> list[str]:
        response = client.completions.create(model=model, prompt=["Once upon a time", "The weather"],
                                             max_tokens=16, n=3, seed=5, temperature=1)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = choices()
    assert len(set(first[:3])) == 3 and len(set(first[3:])) == 3, first
    assert choices() == first
    # Choice j of a request seeded s is what one choice seeded s + j draws.
    single = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, seed=6,
                                       temperature=1)
    assert single.choices[0].text == first[1]


def test_seed_wraps_into_uint64(client, model):
    response = client.completions.create(model=model, prompt="Hello", max_tokens=4, n=2, seed=2**64 - 1,
                                         temperature=1)
    wrapped = client.completions.create(model=model, prompt="Hello", max_tokens=4, seed=0, temperature=1)
    assert response.choices[1].text == wrapped.choices[0].text
