"""vLLM's token-in/token-out route, POST /inference/v1/generate (issue 50), sent as its callers' sources send it:

- SkyRL's RemoteInferenceClient (skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py at a95645):
  _generate_single's payload (the sampling params get_vllm_sampling_params makes, in
  skyrl/backends/skyrl_train/inference_servers/engine_utils.py), with the X-Session-ID header, posted with aiohttp
  as _post does; and sample()'s Tinker payload (n, logprobs 0,
  output_kind 2, prompt_logprobs), read as convert_vllm_prompt_logprobs (skyrl/backends/utils.py) reads it.
- prime-rl's prefill_logprobs (prime_rl/utils/client.py at 559b44): the openai client's post to the route, read as
  it flattens prompt_logprobs (each position's first entry).

Tokens are checked against /generate's greedy output and transformers' own, logprobs against transformers' forward
(the project's 2e-3); fields flatwire cannot honour are refused by name.
"""

import asyncio
import json
import re

import aiohttp
import httpx
import orjson
import pytest
import torch
from transformers import AutoTokenizer

from tests.gateway.test_vllm_fields import ATOL, PROMPT_IDS, check_prompt_logprobs, reference_prompt_logprobs
from tests.scheduler.test_structured_output import EBNF, EBNF_LANGUAGE, REGEX, SCHEMA

ROUTE = "/inference/v1/generate"
NEW_TOKENS = 8


def skyrl_sampling_params(**overrides) -> dict:
    """get_vllm_sampling_params of SkyRL's generator config (greedy, as its eval sampling params are)."""
    return {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
            "max_tokens": NEW_TOKENS, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 0,
            "stop": None, **overrides}


def skyrl_post(url: str, payload: dict, session_id: str | None = None) -> dict:
    """RemoteInferenceClient._post: aiohttp, json=payload, raise on an error status."""
    headers = {"Content-Type": "application/json"}
    if session_id:
        headers["X-Session-ID"] = session_id

    async def post() -> dict:
        async with aiohttp.ClientSession() as session, session.post(
                url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as response:
            response.raise_for_status()
            return await response.json()

    return asyncio.run(post())


def teacher_forced(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: transformers' log-softmax before each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def greedy_reference(http, stack_reference_model) -> list[int]:
    """PROMPT_IDS' greedy continuation: /generate's, which transformers' must equal."""
    reply = http.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "min_new_tokens": 1, "temperature": 0}})
    reply.raise_for_status()
    tokens = reply.json()["output_ids"]
    with torch.no_grad():
        expected = stack_reference_model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=NEW_TOKENS,
                                                  min_new_tokens=1, do_sample=False)
    assert tokens == expected[0, len(PROMPT_IDS):].tolist() and len(tokens) == NEW_TOKENS
    return tokens


def test_skyrl_generate_single(stack, served_model, stack_reference_model, greedy_reference):
    """_generate_single's payload and what it reads back: choices[0].token_ids, finish_reason and
    logprobs.content[i].logprob."""
    payload = {"sampling_params": skyrl_sampling_params(), "model": served_model, "token_ids": PROMPT_IDS}
    response = skyrl_post(stack.http_url + ROUTE, payload, session_id="episode-7")
    choice = response["choices"][0]
    assert choice["token_ids"] == greedy_reference
    assert choice["finish_reason"] == "length"
    response_logprobs = [info["logprob"] for info in choice["logprobs"]["content"]]
    reference = teacher_forced(stack_reference_model, PROMPT_IDS, greedy_reference)
    expected = reference.gather(1, torch.tensor(greedy_reference)[:, None])[:, 0]
    assert response_logprobs == pytest.approx(expected.tolist(), abs=ATOL)
    for info, token in zip(choice["logprobs"]["content"], greedy_reference):
        assert info["token_id"] == token and info["rank"] is None  # logprobs 0: no top-k to place it in
        assert info["top_logprobs"] == [{"token_id": token, "logprob": info["logprob"], "rank": None}]
    usage = response["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT_IDS), NEW_TOKENS)
    assert usage["total_tokens"] == len(PROMPT_IDS) + NEW_TOKENS
    assert response["model"] == served_model and response["output_mode"] == "tokens"
    assert response["prompt_logprobs"] is None and response["prompt_token_ids"] is None


def test_output_top_logprobs_in_vllms_order(http, served_model, stack_reference_model, greedy_reference):
    """logprobs k: per token the sampled one first (its rank: its place in the top-k), then the rest of the top-k
    in rank order, max(k, 1) in all, each value transformers'."""
    k = 3
    reply = http.post(ROUTE, json={"model": served_model, "token_ids": PROMPT_IDS,
                                   "sampling_params": skyrl_sampling_params(logprobs=k)})
    reply.raise_for_status()
    content = reply.json()["choices"][0]["logprobs"]["content"]
    reference = teacher_forced(stack_reference_model, PROMPT_IDS, greedy_reference)
    for info, token, row in zip(content, greedy_reference, reference):
        top = torch.topk(row, k).indices.tolist()
        assert top[0] == token  # greedy: the sampled token is the top-1
        assert [entry["token_id"] for entry in info["top_logprobs"]] == top
        assert [entry["rank"] for entry in info["top_logprobs"]] == [1, 2, 3] and info["rank"] == 1
        for entry in info["top_logprobs"]:
            assert entry["logprob"] == pytest.approx(row[entry["token_id"]].item(), abs=ATOL)


def test_skyrl_tinker_sample_with_prompt_logprobs(stack, served_model, stack_reference_model, tokenizer):
    """sample()'s payload: n samples, logprobs 0, output_kind 2 (FINAL_ONLY), prompt_logprobs k, seeded; the
    prompt's logprobs once, top-level, read as convert_vllm_prompt_logprobs reads them."""
    k = 2
    sampling_params = {"n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": k, "temperature": 1.0,
                       "max_tokens": 4, "seed": 11, "top_k": -1, "top_p": 1.0}
    payload = {"sampling_params": sampling_params, "model": served_model, "token_ids": PROMPT_IDS}
    response = skyrl_post(stack.http_url + ROUTE, payload, session_id="tinker-session")
    assert [choice["index"] for choice in response["choices"]] == [0, 1]
    for choice in response["choices"]:
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 4
    reference = reference_prompt_logprobs(stack_reference_model, PROMPT_IDS)
    check_prompt_logprobs(response["prompt_logprobs"], PROMPT_IDS, k, reference, tokenizer)
    own = [(entry or {}).get(str(token), {}).get("logprob") if entry is not None else None
           for token, entry in zip(PROMPT_IDS, response["prompt_logprobs"])]
    assert own[0] is None and all(value is not None for value in own[1:])
    again = skyrl_post(stack.http_url + ROUTE, payload)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in response["choices"]]  # seeded


def test_prime_rl_prefill_logprobs(openai_client, served_model, stack_reference_model):
    """prefill_logprobs: the openai client's post of the route (absolute URL, cast_to httpx.Response), one logprob
    per prompt token (0.0 for the first), each position's first entry: the prompt token's own."""
    base = str(openai_client.base_url).rstrip("/").removesuffix("/v1")
    http_response = openai_client.post(f"{base}{ROUTE}", cast_to=httpx.Response, body={
        "model": served_model, "token_ids": PROMPT_IDS,
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}})
    response = orjson.loads(http_response.content)
    flat = []
    for entry in response["prompt_logprobs"] or []:
        flat.append(0.0 if not entry else float(next(iter(entry.values()))["logprob"]))
    reference = reference_prompt_logprobs(stack_reference_model, PROMPT_IDS)
    expected = [0.0] + reference.gather(1, torch.tensor(PROMPT_IDS[1:])[:, None])[:, 0].tolist()
    assert flat == pytest.approx(expected, abs=ATOL)


def test_streamed_chunks_join_to_the_whole_output(stack, served_model, greedy_reference):
    """stream true: vLLM's chunks, each sample's new ids (finish_reason with its last), the prompt's ids with the
    first when asked, a usage chunk last with include_usage, then [DONE]."""
    body = {"model": served_model, "token_ids": PROMPT_IDS, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, "sampling_params": skyrl_sampling_params(logprobs=1)}
    with httpx.Client(base_url=stack.http_url, timeout=120) as client, client.stream("POST", ROUTE, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [orjson.loads(line) for line in lines[:-1]]
    *outputs, last = chunks
    assert outputs[0]["prompt_token_ids"] == PROMPT_IDS and all("prompt_token_ids" not in c for c in outputs[1:])
    choices = [c["choices"][0] for c in outputs]
    assert sum((c["token_ids"] for c in choices), []) == greedy_reference
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert sum(len(c["logprobs"]["content"]) for c in choices) == NEW_TOKENS
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == NEW_TOKENS


def test_streamed_samples_are_the_whole_responses(stack, http):
    """n=2, seeded: each sample's streamed ids join to that sample's ids in the whole (non-streamed) response."""
    body = {"token_ids": PROMPT_IDS, "sampling_params": {"n": 2, "seed": 5, "temperature": 1.0,
                                                         "max_tokens": NEW_TOKENS, "ignore_eos": True}}
    whole = http.post(ROUTE, json=body).json()["choices"]
    with httpx.Client(base_url=stack.http_url, timeout=120) as client, \
            client.stream("POST", ROUTE, json={**body, "stream": True}) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for line in lines[:-1]:
        for choice in orjson.loads(line)["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
    assert [streamed[0], streamed[1]] == [choice["token_ids"] for choice in whole]
    assert streamed[0] != streamed[1]


def test_cache_salt_and_adapterless_model_names(http, served_model, greedy_reference):
    """cache_salt runs in its own prefix-cache namespace (the same tokens come out); a model that is not served
    is vLLM's 404."""
    body = {"token_ids": PROMPT_IDS, "cache_salt": "salt-of-weight-version-3",
            "sampling_params": skyrl_sampling_params()}
    salted = http.post(ROUTE, json=body)
    assert salted.status_code == 200 and salted.json()["choices"][0]["token_ids"] == greedy_reference
    missing = http.post(ROUTE, json={**body, "model": "no-such-model"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_structured_outputs_constrain_the_tokens(http, tokenizer):
    """vLLM's structured_outputs (regex, json schema, grammar) on the scheduler's grammar: the ids decode to the
    constrained language; one the grammar cannot compile is refused naming structured_outputs."""
    def ask(constraint: dict, seed: int = 1) -> dict:
        reply = http.post(ROUTE, json={"token_ids": tokenizer.encode("Reply:"), "sampling_params": {
            "max_tokens": 64, "temperature": 1.0, "seed": seed, "structured_outputs": constraint}})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    for seed in (1, 2):
        choice = ask({"regex": REGEX}, seed)
        assert choice["finish_reason"] == "stop" and re.fullmatch(REGEX, tokenizer.decode(choice["token_ids"],
                                                                                         skip_special_tokens=True))
    document = json.loads(tokenizer.decode(ask({"json": SCHEMA})["token_ids"], skip_special_tokens=True))
    assert set(document) == {"a"} and isinstance(document["a"], int)
    assert tokenizer.decode(ask({"grammar": EBNF})["token_ids"], skip_special_tokens=True) in EBNF_LANGUAGE
    refused = http.post(ROUTE, json={"token_ids": PROMPT_IDS, "sampling_params": {"structured_outputs": {
        "regex": "[a-"}}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "sampling_params.structured_outputs"


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [-1]}, "token_ids"),
    ({"features": {"mm_hashes": {}, "mm_placeholders": {}}}, "features"),
    ({"output_mode": "text"}, "output_mode"),
    ({"priority": 1}, "priority"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"sampling_params": {"structured_outputs": {"choice": ["a", "b"]}}}, "sampling_params.structured_outputs.choice"),
    ({"sampling_params": {"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}},
     "sampling_params.structured_outputs"),
    ({"sampling_params": {"structured_outputs": {"regex": "a"}, "regex": "b"}}, "sampling_params.structured_outputs"),
    ({"sampling_params": {"allowed_token_ids": [1, 2]}}, "sampling_params.allowed_token_ids"),
    ({"sampling_params": {"logprob_token_ids": [1, 2]}}, "sampling_params.logprob_token_ids"),
    ({"sampling_params": {"bad_words": ["x"]}}, "sampling_params.bad_words"),
    ({"sampling_params": {"output_kind": 1}}, "sampling_params.output_kind"),
    ({"sampling_params": {"prompt_logprobs": 1}, "stream": True}, "sampling_params.prompt_logprobs"),
    ({"sampling_params": {"detokenize": False, "stop": ["."]}}, "sampling_params.stop"),
    ({"sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
    ({"sampling_params": {"max_tokens": 100_000}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
    ({"sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
])
def test_what_it_cannot_honour_is_refused_by_name(http, body, param):
    request = {"token_ids": PROMPT_IDS, **body, "sampling_params": {"max_tokens": 2, **body.get("sampling_params", {})}}
    reply = http.post(ROUTE, json=request)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
