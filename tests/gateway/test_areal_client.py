"""AReaL's RemoteSGLangEngine against a live flatwire (issue 49): its /generate (image_data [] with every prompt) and
its rollout cycle with a request in flight (pause, update from disk, continue, the aborted request sent again with
its output so far), as its source sends them (tests/gateway/areal_calls.py); and, where the `areal` package is
importable, the unmodified engine itself."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harness.http import generate, post
from tests.gateway.areal_calls import CONTINUE, HEALTH, PAUSE, GenerationHyperparameters, agenerate, disk_update

PROMPT = np.random.default_rng(49).integers(0, 240_000, 12).tolist()


def greedy(http, new_tokens: int) -> dict:
    return generate(http, input_ids=PROMPT, return_logprob=True,
                    sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})


def test_a_generate_as_areal_sends_it(stack, http):
    """image_data [] is no image; the tokens and logprobs are what /generate gives without it."""
    done = agenerate(stack.http_url, PROMPT, GenerationHyperparameters(max_new_tokens=8, greedy=True))
    assert done.stop_reason == "length" and len(done.responses) == 1
    reference = greedy(http, 8)
    assert done.tokens == reference["output_ids"]
    assert done.logprobs == [entry[0] for entry in reference["meta_info"]["output_token_logprobs"]]
    sampled = agenerate(stack.http_url, PROMPT, GenerationHyperparameters(max_new_tokens=8))  # AReaL's defaults
    assert len(sampled.tokens) == 8 and np.isfinite(sampled.logprobs).all()


def test_pause_update_continue_with_a_request_in_flight(stack, http, model_dir):
    """The rollout pauses (its client stops sending) and pauses generation: the running request comes back
    aborted with the tokens it has; the weights are updated from disk (the same checkpoint here) and generation
    continues; the rollout sends the request again with its output so far, and the whole is what one
    uninterrupted greedy generation gives."""
    assert http.get(HEALTH).status_code == 200  # RemoteInfEngine._wait_for_server
    new_tokens = 160
    paused = threading.Event()
    gconfig = GenerationHyperparameters(max_new_tokens=new_tokens, greedy=True, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        rollout = pool.submit(agenerate, stack.http_url, PROMPT, gconfig, paused.is_set)
        deadline = time.monotonic() + 60
        while not stack.stats().running:
            assert time.monotonic() < deadline and not rollout.done(), "the request never ran"
            time.sleep(0.01)
        paused.set()  # rollout.pause(): WorkflowExecutor's flag
        try:
            answers = [post(http, path, body) for path, body in (PAUSE, disk_update(str(model_dir)), CONTINUE)]
        finally:
            paused.clear()  # rollout.resume()
        assert [answer.status_code for answer in answers] == [200] * 3, [answer.text for answer in answers]
        assert answers[1].json()["success"]
        done = rollout.result(timeout=300)
    first = done.responses[0]["meta_info"]
    assert first["finish_reason"]["type"] == "abort" and 0 < first["completion_tokens"] < new_tokens, first
    assert len(done.responses) == 2 and done.stop_reason == "length" and len(done.tokens) == new_tokens
    reference = greedy(http, new_tokens)
    assert done.tokens == reference["output_ids"]
    np.testing.assert_allclose(done.logprobs, [entry[0] for entry in reference["meta_info"]["output_token_logprobs"]],
                               atol=2e-3)


def test_the_unmodified_remote_sglang_engine(stack, http, model_dir):
    """AReaL's own RemoteSGLangEngine, where `areal` is importable (see areal_calls.py; README, "RL frameworks"):
    it finds the server healthy and generates (image_data []); a request in flight across its pause, a disk
    update (its request, sent here: AReaL sends it once its trainer has saved the checkpoint) and its continue
    comes back whole, the greedy output of one uninterrupted generation."""
    sglang_remote = pytest.importorskip("areal.engine.sglang_remote")
    from areal.api.cli_args import GenerationHyperparameters as AReaLGeneration
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import ModelRequest

    engine = sglang_remote.RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1", setup_timeout=60,
                                                                    request_timeout=120))
    engine.initialize(addr=stack.http_url.removeprefix("http://"))
    try:
        request = ModelRequest(input_ids=PROMPT, gconfig=AReaLGeneration(max_new_tokens=8, greedy=True))
        assert request.image_data == []
        response = asyncio.run(engine.agenerate(request))
        assert response.output_tokens == greedy(http, 8)["output_ids"]

        new_tokens = 160
        request = ModelRequest(input_ids=PROMPT, gconfig=AReaLGeneration(max_new_tokens=new_tokens, greedy=True,
                                                                          ignore_eos=True))
        aborted = stack.stats().aborted
        with ThreadPoolExecutor(1) as pool:
            rollout = pool.submit(asyncio.run, engine.agenerate(request))
            deadline = time.monotonic() + 60
            while not stack.stats().running:
                assert time.monotonic() < deadline and not rollout.done(), "the request never ran"
                time.sleep(0.01)
            engine.pause()
            try:
                engine.pause_generation()
                update = post(http, *disk_update(str(model_dir)))
                engine.continue_generation()
            finally:
                engine.resume()
            assert update.status_code == 200 and update.json()["success"], update.text
            response = rollout.result(timeout=300)
        assert stack.stats().aborted == aborted + 1  # the pause ended it; AReaL sent it again
        assert response.stop_reason == "length"
        assert response.output_tokens == greedy(http, new_tokens)["output_ids"]
    finally:
        engine.destroy()
