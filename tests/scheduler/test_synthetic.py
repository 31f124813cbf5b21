"""--engine synthetic: the whole pipeline without weights, deterministic tokens at --step-ms per step."""

import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from harness.http import generate, stream_events
from harness.stack import Stack, another_gateway, running

pytestmark = pytest.mark.slow  # runs services as processes of its own

STEP_MS = 5
PROMPT = "Capacity planning without a GPU"


@pytest.fixture(scope="module")
def synthetic(small_model_dir, log_dir) -> Iterator[Stack]:
    """A synthetic scheduler, a detokenizer following it, and a gateway."""
    with running(small_model_dir, log_dir, scheduler_args=("--engine", "synthetic", "--step-ms", str(STEP_MS),
                                                     "--max-running-requests", "8")) as stack:
        yield stack


@pytest.fixture(scope="module")
def http(synthetic):
    with httpx.Client(base_url=synthetic.http_url, timeout=60) as client:
        yield client


def test_runs_to_max_new_tokens_with_sorted_top_logprobs(http):
    start = time.perf_counter()
    body = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 20}, return_logprob=True, top_logprobs_num=8)
    elapsed = time.perf_counter() - start
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 20 and len(body["output_ids"]) == 20
    assert meta["finish_reason"]["type"] == "length"  # never an eos
    assert body["text"].strip()
    top = meta["output_top_logprobs"]
    assert len(top) == 20 and all(len(row) == 8 for row in top)
    values = np.array([[entry[0] for entry in row] for row in top])
    assert (np.diff(values, axis=1) < 0).all()  # best first
    assert [row[0][1] for row in top] == body["output_ids"]  # the chosen token is the best one
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == values[:, 0].tolist()
    assert elapsed >= 20 * STEP_MS / 1e3  # one token per step, each step --step-ms


def test_identical_requests_give_identical_output(http):
    request = dict(sampling_params={"max_new_tokens": 12, "temperature": 1.0}, return_logprob=True,
                   top_logprobs_num=3, logprob_start_len=0)
    first, second = generate(http, text=PROMPT, **request), generate(http, text=PROMPT, **request)
    assert first["output_ids"] == second["output_ids"] and first["text"] == second["text"]
    assert first["meta_info"]["output_top_logprobs"] == second["meta_info"]["output_top_logprobs"]
    assert first["meta_info"]["input_top_logprobs"] == second["meta_info"]["input_top_logprobs"]
    seeded = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 12, "seed": 3})
    assert seeded["output_ids"] != first["output_ids"]  # the seed picks another place in the table


def test_model_info_is_the_checkpoints(http, small_model_dir):
    config = json.loads((small_model_dir / "config.json").read_text())
    info = http.get("/server_info").json()
    assert info["vocab_size"] == config["vocab_size"]
    assert info["eos_token_ids"] == config["eos_token_id"]
    assert info["device"] == "cpu" and info["dtype"] == "float32"


def test_stream_interval_sends_fewer_larger_chunks_with_the_same_result(http, synthetic):
    """--stream-interval 5 (SGLang's): a streaming request ships 5 tokens per message; the events carry the
    same cumulative text and ids, and end where the request without streaming ends. (Per token, from a gateway
    that never coalesces: on a busy host the shared one may fall behind and merge messages.)"""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 23}}
    whole = generate(http, **body)
    with another_gateway(synthetic, "--stream-coalesce-ms", "0") as uncoalesced_http:
        per_token = stream_events(uncoalesced_http, **body)
    with another_gateway(synthetic, "--stream-interval", "5") as coarse_http:
        coarse = stream_events(coarse_http, **body)
    for events in (per_token, coarse):
        assert events[-1]["output_ids"] == whole["output_ids"] and events[-1]["text"] == whole["text"]
    sizes = [len(event["output_ids"]) for event in coarse]
    # 5 tokens per message, then what is left when the request ends (an event carries what arrived since the
    # previous one: two messages can share one when the client reads late)
    assert all(size % 5 == 0 for size in sizes[:-1]) and sizes[-1] == 23 and len(sizes) <= 5
    assert len(per_token) >= 12  # a message per token: many more, smaller events


def test_incremental_streaming_output_sends_only_what_is_new(http, synthetic):
    """--incremental-streaming-output (SGLang's): text, output_ids and the output logprob lists of each event
    are that event's only; joined, they are the response without streaming."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 17},
            "return_logprob": True, "top_logprobs_num": 3}
    whole = generate(http, **body)
    with another_gateway(synthetic, "--incremental-streaming-output") as incremental_http:
        events = stream_events(incremental_http, **body)
    assert "".join(event["text"] for event in events) == whole["text"]
    assert [i for event in events for i in event["output_ids"]] == whole["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        joined = [row for event in events for row in event["meta_info"].get(key, [])]
        assert joined == whole["meta_info"][key], key
    # The counts stay cumulative, as SGLang's: what the request produced so far.
    so_far = 0
    for event in events:
        so_far += len(event["output_ids"])
        assert event["meta_info"]["completion_tokens"] == event["meta_info"]["output_token_logprobs_length"] == so_far
    assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert whole["meta_info"]["output_token_logprobs_length"] == len(whole["output_ids"])
