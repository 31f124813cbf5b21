"""The `openai` package against the gateway's /v1 routes."""

import base64
import itertools

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Name three "},
                                         {"type": "text", "text": "colours."}]}]
K = 4


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client) -> str:
    [served] = client.models.list().data
    return served.id


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def chat(client, **kwargs):
    model = client.models.list().data[0].id  # the served name: the model directory's name
    return client.chat.completions.create(**{"model": model, "messages": MESSAGES, "max_tokens": 10,
                                             "temperature": 0, **kwargs})


def test_chat_with_logprobs(client, tokenizer):
    response = chat(client, logprobs=True, top_logprobs=K)
    assert isinstance(response, openai.types.chat.ChatCompletion)
    [choice] = response.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 10
    template = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
        tokenize=False, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(tokenizer.encode(template, add_special_tokens=False))
    assert response.usage.total_tokens == response.usage.prompt_tokens + 10
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == K
        assert entry.top_logprobs[0].token == entry.token  # greedy: the pick is the best candidate
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert all(a.logprob >= b.logprob for a, b in zip(entry.top_logprobs, entry.top_logprobs[1:]))
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == choice.message.content


def test_chat_stream_matches_non_stream(client):
    whole = chat(client, logprobs=True, top_logprobs=K)
    chunks = list(chat(client, logprobs=True, top_logprobs=K, stream=True, stream_options={"include_usage": True}))
    assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.choices[0].logprobs.content]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage, whole_usage = chunks[-1].usage.model_dump(), whole.usage.model_dump()
    # The prompt's second run may find it in the prefix cache (the first may have too): only cached_tokens may grow.
    assert usage["prompt_tokens_details"].pop("cached_tokens") >= whole_usage["prompt_tokens_details"].pop(
        "cached_tokens")
    assert chunks[-1].choices == [] and usage == whole_usage
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])  # null until the last, as OpenAI


def test_chat_n_and_stop(client):
    response = chat(client, n=3, temperature=1.0, seed=7)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == sum(10 for _ in response.choices)
    full = chat(client, max_tokens=16).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    stopped = chat(client, max_tokens=16, stop=[stop]).choices[0]
    assert stopped.message.content == full[:full.index(stop)] and stopped.finish_reason == "stop"
    streams = list(chat(client, n=2, stream=True, max_tokens=5))
    for index in (0, 1):
        assert len([c for c in streams if c.choices[0].index == index and c.choices[0].finish_reason]) == 1


def test_chat_flat_candidates_in_meta_info(client):
    # The prompt's KV into the prefix cache first: both requests below find it there (a request that computed it
    # would not be bit-equal to one that reads it: attention over cached pages sums in another order).
    chat(client, max_tokens=1)
    nested = chat(client, logprobs=True, top_logprobs=K).choices[0]
    flat = chat(client, logprobs=True, top_logprobs=K, extra_body={
        "return_meta_info": True, "return_flat_raw_output_top_logprobs": True}).choices[0]
    assert [e.logprob for e in flat.logprobs.content] == [e.logprob for e in nested.logprobs.content]
    assert all(e.top_logprobs == [] for e in flat.logprobs.content)
    meta = flat.model_extra["meta_info"]
    assert meta["output_top_logprobs_shape"] == [10, K]
    values = np.frombuffer(base64.b64decode(meta["output_top_logprobs_val_flat_b64"]), "<f4").reshape(10, K)
    expected = np.array([[c.logprob for c in e.top_logprobs] for e in nested.logprobs.content], dtype=np.float32)
    np.testing.assert_array_equal(values, expected)
    as_json = chat(client, logprobs=True, top_logprobs=K, extra_body={
        "return_meta_info": True, "return_flat_raw_output_top_logprobs": True,
        "return_flat_raw_top_logprobs_b64": False}).choices[0].model_extra["meta_info"]
    np.testing.assert_array_equal(np.array(as_json["output_top_logprobs_val_flat"], np.float32).reshape(10, K),
                                  values)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_flat_candidates_concatenate_to_the_whole(client, model, endpoint):
    """stream=True with return_meta_info and the flat flag: each chunk's meta_info holds its own rows (at
    output_top_logprobs_offset), the last one SGLang's finish meta_info; concatenated, the rows are the
    non-streamed response's, bit for bit."""
    extra = {"return_meta_info": True, "return_flat_raw_output_top_logprobs": True,
             "return_flat_raw_top_logprobs_b64": True}
    if endpoint == "chat":
        def create(**kwargs):
            return chat(client, logprobs=True, top_logprobs=K, extra_body=extra, **kwargs)
    else:
        def create(**kwargs):
            return client.completions.create(model=model, prompt="Flat arrays", max_tokens=10, temperature=0,
                                             logprobs=K, extra_body=extra, **kwargs)
    whole = create().choices[0].model_extra["meta_info"]
    metas = [c.choices[0].model_extra["meta_info"] for c in create(stream=True)
             if c.choices and c.choices[0].model_extra.get("meta_info")]
    rows = [m for m in metas if "output_top_logprobs_shape" in m]
    # A token per chunk, or several in one when the gateway runs behind (stream coalescing): either way each chunk's
    # offset is the count of the rows before it.
    counts = [m["output_top_logprobs_shape"][0] for m in rows]
    assert all(m["output_top_logprobs_shape"] == [n, K] and n > 0 for m, n in zip(rows, counts))
    assert [m["output_top_logprobs_offset"] for m in rows] == list(itertools.accumulate(counts, initial=0))[:-1]
    assert sum(counts) == 10
    values = b"".join(base64.b64decode(m["output_top_logprobs_val_flat_b64"]) for m in rows)
    ids = b"".join(base64.b64decode(m["output_top_logprobs_idx_flat_b64"]) for m in rows)
    assert values == base64.b64decode(whole["output_top_logprobs_val_flat_b64"])
    assert ids == base64.b64decode(whole["output_top_logprobs_idx_flat_b64"])
    assert metas[-1]["finish_reason"] == whole["finish_reason"]
    assert metas[-1]["completion_tokens"] == whole["completion_tokens"] == 10


def test_completions(client, model, tokenizer):
    prompt = "Tokyo 東京 and a fox 🦊 walk into"
    response = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=K,
                                         echo=True)
    assert isinstance(response, openai.types.Completion)
    [choice] = response.choices
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    n_prompt = len(tokenizer.encode(prompt))
    assert len(logprobs.tokens) == n_prompt + 6 == response.usage.total_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(len(row) <= K + 1 for row in logprobs.top_logprobs[1:])  # the top K and the row's own token
    assert all(token in row for token, row in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:]))
    assert logprobs.text_offset[0] == 0
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert choice.text == prompt + plain.choices[0].text
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])


def test_completions_batch_of_token_ids(client, model, tokenizer):
    prompts = [tokenizer.encode("one"), tokenizer.encode("two three")]
    response = client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: both samples of a prompt agree
    assert response.usage.prompt_tokens == sum(map(len, prompts))


def test_errors_are_typed(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as too_many:
        chat(client, logprobs=True, top_logprobs=100_000)
    assert too_many.value.body["param"] == "top_logprobs"
    assert chat(client).choices[0].finish_reason == "length"  # still serving
