"""--stream-coalesce-ms: a gateway whose event loop is behind (more streams than it renders an event per token
for) sends fewer events, each with several steps' tokens, and every stream still ends whole and the same."""

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest

from harness.stack import Stack, another_gateway, running

pytestmark = pytest.mark.slow  # runs services as processes of its own

STREAMS, TOKENS = 192, 48  # at 1 ms steps: up to 192,000 tokens/s offered, far more than a gateway renders one by one


@pytest.fixture(scope="module")
def loaded(small_model_dir, log_dir) -> Iterator[Stack]:
    """A synthetic scheduler at 1 ms steps running every stream at once, and a gateway that never coalesces."""
    with running(small_model_dir, log_dir, scheduler_args=("--engine", "synthetic", "--step-ms", "1",
                                                     "--max-running-requests", str(STREAMS)),
                 gateway_args=("--stream-coalesce-ms", "0")) as stack:
        yield stack


async def _stream_all(url: str) -> list[list[dict]]:
    """Every stream's events (SGLang's cumulative /generate events), all streams running together."""
    limits = httpx.Limits(max_connections=STREAMS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def one(i: int) -> list[dict]:
            body = {"input_ids": [1000 + i, 1001, 1002], "stream": True,
                    "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}
            async with client.stream("POST", "/generate", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            return [orjson.loads(line[len("data: "):]) for line in lines[:-1]]

        return await asyncio.gather(*(one(i) for i in range(STREAMS)))


def _tokens_per_event(streams: list[list[dict]]) -> float:
    return STREAMS * TOKENS / sum(len(events) for events in streams)


def test_a_gateway_behind_sends_fewer_larger_events_with_the_same_outputs(loaded):
    one_by_one = asyncio.run(_stream_all(loaded.http_url))
    with another_gateway(loaded, "--stream-coalesce-ms", "50") as coalescing:
        coalesced = asyncio.run(_stream_all(str(coalescing.base_url)))
    for events in one_by_one + coalesced:
        ids = [event["output_ids"] for event in events]
        assert all(later[:len(earlier)] == earlier for earlier, later in zip(ids, ids[1:]))  # each extends the last
        assert len(ids[-1]) == events[-1]["meta_info"]["completion_tokens"] == TOKENS
    assert [events[-1]["output_ids"] for events in coalesced] == [events[-1]["output_ids"] for events in one_by_one]
    assert [events[-1]["text"] for events in coalesced] == [events[-1]["text"] for events in one_by_one]
    print(_tokens_per_event(one_by_one), _tokens_per_event(coalesced))
    assert _tokens_per_event(coalesced) > 2 * _tokens_per_event(one_by_one)
