"""max_new_tokens 0 (SGLang) / max_tokens 0 (OpenAI): no output token, the prompt's logprobs only, as scoring
clients ask for them; and the output-length defaults each API documents."""

import grpc
from flatwire_wire.public import GENERATION, GenerateRequest, GenerateResponse, SamplingParams

from harness.http import generate

PROMPT_IDS = [9707, 11, 1879, 0, 576, 4171, 315]


def score(http, max_new_tokens: int) -> dict:
    """The prompt's logprobs (top 3) from position 0, and max_new_tokens greedy tokens."""
    return generate(http, input_ids=PROMPT_IDS, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0},
                    return_logprob=True, logprob_start_len=0, top_logprobs_num=3)


def test_generate_with_no_new_tokens_returns_the_prompt_logprobs(http):
    scored = score(http, 0)
    assert scored["output_ids"] == [] and scored["text"] == ""
    meta = scored["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    # The same prompt rows as a request that also generates.
    generated = score(http, 2)["meta_info"]
    assert meta["input_token_logprobs"] == generated["input_token_logprobs"]
    assert meta["input_top_logprobs"] == generated["input_top_logprobs"]
    assert len(meta["input_token_logprobs"]) == len(PROMPT_IDS)


def test_streamed_generate_with_no_new_tokens_ends_at_once(http):
    with http.stream("POST", "/generate", json={"input_ids": PROMPT_IDS, "stream": True,
                                                "sampling_params": {"max_new_tokens": 0}}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 2 and '"length"' in lines[0]


def test_completions_echo_scores_the_prompt_with_max_tokens_0(openai_client, served_model):
    choice = openai_client.completions.create(model=served_model, prompt="The capital of France is", max_tokens=0,
                                              echo=True, logprobs=2).choices[0]
    assert choice.text == "The capital of France is" and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and all(v < 0 for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text


def test_grpc_max_new_tokens_0_is_explicit_and_unset_is_128(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = GENERATION.calls(channel)

        def call(**sampling) -> GenerateResponse:
            request = GenerateRequest(input_ids=PROMPT_IDS, return_logprob=True, logprob_start_len=0,
                                      sampling=SamplingParams(ignore_eos=True, **sampling))
            *_, last = stub["Generate"](request, timeout=120)
            return last

        scored = call(max_new_tokens=0)
        # Every position but the first (nothing precedes it) has a row.
        assert scored.completion_tokens == 0 and scored.prompt_logprobs().n == len(PROMPT_IDS) - 1
        assert scored.prompt_logprobs().token_ids.tolist() == PROMPT_IDS[1:]
        assert scored.prompt_logprobs().null_token_ids.tolist() == PROMPT_IDS[:1]
        assert call().completion_tokens == 128
