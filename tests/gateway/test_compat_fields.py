"""Issue 11's rule for request fields: what the server accepts it honours; what it cannot honour yet is refused
with a 400 naming the field, unless its value asks for nothing (the neutral value real clients send)."""

import json

import openai
import pytest
from flatwire_client import FlatwireClient

from harness.http import generate
from services.gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.gateway.protocol.sglang import SGLangGenerateFields, SGLangServerFields

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
GENERATE = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

# OpenAI's fields flatwire cannot honour yet: (endpoint, field, a value it refuses, the neutral values it accepts).
# (Structured output, response_format and SGLang's json_schema / regex / ebnf:
# tests/scheduler/test_structured_output.py; tools on chat: tests/gateway/test_agents.py.)
CHAT_ENDPOINT, COMPLETIONS_ENDPOINT = "/v1/chat/completions", "/v1/completions"
OPENAI_FIELDS = [
    (COMPLETIONS_ENDPOINT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], [None, []]),
    (COMPLETIONS_ENDPOINT, "tool_choice", "auto", [None, "none"]),
    *((endpoint, "best_of", 2, [None, 1]) for endpoint in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)),
    (CHAT_ENDPOINT, "functions", [{"name": "f", "parameters": {}}], [None, []]),
    (CHAT_ENDPOINT, "function_call", "auto", [None, "none"]),
    (CHAT_ENDPOINT, "modalities", ["text", "audio"], [None, ["text"]]),
    (CHAT_ENDPOINT, "audio", {"voice": "alloy", "format": "wav"}, [None]),
    (CHAT_ENDPOINT, "prediction", {"type": "content", "content": "x"}, [None]),
    (CHAT_ENDPOINT, "store", True, [None, False]),
    (CHAT_ENDPOINT, "service_tier", "priority", [None, "auto", "default"]),
    (CHAT_ENDPOINT, "continue_final_message", True, [None, False]),
    # SGLang's, on both routes and /generate (SGLANG_FIELDS)
    *((endpoint, "return_hidden_states", True, [None, False]) for endpoint in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)),
]
# A media field's empty value asks for nothing: null, "", [] and a batch's per-prompt [] (SGLang's has_valid_data;
# AReaL's RemoteSGLangEngine sends image_data [] with every prompt).
EMPTY_MEDIA = [None, "", [], [[], []], [None]]
MEDIA_FIELDS = [("image_data", "https://example.com/a.png", EMPTY_MEDIA), ("image_data", [["a.png"], []], []),
                ("video_data", ["clip.mp4"], EMPTY_MEDIA), ("audio_data", [{"url": "a.wav"}], EMPTY_MEDIA),
                ("modalities", ["image"], EMPTY_MEDIA), ("mm_hashes", ["ab12"], EMPTY_MEDIA),
                ("mm_content_hashes", [["sha256:00"]], EMPTY_MEDIA), ("video_config", {"fps": 2}, [None, {}])]
SGLANG_FIELDS = [("n", 5, [None, 1]), ("return_hidden_states", True, [None, False]),
                 *MEDIA_FIELDS, ("input_embeds", [[0.0]], [None]), ("input_embeds", [], []),
                 ("log_metrics", False, [None, True]), ("session_params", {"id": "s"}, [None])]


def assert_refused(response, field: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == field
    assert error["message"].startswith(field + ":") and "not supported" in error["message"]


@pytest.mark.parametrize(("endpoint", "field", "value", "neutral"), OPENAI_FIELDS,
                         ids=[f"{f[0]}-{f[1]}" for f in OPENAI_FIELDS])
def test_openai_field_refused_unless_neutral(http, served_model, endpoint, field, value, neutral):
    base = {**(CHAT if "chat" in endpoint else COMPLETION), "model": served_model}
    assert_refused(http.post(endpoint, json={**base, field: value}), field)
    for ok in neutral:
        response = http.post(endpoint, json={**base, field: ok})
        assert response.status_code == 200, (ok, response.text)


@pytest.mark.parametrize(("field", "value", "neutral"), SGLANG_FIELDS,
                         ids=[f"{f[0]}-{i}" for i, f in enumerate(SGLANG_FIELDS)])
def test_generate_field_refused_unless_neutral(http, field, value, neutral):
    assert_refused(http.post("/generate", json={**GENERATE, field: value}), field)
    for ok in neutral:
        body = {**GENERATE, field: ok}
        if ok == [[], []]:  # one per prompt of a batch
            body["text"] = ["Hello", "Hi"]
        response = http.post("/generate", json=body)
        assert response.status_code == 200, (ok, response.text)


def test_generate_takes_the_served_models_name(http, served_model):
    """SGLang ignores /generate's model; routers (smg) always send one, "unknown" when their client named none.
    Any name /v1/models lists, or none, selects the served model; a name nothing served has is refused."""
    listed = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert served_model in listed
    expected = http.post("/generate", json=GENERATE).json()["output_ids"]
    for model in [*listed, "unknown", None]:
        response = http.post("/generate", json={**GENERATE, "model": model})
        assert response.status_code == 200, (model, response.text)
        assert response.json()["output_ids"] == expected
    response = http.post("/generate", json={**GENERATE, "model": "no-such-model"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and "no-such-model" in error["message"] and served_model in error["message"]


def test_the_rest_of_sglangs_generate_fields_are_refused_unless_neutral(http):
    """Every field of SGLang's GenerateReqInput flatwire lacks is declared: refused with "not supported" when it
    asks for something, taken at its neutral value; routing_key routes (one replica here) and no_logs is so."""
    declared = set(SGLangGenerateFields.model_fields) - HONOURED
    assert {"priority", "session_id", "return_entropy", "routed_dp_rank"} <= declared
    _refused_unless_neutral(http, "/generate", GENERATE, SGLangGenerateFields, declared,
                            {"routing_key": "tenant-1", "no_logs": True, "cache_salt": "s", "extra_key": "k"})


# SGLang's fields of every route that are honoured: the LoRA adapter (tests/gateway/test_lora.py) and the
# prefix-cache namespace.
HONOURED = {"lora_path", "cache_salt", "extra_key"}


def test_a_lora_adapter_on_a_server_without_lora_is_refused_by_name(http, served_model):
    """404 naming the field that named it: no adapter of any name is served without --enable-lora."""
    refused = http.post("/generate", json={**GENERATE, "lora_path": "adapter"})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "lora_path"
    assert "`adapter` does not exist" in refused.json()["error"]["message"]
    for endpoint, body in ((CHAT_ENDPOINT, CHAT), (COMPLETIONS_ENDPOINT, COMPLETION)):
        refused = http.post(endpoint, json={**body, "model": served_model, "lora_path": "adapter"})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "lora_path"
        unknown = http.post(endpoint, json={**body, "model": "adapter"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


# SGLang's OpenAI routes' own fields flatwire lacks (beside those of every route, SGLangServerFields; custom_params:
# top-p replay, tests/gateway/test_top_p_replay.py)
SGLANG_OPENAI_FIELDS = {"stop_regex", "rid", "ngram_corpus_id", "return_cached_tokens_details"}


@pytest.mark.parametrize(("endpoint", "body", "model", "own"), [
    (CHAT_ENDPOINT, CHAT, ChatCompletionRequest, {"input_ids", "task"}),
    (COMPLETIONS_ENDPOINT, COMPLETION, CompletionRequest, {"suffix"})], ids=["chat", "completions"])
def test_sglangs_openai_fields_are_refused_unless_neutral(http, served_model, endpoint, body, model, own):
    declared = set(SGLangServerFields.model_fields) - HONOURED | SGLANG_OPENAI_FIELDS | own
    _refused_unless_neutral(http, endpoint, {**body, "model": served_model}, model, declared,
                            {"cache_salt": "s", "extra_key": "k"})


def _refused_unless_neutral(http, endpoint: str, body: dict, model, fields: set[str], honoured: dict) -> None:
    """Each field refused with "not supported" at a value that asks for something; all of them at null, with
    the `honoured` fields beside them, answered."""
    for field in fields:
        value = True if model.model_fields[field].annotation == bool | None else "x"
        assert_refused(http.post(endpoint, json={**body, field: value}), field)
    response = http.post(endpoint, json={**body, **dict.fromkeys(fields), **honoured})
    assert response.status_code == 200, response.text


def test_min_tokens_is_min_new_tokens_on_the_openai_routes(http, served_model):
    """SGLang's (and vLLM's) name on its OpenAI routes: a stop token greedy would pick early is held off."""
    greedy = greedy_ids(http, PROMPT_IDS, 12)
    stop = next(i for i, token in enumerate(greedy) if i and token not in greedy[:i])
    body = {"model": served_model, "prompt": PROMPT_IDS, "max_tokens": stop + 8, "temperature": 0,
            "stop_token_ids": [greedy[stop]], "return_token_ids": True}
    early = http.post(COMPLETIONS_ENDPOINT, json=body).json()["choices"][0]["token_ids"]
    held = http.post(COMPLETIONS_ENDPOINT, json={**body, "min_tokens": stop + 4}).json()["choices"][0]["token_ids"]
    assert len(early) == stop + 1 and len(held) >= stop + 4, (early, held)
    both = http.post(COMPLETIONS_ENDPOINT, json={**body, "min_tokens": 2, "min_new_tokens": 3})
    assert both.status_code == 400 and both.json()["error"]["param"] == "min_tokens"


def test_openai_client_sees_a_typed_error(openai_client, served_model):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=served_model, messages=CHAT["messages"], max_tokens=2,
                                              tool_choice="auto")
    assert refused.value.body["param"] == "tool_choice"
    # Neutral values, as lm-eval and bench_serving send them, are fine.
    response = openai_client.chat.completions.create(model=served_model, messages=CHAT["messages"], max_tokens=2,
                                              presence_penalty=0, frequency_penalty=0, logit_bias={},
                                              response_format={"type": "text"}, tool_choice="none")
    assert response.choices[0].finish_reason == "length"


def test_seeded_chat_choices_are_distinct_and_reproducible(openai_client, served_model):
    def choices() -> list[str]:
        response = openai_client.chat.completions.create(model=served_model, messages=CHAT["messages"], max_tokens=16,
                                                  n=3, seed=5, temperature=1)
        assert [c.index for c in response.choices] == [0, 1, 2]
        return [c.message.content for c in response.choices]

    first = choices()
    assert len(set(first)) == 3, first
    assert choices() == first


def test_seeded_completion_choices_are_distinct_and_reproducible(openai_client, served_model):
    def choices() -> list[str]:
        response = openai_client.completions.create(model=served_model, prompt=["Once upon a time", "The weather"],
                                             max_tokens=16, n=3, seed=5, temperature=1)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = choices()
    assert len(set(first[:3])) == 3 and len(set(first[3:])) == 3, first
    assert choices() == first
    # Choice j of a request seeded s is what one choice seeded s + j draws.
    single = openai_client.completions.create(model=served_model, prompt="Once upon a time", max_tokens=16, seed=6,
                                       temperature=1)
    assert single.choices[0].text == first[1]


def test_seed_wraps_into_uint64(openai_client, served_model):
    response = openai_client.completions.create(model=served_model, prompt="Hello", max_tokens=4, n=2, seed=2**64 - 1,
                                         temperature=1)
    wrapped = openai_client.completions.create(model=served_model, prompt="Hello", max_tokens=4, seed=0, temperature=1)
    assert response.choices[1].text == wrapped.choices[0].text


# Logit adjustments: what each field does, through every API (tests/scheduler/test_logit_adjust.py holds the exact
# comparison with transformers' logits processors).

def greedy_ids(http, input_ids: list[int], max_new_tokens: int, **params) -> list[int]:
    """The output ids of a greedy /generate with these sampling params, that ignores eos unless it has
    stop_token_ids (which ignore_eos would ignore too, as SGLang)."""
    return generate(http, input_ids=input_ids, sampling_params={
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": "stop_token_ids" not in params,
        **params})["output_ids"]


PROMPT_IDS = [9707, 11, 1879, 0, 576, 4171, 315]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_logit_bias_forces_and_bans_tokens(http, openai_client, served_model, endpoint):
    forced = 1000
    forced_text = http.post("/detokenize", json={"tokens": [forced] * 3}).json()["text"]

    def text(**fields) -> str:
        if endpoint == "chat":
            return openai_client.chat.completions.create(model=served_model, messages=CHAT["messages"], max_tokens=3,
                                                  **fields).choices[0].message.content
        return openai_client.completions.create(model=served_model, prompt="Hello", max_tokens=3,
                                                **fields).choices[0].text

    assert text(temperature=1, seed=3, logit_bias={str(forced): 100}) == forced_text
    # OpenAI's documented use: -100 bans a token; here every token greedy would pick is banned.
    greedy = greedy_ids(http, PROMPT_IDS, 8)
    banned = greedy_ids(http, PROMPT_IDS, 8, logit_bias={str(token): -100 for token in greedy})
    assert not set(banned) & set(greedy)


@pytest.mark.parametrize(("bias", "message"), [({"abc": 5}, "keys must be token ids"),
                                               ({"-1": 5}, "keys must be token ids"),
                                               ({"99999999": 1}, "token ids must be in")])
def test_bad_logit_bias_is_refused_naming_it(http, served_model, bias, message):
    response = http.post("/v1/completions", json={**COMPLETION, "model": served_model, "logit_bias": bias})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias", response.text
    assert message in response.json()["error"]["message"]
    response = http.post("/generate", json={**GENERATE, "sampling_params": {"logit_bias": bias}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.logit_bias"


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_penalties_reduce_repetition(http, field):
    plain = greedy_ids(http, PROMPT_IDS, 48)
    penalised = greedy_ids(http, PROMPT_IDS, 48, **{field: 2.0})
    assert len(set(penalised)) > len(set(plain)), (plain, penalised)


def test_openai_penalties_change_the_choice_reproducibly(openai_client, served_model):
    def text(**fields) -> str:
        return openai_client.completions.create(model=served_model, prompt="Hello", max_tokens=24, temperature=0,
                                         **fields).choices[0].text

    penalised = text(frequency_penalty=2.0, presence_penalty=1.0)
    assert penalised != text() and penalised == text(frequency_penalty=2.0, presence_penalty=1.0)


@pytest.mark.parametrize(("field", "value"), [("frequency_penalty", 2.5), ("presence_penalty", -3),
                                              ("repetition_penalty", 0), ("repetition_penalty", 2.5),
                                              ("min_new_tokens", -1)])
def test_out_of_range_adjustments_are_refused(http, served_model, field, value):
    response = http.post("/generate", json={**GENERATE, "sampling_params": {field: value}})
    assert response.status_code == 400 and response.json()["error"]["param"] == f"sampling_params.{field}"
    if field in ("frequency_penalty", "presence_penalty"):
        response = http.post("/v1/completions", json={**COMPLETION, "model": served_model, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_min_new_tokens_holds_off_stop_tokens_and_strings(http):
    greedy = greedy_ids(http, PROMPT_IDS, 12)
    stop = next(i for i, token in enumerate(greedy) if i and token not in greedy[:i])  # first new token past 0
    assert greedy_ids(http, PROMPT_IDS, 12, stop_token_ids=[greedy[stop]]) == greedy[:stop + 1]
    held = greedy_ids(http, PROMPT_IDS, stop + 8, stop_token_ids=[greedy[stop]], min_new_tokens=stop + 4)
    assert len(held) >= stop + 4 and greedy[stop] not in held[:stop + 3]
    # A stop string matches only once the output has min_new_tokens tokens.
    text = http.post("/detokenize", json={"tokens": greedy[stop:stop + 1]}).json()["text"]
    response = http.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": stop + 8, "temperature": 0, "ignore_eos": True, "stop": [text],
        "min_new_tokens": stop + 2}})
    assert len(response.json()["output_ids"]) >= stop + 2, response.text
    response = http.post("/generate", json={**GENERATE, "sampling_params": {"max_new_tokens": 2,
                                                                              "min_new_tokens": 3}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.min_new_tokens"


def test_grpc_api_takes_the_adjustments(stack, http):
    with FlatwireClient(stack.grpc_address) as grpc_client:
        forced = grpc_client.generate(input_ids=PROMPT_IDS, max_new_tokens=3, temperature=1.0,
                                      logit_bias={1000: 100.0})
        assert forced.token_ids.tolist() == [1000] * 3
        penalised = grpc_client.generate(input_ids=PROMPT_IDS, max_new_tokens=48, temperature=0, ignore_eos=True,
                                         repetition_penalty=2.0)
        assert penalised.token_ids.tolist() == greedy_ids(http, PROMPT_IDS, 48, repetition_penalty=2.0)


def test_generate_n_samples_each_prompt_distinctly_and_reproducibly(http):
    def texts(prompt, **params) -> list[str]:
        response = http.post("/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 8, "temperature": 1, "seed": 5, **params}})
        assert response.status_code == 200, response.text
        body = response.json()
        return [r["text"] for r in body] if isinstance(body, list) else [body["text"]]

    samples = texts("Hello", n=3)
    assert len(samples) == 3 and len(set(samples)) == 3
    assert texts("Hello", n=3) == samples
    assert texts("Hello", seed=6) == samples[1:2]  # sample j is seeded seed + j
    batch = texts(["Hello", "The weather"], n=2)  # prompt-major, as SGLang orders them
    assert batch[:2] == samples[:2] and batch[2:] == texts("The weather", n=2)


def test_generate_n_streams_each_sample_with_its_index(http):
    body = {"text": "Hello", "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1, "seed": 5, "n": 2}}
    final = {}
    with http.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                final[event["index"]] = event["text"]
    whole = http.post("/generate", json={**body, "stream": False}).json()
    assert [final[0], final[1]] == [r["text"] for r in whole]


@pytest.mark.parametrize(("body", "param"), [
    ({"text": "Hello", "rid": "mine", "sampling_params": {"n": 2}}, "rid"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params"),
    ({"text": "Hello", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "Hello", "sampling_params": {"n": 100000}}, "sampling_params.n"),
])
def test_generate_n_refusals(http, body, param):
    response = http.post("/generate", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_completions_max_tokens_null_is_openais_default(http, served_model):
    """An explicit null is OpenAI's default, 16, not the rest of the context."""
    reply = http.post("/v1/completions", json={"model": served_model, "prompt": "Hello", "max_tokens": None,
                                               "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 16


def test_return_token_ids_gives_the_prompt_and_each_choice_ids(http, openai_client, served_model):
    """vLLM's return_token_ids: what was sent and sampled, as ids, so that a trainer never retokenizes."""
    messages = [{"role": "user", "content": "Say something."}]
    chat = openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=5, n=2,
                                                 temperature=0, extra_body={"return_token_ids": True})
    prompt = chat.model_extra["prompt_token_ids"]
    assert len(prompt) == chat.usage.prompt_tokens
    # The same ids through /generate, greedy, give the same tokens: they are what the model saw and sampled.
    greedy = generate(http, input_ids=prompt, sampling_params={"max_new_tokens": 5, "temperature": 0})
    for choice in chat.choices:
        assert choice.model_extra["token_ids"] == greedy["output_ids"]
    streamed = list(openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=5,
                                                          temperature=0, stream=True,
                                                          extra_body={"return_token_ids": True}))
    assert streamed[0].model_extra["prompt_token_ids"] == prompt
    assert [t for c in streamed if c.choices for t in c.choices[0].model_extra.get("token_ids", [])] == greedy[
        "output_ids"]
    completion = openai_client.completions.create(model=served_model, prompt=["Hello", "Hi there"], max_tokens=3,
                                                  temperature=0, extra_body={"return_token_ids": True})
    for choice, text in zip(completion.choices, ["Hello", "Hi there"]):
        ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert choice.model_extra["prompt_token_ids"] == ids and len(choice.model_extra["token_ids"]) == 3
    events = list(openai_client.completions.create(model=served_model, prompt="Hello", max_tokens=3, temperature=0,
                                                   stream=True, extra_body={"return_token_ids": True}))
    firsts = [e.choices[0].model_extra for e in events if e.choices and "token_ids" in e.choices[0].model_extra]
    assert firsts[0]["prompt_token_ids"] == completion.choices[0].model_extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in extra for extra in firsts[1:])
    assert [t for extra in firsts for t in extra["token_ids"]] == completion.choices[0].model_extra["token_ids"]


SAMPLING_FIELDS = [("stop_regex", "a+", [None, []]), ("stream_interval", 4, [None]), ("structural_tag", "{}", [None]),
                   ("beam_width", 2, [None])]


@pytest.mark.parametrize(("field", "value", "neutral"), SAMPLING_FIELDS, ids=[f[0] for f in SAMPLING_FIELDS])
def test_sampling_param_refused_unless_neutral(http, field, value, neutral):
    def body(v):
        return {**GENERATE, "sampling_params": {**GENERATE["sampling_params"], field: v}}

    assert_refused(http.post("/generate", json=body(value)), f"sampling_params.{field}")
    for ok in neutral:
        assert http.post("/generate", json=body(ok)).status_code == 200


def test_sampling_seed_is_sglang_s_name_for_seed(http):
    def text(**seeds) -> str:
        sampling = {"max_new_tokens": 8, "temperature": 1.0, **seeds}
        response = http.post("/generate", json={"text": "Hello", "sampling_params": sampling})
        assert response.status_code == 200, response.text
        return response.json()["text"]

    assert text(sampling_seed=7) == text(seed=7) == text(seed=7, sampling_seed=7)
    assert text(sampling_seed=7) != text(sampling_seed=8)
    refused = http.post("/generate", json={**GENERATE, "sampling_params": {"seed": 1, "sampling_seed": 2}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "sampling_params"


@pytest.mark.parametrize(("endpoint", "body", "field"), [
    ("/generate", {**GENERATE, "max_new_tokens": 3}, "max_new_tokens"),  # belongs in sampling_params
    ("/generate", {**GENERATE, "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    (CHAT_ENDPOINT, {**CHAT, "max_token": 3}, "max_token"),
    (COMPLETIONS_ENDPOINT, {**COMPLETION, "stream_option": {"include_usage": True}}, "stream_option"),
])
def test_a_field_no_api_has_is_refused_by_name(http, served_model, endpoint, body, field):
    """As OpenAI refuses it: a misspelt or misplaced field would otherwise be dropped, and the request run with
    the default it meant to change."""
    response = http.post(endpoint, json={**body, "model": served_model} if endpoint != "/generate" else body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert response.json()["error"]["message"] == f"{field}: unrecognized field"


@pytest.mark.parametrize(("endpoint", "body", "field", "says"), [
    ("/generate", {**GENERATE, "sampling_params": {"max_new_tokens": 3, "include_stop_str_in_output": True}},
     "sampling_params.include_stop_str_in_output", "; use no_stop_trim"),  # chat and completions take it
    (COMPLETIONS_ENDPOINT, {**COMPLETION, "guided_regex": "a+"}, "guided_regex", "; use regex"),
    ("/generate", {**GENERATE, "sampling_params": {"max_new_tokens": 3, "use_beam_search": True}},
     "sampling_params.use_beam_search", ""),
])
def test_a_vllm_field_is_refused_as_one(http, served_model, endpoint, body, field, says):
    """Not as a misspelling: the message says whose field it is, and this server's way where it has one."""
    response = http.post(endpoint, json={**body, "model": served_model} if endpoint != "/generate" else body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert response.json()["error"]["message"] == f"{field}: vLLM's field, not supported by this server{says}"


def test_labels_and_hints_are_taken(openai_client, served_model):
    """metadata, safety_identifier and user label a request; prompt_cache_key routes it (with one replica, here,
    to that one); none of them changes the output."""
    plain = openai_client.chat.completions.create(model=served_model, **CHAT)
    labelled = openai_client.chat.completions.create(
        model=served_model, **CHAT, metadata={"run": "7"}, safety_identifier="u-1", user="u-1",
        prompt_cache_key="session-1")
    assert labelled.choices[0].message.content == plain.choices[0].message.content


def test_reasoning_effort_reaches_the_template_as_sglang_gives_it(http, served_model):
    """reasoning_effort "none" turns thinking off as enable_thinking false does (the default model's template
    then renders an empty think block into the prompt); other levels reach the template, which does not use
    them."""
    def prompt_ids(**fields) -> list[int]:
        response = http.post(CHAT_ENDPOINT, json={**CHAT, "model": served_model, "return_token_ids": True, **fields})
        assert response.status_code == 200, response.text
        return response.json()["prompt_token_ids"]

    default, no_thinking = prompt_ids(), prompt_ids(chat_template_kwargs={"enable_thinking": False})
    assert no_thinking != default
    assert prompt_ids(reasoning_effort="none") == no_thinking
    assert prompt_ids(reasoning_effort="high") == default
    assert prompt_ids(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == default
    response = http.post(CHAT_ENDPOINT, json={**CHAT, "model": served_model, "reasoning_effort": "extreme"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"
