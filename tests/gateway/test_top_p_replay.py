"""SGLang's logprob semantics and slime's top-p replay through the real services, against transformers' own
distribution on the default model, position by position: the forward of prompt + output in float64, the
temperature and the cut applied here.

- /generate's default logprobs are SGLang's: log-softmax of the logits at the temperature, before the cut; with
  top-p replay (sampling_params.custom_params.return_top_p_token_ids, as slime sends it) they are renormalized
  over each token's nucleus (as slime's SGLang returns them); per request `raw_logprobs` and a gateway started
  with SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB give the model's own; the OpenAI routes give vLLM's default, raw.
- The nucleus (meta_info.top_p_token_ids / top_p_token_offsets) is the set the sampler kept: equal to the
  reference's, but for tokens within float tolerance of the cut (reference_nucleus), which are allowed either way
  and counted, so that a test that excused everything would fail.

The sampler's arithmetic alone, on known distributions: tests/scheduler/test_sampler.py.
"""

import base64

import numpy as np
import pytest
import torch
from flatwire_client import FlatwireClient, HttpClient

from harness.http import generate, stream_events
from tests.gateway.bodies import SERVED

# A distribution peaked enough that the nuclei are small (the default model's weights are random: at temperature
# 1 top-p 0.9 keeps 200k of its 248k tokens) and far from uniform: hundreds of tokens each.
TEMPERATURE = 0.05
SAMPLED = {"temperature": TEMPERATURE, "top_p": 0.9, "max_new_tokens": 10, "seed": 11, "ignore_eos": True}
REPLAY = {"custom_params": {"return_top_p_token_ids": True}}
LOGPROB_TOL = 2e-3  # flatwire's logprobs against transformers' (the project's bar)
# The reference's logits and the server's differ by ~1e-5 (float32, other kernels); over the temperature that is
# ~2e-4 in a log-probability, so a token's probability, and the mass before it, may differ by a few 1e-4 (relative):
# tokens closer than these to a cut may fall either side of it.
MASS_TOL = 1e-3
RELATIVE_TOL = 1e-3


def prompt_ids(seed: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(0, 240_000, length).tolist()


def reference_logits(model, prompt: list[int], output: list[int]) -> np.ndarray:
    """[len(output), vocab] float64: the logits each output token was drawn from, by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].double()
    return logits[len(prompt) - 1:len(prompt) + len(output) - 1].numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def reference_nucleus(logits: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = -1,
                      min_p: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(kept, near) boolean masks over the vocabulary: what flatwire's sampler keeps (top-k; top-p over the mass
    top-k kept; min-p against the best), and the tokens within float tolerance of one of those cuts."""
    p = np.exp(log_softmax(logits / temperature))
    kept, near = np.ones(len(p), bool), np.zeros(len(p), bool)
    if top_k > 0:
        kth = np.sort(p)[-top_k]
        kept &= p >= kth
        near |= np.abs(p - kth) <= RELATIVE_TOL * kth
    if top_p < 1:
        q = np.where(kept, p, 0.0)
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        limit = top_p * q.sum()
        in_top_p = np.zeros(len(p), bool)
        in_top_p[order] = before < limit
        kept &= in_top_p
        at_cut = np.zeros(len(p), bool)
        at_cut[order] = np.abs(before - limit) <= MASS_TOL
        near |= at_cut & (q > 0)
    if min_p > 0:
        floor = min_p * p.max()
        kept &= p >= floor
        near |= np.abs(p - floor) <= RELATIVE_TOL * floor
    return kept, near


def nuclei_of(meta: dict) -> list[np.ndarray]:
    """Each token's nucleus from meta_info: JSON lists, or base64 of int32."""
    if "top_p_token_ids_b64" in meta:
        assert meta["top_p_token_ids_b64_dtype"] == meta["top_p_token_offsets_b64_dtype"] == "int32"
        ids = np.frombuffer(base64.b64decode(meta["top_p_token_ids_b64"]), "<i4")
        offsets = np.frombuffer(base64.b64decode(meta["top_p_token_offsets_b64"]), "<i4")
    else:
        ids, offsets = np.array(meta["top_p_token_ids"]), np.array(meta["top_p_token_offsets"])
    assert offsets[0] == 0 and offsets[-1] == len(ids) and (np.diff(offsets) >= 0).all()
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def check_nuclei(nuclei: list[np.ndarray], tokens: list[int], logits: np.ndarray, **cut) -> int:
    """Each nucleus is the reference's, ascending, and holds its token; tokens near a cut are allowed either way.
    The number of those."""
    assert len(nuclei) == len(tokens)
    excused = 0
    for nucleus, token, row in zip(nuclei, tokens, logits):
        kept, near = reference_nucleus(row, SAMPLED["temperature"], **cut)
        got = np.zeros(len(row), bool)
        got[nucleus] = True
        assert (np.diff(nucleus) > 0).all() and got[token]
        wrong = (got != kept) & ~near
        assert not wrong.any(), f"nucleus differs at {np.flatnonzero(wrong)[:10]} (of {kept.sum()} kept)"
        excused += int((got != kept).sum())
    return excused


def logprobs_of(meta: dict) -> tuple[list[float], list[int]]:
    return [entry[0] for entry in meta["output_token_logprobs"]], [entry[1] for entry in meta["output_token_logprobs"]]


@pytest.fixture(scope="module")
def replayed(http, stack_reference_model):
    """One sampled request with top-p replay and top-5 logprobs, its nuclei and the reference's logits."""
    prompt = prompt_ids(1)
    body = {"input_ids": prompt, "sampling_params": {**SAMPLED, **REPLAY}, "return_logprob": True,
            "top_logprobs_num": 5}
    result = generate(http, **body)
    tokens = result["output_ids"]
    return body, result, reference_logits(stack_reference_model, prompt, tokens)


def test_the_nuclei_are_transformers_top_p_sets(replayed):
    _, result, logits = replayed
    meta = result["meta_info"]
    nuclei = nuclei_of(meta)
    excused = check_nuclei(nuclei, result["output_ids"], logits, top_p=SAMPLED["top_p"])
    assert sum(map(len, nuclei)) > 20 * len(nuclei) and excused <= sum(map(len, nuclei)) // 100
    with pytest.raises(AssertionError, match="nucleus differs"):  # the check tells a nearby cut apart
        check_nuclei(nuclei, result["output_ids"], logits, top_p=SAMPLED["top_p"] - 0.02)


def test_replayed_logprobs_are_renormalized_over_the_nucleus(replayed):
    """slime's SGLang: with top-p replay, the token's and the top-k's logprobs are of its nucleus, renormalized
    (what its trainer recomputes with the same mask); tokens outside it are -inf (null)."""
    _, result, logits = replayed
    meta = result["meta_info"]
    values, tokens = logprobs_of(meta)
    for value, token, nucleus, row, top in zip(values, tokens, nuclei_of(meta), logits, meta["output_top_logprobs"]):
        inside = np.full(len(row), -np.inf)
        inside[nucleus] = row[nucleus] / TEMPERATURE
        want = log_softmax(inside)
        assert value == pytest.approx(want[token], abs=LOGPROB_TOL)
        for top_value, top_id, _ in top:
            assert top_value == pytest.approx(want[top_id], abs=LOGPROB_TOL) if top_value is not None \
                else top_id not in nucleus
        assert [v for v, _, _ in top] == sorted((v for v, _, _ in top), key=lambda v: -np.inf if v is None else v,
                                                reverse=True)


def test_default_logprobs_are_sglangs_at_the_temperature_before_the_cut(http, stack_reference_model):
    """Without replay: log-softmax(logits / T) over the whole vocabulary, top-k of the same; raw_logprobs per
    request: the model's own, at temperature 1 (the same tokens: the mode changes no draw)."""
    prompt = prompt_ids(2)
    body = {"input_ids": prompt, "sampling_params": SAMPLED, "return_logprob": True, "top_logprobs_num": 5}
    meta = generate(http, **body)["meta_info"]
    raw = generate(http, **body, logprobs_mode="raw_logprobs")["meta_info"]
    values, tokens = logprobs_of(meta)
    raw_values, raw_tokens = logprobs_of(raw)
    assert raw_tokens == tokens
    logits = reference_logits(stack_reference_model, prompt, tokens)
    scaled, unscaled = log_softmax(logits / TEMPERATURE), log_softmax(logits)
    for i, token in enumerate(tokens):
        assert values[i] == pytest.approx(scaled[i, token], abs=LOGPROB_TOL)
        assert raw_values[i] == pytest.approx(unscaled[i, token], abs=LOGPROB_TOL)
        top = meta["output_top_logprobs"][i]
        np.testing.assert_allclose([v for v, _, _ in top], np.sort(scaled[i])[::-1][:5], atol=LOGPROB_TOL)
    # At T=0.05 the two differ by far more than the tolerance: the test tells them apart.
    assert max(abs(a - b) for a, b in zip(values, raw_values)) > 0.5


def test_top_k_and_min_p_cut_the_nucleus_too(http, stack_reference_model):
    """The nucleus is what every cut kept, as SGLang's replay returns it: top-k, then top-p, then min-p."""
    prompt = prompt_ids(3)
    cuts = {"top_k": 40, "top_p": 0.95, "min_p": 0.02}
    sampling = {**SAMPLED, **cuts, **REPLAY}
    result = generate(http, input_ids=prompt, sampling_params=sampling)
    assert "output_token_logprobs" not in result["meta_info"]  # replay needs no logprobs
    tokens = result["output_ids"]
    nuclei = nuclei_of(result["meta_info"])
    check_nuclei(nuclei, tokens, reference_logits(stack_reference_model, prompt, tokens), **cuts)
    assert max(map(len, nuclei)) <= cuts["top_k"]


def test_a_greedy_tokens_nucleus_is_itself(http):
    meta = generate(http, input_ids=prompt_ids(4), sampling_params={"temperature": 0, "max_new_tokens": 5, **REPLAY},
                    return_logprob=True)["meta_info"]
    values, tokens = logprobs_of(meta)
    assert [n.tolist() for n in nuclei_of(meta)] == [[token] for token in tokens]
    assert values == [0.0] * len(tokens)  # renormalized over the nucleus, as SGLang's replay


def test_flat_base64_carries_the_same_nuclei(http, replayed):
    body, result, _ = replayed
    flat = generate(http, **body, return_flat_raw_output_top_logprobs=True, return_flat_raw_top_logprobs_b64=True)
    assert "top_p_token_ids" not in flat["meta_info"]
    assert flat["output_ids"] == result["output_ids"]
    for got, want in zip(nuclei_of(flat["meta_info"]), nuclei_of(result["meta_info"])):
        np.testing.assert_array_equal(got, want)


def test_a_stream_sends_the_nuclei_so_far_in_each_event(http, replayed):
    """JSON lists are SGLang's cumulative fields: each event holds the nuclei of the output so far (offsets:
    tokens so far + 1, what slime's streaming rollout checks), the last one all of them."""
    body, result, _ = replayed
    events = stream_events(http, **body)
    for event in events:
        assert len(event["meta_info"]["top_p_token_offsets"]) == len(event["output_ids"]) + 1
    assert events[-1]["output_ids"] == result["output_ids"]
    assert events[-1]["meta_info"]["top_p_token_ids"] == result["meta_info"]["top_p_token_ids"]
    assert events[-1]["meta_info"]["top_p_token_offsets"] == result["meta_info"]["top_p_token_offsets"]


def test_a_base64_stream_sends_each_events_own_nuclei(http, replayed):
    body, result, _ = replayed
    events = stream_events(http, **body, return_flat_raw_output_top_logprobs=True,
                           return_flat_raw_top_logprobs_b64=True)
    joined, start = [], 0
    for event in events:
        meta = event["meta_info"]
        assert meta["top_p_token_start"] == start
        joined += nuclei_of(meta)
        start = len(joined)
    want = nuclei_of(result["meta_info"])
    assert len(joined) == len(want) and all(np.array_equal(a, b) for a, b in zip(joined, want))


def test_grpc_and_packed_http_carry_the_nuclei_as_raw_arrays(stack, replayed):
    body, result, _ = replayed
    want = nuclei_of(result["meta_info"])
    options = dict(input_ids=body["input_ids"], max_new_tokens=SAMPLED["max_new_tokens"], temperature=TEMPERATURE,
                   top_p=SAMPLED["top_p"], seed=SAMPLED["seed"], ignore_eos=True, return_top_p_token_ids=True,
                   top_logprobs_num=5)
    with FlatwireClient(stack.grpc_address) as client:
        whole = client.generate(**options)
        stream = client.stream(**options)
        chunks = list(stream)
    with HttpClient(stack.http_url) as http_client:
        packed = http_client.generate(**options)
    for got in (whole, stream.result, packed):
        assert got.top_p is not None and got.token_ids.tolist() == result["output_ids"]
        assert [got.top_p.token_ids[got.top_p.offsets[i]:got.top_p.offsets[i + 1]].tolist()
                for i in range(got.top_p.tokens)] == [n.tolist() for n in want]
        np.testing.assert_allclose(got.output.token_logprobs, logprobs_of(result["meta_info"])[0], atol=1e-6)
    assert all(chunk.top_p is not None and chunk.top_p.tokens == len(chunk.token_ids) for chunk in chunks)


def test_openai_routes_return_raw_logprobs_and_nuclei_in_meta_info(openai_client, served_model, stack_reference_model):
    """vLLM's default on the OpenAI routes: the model's own logprobs whatever the temperature; the nuclei in a
    choice's meta_info (base64 on chat, where the flat arrays are base64 by default)."""
    prompt = prompt_ids(5)
    completion = openai_client.completions.create(
        model=served_model, prompt=prompt, max_tokens=6, temperature=TEMPERATURE, top_p=0.9, seed=3, logprobs=1,
        extra_body={"ignore_eos": True, "custom_params": {"return_top_p_token_ids": True}, "return_meta_info": True,
                    "return_token_ids": True})
    choice = completion.choices[0]
    tokens = choice.token_ids
    logits = reference_logits(stack_reference_model, prompt, tokens)
    unscaled = log_softmax(logits)
    for i, value in enumerate(choice.logprobs.token_logprobs):
        assert value == pytest.approx(unscaled[i, tokens[i]], abs=LOGPROB_TOL)
    check_nuclei(nuclei_of(choice.meta_info), tokens, logits, top_p=0.9)
    chat = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=TEMPERATURE,
        top_p=0.9, extra_body={"custom_params": {"return_top_p_token_ids": True}, "return_meta_info": True})
    meta = chat.choices[0].meta_info
    assert "top_p_token_ids_b64" in meta and len(nuclei_of(meta)) == chat.usage.completion_tokens


@pytest.mark.parametrize("endpoint, body, param", [
    ("/generate", {"text": "Hi", "sampling_params": {"custom_params": {"return_top_p_token_ids": True,
                                                                      "penalty": 2}}},
     "sampling_params.custom_params"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, **REPLAY}},
     "sampling_params.custom_params.return_top_p_token_ids"),
    ("/generate", {"input_ids": [[1, 2], [3, 4]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2,
                                                                                             **REPLAY}]},
     "sampling_params[1].custom_params.return_top_p_token_ids"),
    ("/v1/completions", {"model": SERVED, "prompt": "Hi", "top_p": 0.9, **REPLAY},
     "custom_params.return_top_p_token_ids"),
    ("/v1/completions", {"model": SERVED, "prompt": "Hi", "return_meta_info": True, **REPLAY},
     "custom_params.return_top_p_token_ids"),
])
def test_refusals_name_the_field(send, endpoint, body, param):
    """A custom_params key other than return_top_p_token_ids (a custom logit processor's: none runs here), replay
    of a draw that cuts nothing (the nucleus would be the whole vocabulary), replay outside meta_info."""
    response = send(endpoint, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"] if "error" in response.json() else response.json()
    assert param in response.text, error
    if "penalty" in str(body):
        assert "penalty" in response.text


@pytest.fixture(scope="module")
def original_logprob_gateway(session_stack, stack):
    """A second gateway on the session's scheduler, started as a trainer starts SGLang for a strict comparison:
    SGLANG_RETURN_ORIGINAL_LOGPROB=1."""
    gateway = session_stack.add("gateway", env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})
    session_stack.start(gateway.name)
    yield gateway
    session_stack.stop(gateway.name)


def test_sglangs_original_logprob_switch_returns_the_models_own(http, original_logprob_gateway):
    body = {"input_ids": prompt_ids(6), "sampling_params": SAMPLED, "return_logprob": True}
    original = generate(original_logprob_gateway.http_url, **body)["meta_info"]
    raw = generate(http, **body, logprobs_mode="raw_logprobs")["meta_info"]
    scaled = generate(original_logprob_gateway.http_url, **body, logprobs_mode="sglang_logprobs")["meta_info"]
    assert original["output_token_logprobs"] == raw["output_token_logprobs"]
    assert original["output_token_logprobs"] != scaled["output_token_logprobs"]
