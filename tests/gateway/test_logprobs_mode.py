"""logprobs_mode: output logprobs of the distribution each token was drawn from (processed_logprobs), or of the
raw model (raw_logprobs, the OpenAI routes' default), through /generate, the OpenAI routes and the public gRPC API;
SGLang's (sglang_logprobs, /generate's default) against transformers: tests/gateway/test_top_p_replay.py. The
sampler's arithmetic against a numpy reference: tests/scheduler/test_sampler.py."""

import math

import numpy as np
import pytest
from flatwire_client import FlatwireClient
from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest

from harness.http import generate
from services.scheduler.submit import SubmitLimits, parse_request

SAMPLED = {"temperature": 0.8, "top_k": 12, "top_p": 0.9, "seed": 7, "max_new_tokens": 8, "ignore_eos": True}
TOP = 40  # more candidates than top_k keeps: the rest are undrawable


def sampled_logprobs(http, mode: str | None) -> dict:
    body = {"text": "The capital of France is", "sampling_params": SAMPLED, "return_logprob": True,
            "top_logprobs_num": TOP}
    return generate(http, **body, **({"logprobs_mode": mode} if mode else {}))["meta_info"]


def test_processed_logprobs_are_of_the_truncated_distribution(http):
    processed, raw = sampled_logprobs(http, "processed_logprobs"), sampled_logprobs(http, "raw_logprobs")
    tokens = [token for _, token, _ in processed["output_token_logprobs"]]
    assert tokens == [token for _, token, _ in raw["output_token_logprobs"]]  # the mode changes no draw
    for (logprob, _, _), top in zip(processed["output_token_logprobs"], processed["output_top_logprobs"]):
        assert logprob is not None and logprob <= 0  # the sampled token was drawable
        drawable = [value for value, _, _ in top if value is not None]  # -inf is null in JSON
        assert 1 <= len(drawable) <= SAMPLED["top_k"]
        assert top[:len(drawable)] == [entry for entry in top if entry[0] is not None]  # best first
        assert math.fsum(math.exp(v) for v in drawable) == pytest.approx(1.0, abs=1e-4)  # renormalized
    for top in raw["output_top_logprobs"]:
        assert all(value is not None for value, _, _ in top)
        assert math.fsum(math.exp(value) for value, _, _ in top) < 1  # the model's: mass beyond the top 40


def test_greedy_processed_logprobs_are_the_temperature_zero_limit(http):
    meta = generate(http, text="Hello", sampling_params={"temperature": 0, "max_new_tokens": 4},
                    return_logprob=True, top_logprobs_num=3, token_ids_logprob=[0],
                    logprobs_mode="processed_logprobs")["meta_info"]
    for (logprob, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert logprob == 0.0
        assert top[0][:2] == [0.0, token] and [value for value, _, _ in top[1:]] == [None, None]


def test_openai_routes_take_logprobs_mode(openai_client, served_model):
    chat = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, extra_body={"logprobs_mode": "processed_logprobs"})
    assert [entry.logprob for entry in chat.choices[0].logprobs.content] == [0.0] * 4
    completion = openai_client.completions.create(
        model=served_model, prompt="Hi", max_tokens=4, temperature=0, logprobs=1,
        extra_body={"logprobs_mode": "processed_logprobs"})
    assert completion.choices[0].logprobs.token_logprobs == [0.0] * 4


def test_grpc_takes_logprobs_mode(stack):
    with FlatwireClient(stack.grpc_address) as client:
        result = client.generate("Hi", max_new_tokens=4, temperature=0, top_logprobs_num=2,
                                 logprobs_mode="processed_logprobs")
        raw = client.generate("Hi", max_new_tokens=4, temperature=0, top_logprobs_num=2)  # SGLang's: at T=1
    assert result.output is not None and raw.output is not None
    np.testing.assert_array_equal(result.output.token_logprobs, np.zeros(4, np.float32))
    np.testing.assert_array_equal(result.output.topk_values, np.tile([0.0, -np.inf], (4, 1)).astype(np.float32))
    assert (raw.output.token_logprobs < 0).all()


@pytest.mark.parametrize("endpoint, body", [
    ("/generate", {"text": "Hi", "return_logprob": True}),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 1, "model": "m"}),
])
def test_unknown_logprobs_mode_is_refused(http, endpoint, body):
    response = http.post(endpoint, json={**body, "logprobs_mode": "sampled"})
    assert response.status_code == 400, response.text
    assert "logprobs_mode" in response.text


def test_server_reports_its_defaults(http):
    info = http.get("/get_server_info").json()
    assert (info["logprobs_mode"], info["return_original_logprob"]) == ("raw_logprobs", False)


MODES = [LogprobsMode.RAW, LogprobsMode.PROCESSED, LogprobsMode.SGLANG]


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("default", MODES)
@pytest.mark.parametrize("asked", [LogprobsMode.UNSPECIFIED, *MODES])
def test_a_request_names_its_mode_or_takes_the_servers(default, asked, replay):
    """SGLang's mode with top-p replay is the distribution renormalized over the nucleus, as SGLang's replay."""
    limits = SubmitLimits(100, 64, 5, (), output_interval=1, logprobs_mode=default)
    request = parse_request(TokenizedRequest(rid="r", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2,
                                                                                                top_p=0.9),
                                             logprob=LogprobParams(return_logprob=True, logprobs_mode=asked),
                                             return_top_p_token_ids=replay), limits)
    mode = asked or default
    assert request.logprobs_mode is (LogprobsMode.PROCESSED if replay and mode is LogprobsMode.SGLANG else mode)
