"""The hop timeout counts from the moment a hop is lost, not from the gateway's last health round.

The gateway here checks its schedulers' paths only once a minute, so only what the gateway learns
from the broken stream itself can act in time: a detokenizer that goes away takes its schedulers
out of rotation at once, the in-flight requests fail one hop timeout after it went (not at the next
round), and one that comes back within the hop timeout loses nothing, however long ago the last
round was.
"""

import time

import pytest
from transformers import AutoTokenizer

from harness.faults import SCHEDULER_ARGS, run_scenario
from harness.stack import Stack

pytestmark = pytest.mark.slow  # runs services as processes of its own

REQUESTS = 8
TOKENS = 200
HOP_TIMEOUT_S = 8.0
# Kill to failure: the hop timeout, then up to one pass of the gateway's expiry loop (0.25 s) and the client's
# read of the error, on a host the other test process may keep busy.
FAILS_WITHIN_S = HOP_TIMEOUT_S + 1.5


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    gateway_args = ("--health-interval-s", "60", "--hop-timeout-s", str(HOP_TIMEOUT_S))
    with Stack(model_dir, log_dir, scheduler_args=SCHEDULER_ARGS, gateway_args=gateway_args) as stack:
        # The gateway last, so that its first check finds the path whole rather than waiting a round for it.
        stack.start("scheduler", "detokenizer")
        stack.start("gateway")
        yield stack


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_a_detokenizer_gone_fails_its_requests_one_hop_timeout_later(stack, tokenizer):
    result = run_scenario(stack, "detokenizer killed for good", REQUESTS, TOKENS, tokenizer)
    assert result.counts["failed explicitly"] == REQUESTS, result
    assert all(HOP_TIMEOUT_S - 0.5 < seconds < FAILS_WITHIN_S for seconds in result.fail_times), result
    admission = result.admission
    assert admission.status == 503 and admission.seconds < 2, admission
    assert admission.health_status == 503 and not admission.health["healthy"], admission


def test_a_detokenizer_back_within_the_hop_timeout_loses_nothing_long_after_a_health_round(stack, tokenizer):
    # The last round was when the detokenizer came back at the end of the test above (its stream coming up
    # triggers one); the next is a minute later. Past a hop timeout from that round, a path found broken
    # would count as broken for that long already if the count started at the round.
    time.sleep(HOP_TIMEOUT_S + 1)
    result = run_scenario(stack, "detokenizer killed and restarted", REQUESTS, TOKENS, tokenizer)
    assert result.counts["identical"] == REQUESTS, result
