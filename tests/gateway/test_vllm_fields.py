"""vLLM's completion fields on chat and completions (issue 50): prompt_logprobs in vLLM's shape, checked against
transformers' own forward; include_stop_str_in_output; and TRL's async GRPO rollout request (return_token_ids,
logprobs 0), sent as trl/experimental/async_grpo/async_rollout_worker.py sends it, with aiohttp."""

import asyncio

import aiohttp
import pytest
import torch
from transformers import AutoTokenizer

PROMPT_IDS = [9707, 11, 1879, 0, 576, 4171, 315, 279, 1879]
ATOL = 2e-3  # the project's bar against transformers' forward


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def reference_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: log-softmax of the logits before each prompt token but the first."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check_prompt_logprobs(entries: list, ids: list[int], k: int, reference: torch.Tensor, tokenizer) -> None:
    """vLLM's shape: None first, then per position the prompt token's entry first and the top-k (ranks 1..k), each
    id once; every value as transformers computes it, each decoded_token the id decoded alone."""
    assert len(entries) == len(ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row = reference[position - 1]
        token = ids[position]
        top = torch.topk(row, k).indices.tolist() if k else []
        assert list(entry)[0] == str(token)  # the prompt token first (JSON keys are strings)
        assert sorted(map(int, entry)) == sorted({token, *top})
        for key, value in entry.items():
            assert value["logprob"] == pytest.approx(row[int(key)].item(), abs=ATOL)
            assert value["decoded_token"] == tokenizer.decode([int(key)])
        for rank, candidate in enumerate(top, start=1):
            assert entry[str(candidate)]["rank"] == rank
        exact_rank = int((row >= row[token]).sum())  # vLLM counts the vocabulary at or above it
        assert entry[str(token)]["rank"] == (exact_rank if token in top else None)


def test_completions_prompt_logprobs_in_vllms_shape(openai_client, served_model, stack_reference_model, tokenizer):
    """Each choice carries its prompt's prompt_logprobs (two prompts, n=2 here); the output's logprobs keep their
    own top-k (1), though the scheduler computed the prompt's 4 for both."""
    prompts = [PROMPT_IDS, PROMPT_IDS[2:]]
    reply = openai_client.completions.create(model=served_model, prompt=prompts, max_tokens=3, temperature=0, n=2,
                                             logprobs=1, extra_body={"prompt_logprobs": 4})
    assert len(reply.choices) == 4
    for choice in reply.choices:
        ids = prompts[choice.index // 2]
        check_prompt_logprobs(choice.prompt_logprobs, ids, 4, reference_prompt_logprobs(stack_reference_model, ids),
                              tokenizer)
        assert all(len(row) <= 2 for row in choice.logprobs.top_logprobs)  # logprobs 1: the top 1 and its token
    plain = openai_client.completions.create(model=served_model, prompt=PROMPT_IDS, max_tokens=3, temperature=0)
    assert reply.choices[0].text == plain.choices[0].text
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None  # only when asked for


def test_chat_prompt_logprobs_are_top_level_over_the_templated_prompt(openai_client, served_model,
                                                                     stack_reference_model, tokenizer):
    """prime-rl's scoring request asks for 1; 0 gives the prompt tokens' own logprobs alone."""
    for k in (0, 1):
        reply = openai_client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=2,
            temperature=0, logprobs=True, top_logprobs=2, extra_body={"prompt_logprobs": k, "return_token_ids": True})
        ids = reply.prompt_token_ids
        expected = reference_prompt_logprobs(stack_reference_model, ids)
        check_prompt_logprobs(reply.prompt_logprobs, ids, k, expected, tokenizer)
        assert all(len(token.top_logprobs) == 2 for token in reply.choices[0].logprobs.content)


@pytest.mark.parametrize(("body", "says"), [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs: not available with stream true"),
    ({"prompt_logprobs": -1}, "prompt_logprobs: -1 (the whole vocabulary"),
    ({"prompt_logprobs": -2}, "prompt_logprobs: Input should be greater than or equal to -1"),
    ({"prompt_logprobs": 100_000}, "prompt_logprobs: prompt_logprobs=100000 exceeds this server's maximum"),
    ({"prompt_logprobs": "two"}, "prompt_logprobs: Input should be a valid integer"),
    ({"prompt_logprobs": 3, "logprobs": 1, "return_meta_info": True, "return_flat_raw_output_top_logprobs": True},
     "prompt_logprobs: at most the output's top-k with return_flat_raw_output_top_logprobs"),
    # 16 generations x 1999 prompt positions x 256: past --max-logprob-elements, which names the field that sized it
    ({"prompt": [[9707] * 2000] * 4, "n": 4, "prompt_logprobs": 256, "logprobs": 1},
     "prompt_logprobs: the response would carry"),
])
def test_prompt_logprobs_it_cannot_serve_are_refused_by_name(http, served_model, body, says):
    reply = http.post("/v1/completions", json={"model": served_model, "prompt": "Hello", "max_tokens": 1, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "prompt_logprobs" and reply.json()["error"]["message"].startswith(says)


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(http, openai_client, served_model):
    """vLLM cuts the text right after the matched stop string (SGLang's no_stop_trim keeps the rest of its token);
    streamed, the chunks join to the same text."""
    common = {"model": served_model, "prompt": "The list: one, two, three, four, five,", "max_tokens": 16,
              "temperature": 0}
    full = openai_client.completions.create(**common).choices[0].text
    stop = full[3:6]
    assert full.find(stop) == 3
    cut = openai_client.completions.create(**common, stop=[stop]).choices[0]
    kept = openai_client.completions.create(**common, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert cut.text == full[:3] and cut.finish_reason == "stop"
    assert kept.choices[0].text == full[:6] and kept.choices[0].finish_reason == "stop"
    streamed = openai_client.completions.create(**common, stop=[stop], stream=True,
                                                extra_body={"include_stop_str_in_output": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == full[:6]
    chat = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0)
    content = chat.choices[0].message.content
    kept_chat = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0,
        stop=[content[2:4]], extra_body={"include_stop_str_in_output": True})
    assert kept_chat.choices[0].message.content == content[:content.find(content[2:4]) + 2]


def test_trl_async_grpo_rollout_request(stack, served_model, tokenizer):
    """_AsyncRolloutLoop._generate_one_turn's payload, posted as its _post does (aiohttp, json=payload), and read as
    it reads the reply: the choice's token_ids and logprobs.token_logprobs, one per token."""
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    payload = {"model": served_model, "prompt": prompt_ids, "max_tokens": 8, "temperature": 1.0, "n": 1,
               "return_token_ids": True, "logprobs": 0}

    async def post() -> dict:
        async with aiohttp.ClientSession() as session, session.post(
                f"{stack.http_url}/v1/completions", json=payload, timeout=aiohttp.ClientTimeout(total=120)) as response:
            response.raise_for_status()
            return await response.json()

    output = asyncio.run(post())
    choice = output["choices"][0]
    turn_ids, turn_logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(turn_ids) == len(turn_logprobs) == output["usage"]["completion_tokens"] > 0
    assert all(isinstance(value, float) and value <= 0 for value in turn_logprobs)
    assert choice["prompt_token_ids"] == prompt_ids
    assert tokenizer.decode(turn_ids, skip_special_tokens=True) == choice["text"]
