"""A burst right after the scheduler came back. Its batches of submits start on the gateway's blocking channel to
the scheduler (flatwire_wire.submit_batch), a connection of its own that the outage broke too: the burst must be
served as soon as the gateway says it is healthy again, not refused while that channel waits to reconnect."""

import pytest
from flatwire_wire.submit_batch import SEND_AT

from harness.http import post
from harness.stack import running

pytestmark = pytest.mark.slow  # runs services as processes of its own

PROMPTS = [[1000 + i, 1001, 1002, 1003] for i in range(2 * SEND_AT + 3)]  # two batches of SEND_AT and the rest


def burst(url: str) -> list[int]:
    """One /generate batch of every prompt (its submits are made in one turn of the gateway's loop): the
    status, and each result's completion_tokens when it is 200."""
    reply = post(url, "/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    if reply.status_code != 200:
        return [reply.status_code]
    return [200] + [result["meta_info"]["completion_tokens"] for result in reply.json()]


def test_a_burst_after_the_scheduler_restarts_is_served(small_model_dir, log_dir):
    with running(small_model_dir, log_dir, scheduler_args=("--engine", "synthetic", "--step-ms", "2"),
                 gateway_args=("--health-interval-s", "0.2")) as stack:
        stack.wait_ready()
        url = stack.services["gateway"].http_url
        assert burst(url) == [200] + [2] * len(PROMPTS)
        stack.kill("scheduler")
        assert burst(url) == [503]  # refused while it is down, the blocking channel's connection lost with it
        stack.start("scheduler")  # on the same port
        stack.wait_ready()
        assert burst(url) == [200] + [2] * len(PROMPTS)
