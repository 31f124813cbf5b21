"""Big batches: up to max_batch_size sub-requests per HTTP request all complete (the gateway bounds
the Submits in flight, so the scheduler's gRPC server cancels none), one more is a 400 naming the
field, and when one submit fails every other task's outcome is still retrieved."""

import asyncio
import contextlib
import gc
import time

import httpx
import pytest
from flatwire_wire.steps import FinishReason

from services.gateway.config import GatewayConfig
from services.gateway.engine_client import RequestError
from services.gateway.http import streams
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol.intake import GenerateInput
from services.gateway.reply import Ending, Output, Reply

MAX_BATCH_SIZE = GatewayConfig().max_batch_size


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert str(MAX_BATCH_SIZE) in error["message"] and "max_batch_size" in error["message"]
    return error["message"]


def test_a_batch_at_the_limit_completes(stack, http):
    # One token each: the first chunk of every generation is its last. 4096 prompts through a
    # scheduler with 16 slots is 256 steps, about 20 s on a 2-core CPU.
    prompts = [f"w{i}" for i in range(MAX_BATCH_SIZE)]
    started = time.perf_counter()
    response = http.post("/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 1}})
    elapsed = time.perf_counter() - started
    print(f"{MAX_BATCH_SIZE} prompts in {elapsed:.1f} s")
    assert response.status_code == 200, response.text[:500]
    body = response.json()
    assert len(body) == MAX_BATCH_SIZE
    short = [item for item in body if len(item["output_ids"]) != 1]
    assert not short, short[:3]
    assert all(item["meta_info"]["finish_reason"]["type"] in ("length", "stop") for item in body)
    assert len({item["meta_info"]["id"] for item in body}) == MAX_BATCH_SIZE
    log = stack.procs["gateway"].log()
    assert "never retrieved" not in log
    assert "CANCELLED" not in log


def test_one_more_than_the_limit_is_refused(http, model):
    over = MAX_BATCH_SIZE + 1
    message = _error(http.post("/generate", json={"text": ["a"] * over}), "text")
    assert f"{over} prompts" in message
    _error(http.post("/generate", json={"input_ids": [[1, 2]] * over}), "input_ids")
    # completions: prompts x n sub-requests; n names the error when it multiplies the prompts
    _error(http.post("/v1/completions", json={"model": model, "prompt": ["a"] * over, "max_tokens": 1}), "prompt")
    prompts = MAX_BATCH_SIZE // 128 + 1
    message = _error(http.post("/v1/completions", json={"model": model, "prompt": ["a"] * prompts, "n": 128,
                                                       "max_tokens": 1}), "n")
    assert f"{prompts * 128} sub-requests" in message
    assert http.get("/health").status_code == 200


# -- Generations.start against a fake pipeline: a failure among many ---------------------------------------


class FakeEngine:
    """generate(): a submit, then one chunk that is also the result. input_ids = [mark, index]; mark -1:
    the submit fails, -2: the first chunk comes late."""

    def __init__(self):
        self.in_flight = 0  # generations started and waiting for their first chunk
        self.most_in_flight = 0
        self.started: list[int] = []
        self.closed: list[int] = []

    @contextlib.contextmanager
    def admit(self, count: int):  # admission control: always room here
        yield None

    async def generate(self, inp: GenerateInput, admission=None):
        mark, index = inp.input_ids
        self.started.append(index)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        waiting = True
        try:
            await asyncio.sleep(0.001)
            if mark == -1:
                raise RequestError("unavailable", None, f"submit {index} failed")
            await asyncio.sleep(0.01 if mark == -2 else 0)
            self.in_flight -= 1
            waiting = False
            yield Reply(rid=str(index), prompt_tokens=2, new=Output(token_ids=[7], text="x"), completion_tokens=1,
                        weight_versions=[], e2e_latency=0.01, ending=Ending(FinishReason.LENGTH))
        finally:
            self.in_flight -= waiting
            self.closed.append(index)


def _inputs(marks: list[int]) -> list[GenerateInput]:
    return [GenerateInput(input_ids=[mark, i], sampling=None, logprob=None, detokenize=None)
            for i, mark in enumerate(marks)]


def _run(coro):
    """Run coro to its result, or to its exception's message; and what the loop's exception handler
    was told ("Task exception was never retrieved", ...) once everything it made is collected."""
    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        try:
            outcome = await coro
        except RequestError as exc:
            outcome = exc.message  # not the exception: its traceback would keep the tasks alive
        gc.collect()
        await asyncio.sleep(0.05)
        return outcome

    outcome = asyncio.run(main())
    gc.collect()
    return outcome, reported


def test_a_failed_submit_leaves_no_exception_unretrieved():
    pipeline = FakeEngine()
    count = 1500
    marks = [-2] * count  # slow
    marks[5] = marks[9] = marks[17] = -1  # three submits fail
    outcome, reported = _run(streams.Generations.start(pipeline, _inputs(marks), GatewayMetrics(), "/t", 0.0))
    assert outcome == "submit 5 failed"
    assert not reported, [c.get("message") for c in reported]
    # Every one that started was closed.
    assert sorted(pipeline.closed) == sorted(pipeline.started)
    assert pipeline.in_flight == 0
