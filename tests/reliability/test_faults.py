"""Fault semantics: each hop killed, stopped or restarted under load (see docs/reliability.md).

The services run as separate processes, as compose runs them. Every scenario puts
16 requests in flight (k=128 flat base64 over HTTP, streaming HTTP, streaming gRPC),
injects the fault, and classifies what each client got (harness/faults.py): equal to
what the scheduler produced bit for bit, or an explicit failure within the hop
timeout. A short "complete" response or a hang fails the test, in every scenario.
"""

import re

import pytest
from transformers import AutoTokenizer

from harness.faults import SCHEDULER_ARGS, run_scenario
from harness.stack import running

pytestmark = pytest.mark.slow  # runs services as processes of its own

REQUESTS = 16
TOKENS = 200
HOP_TIMEOUT_S = 5.0  # the gateway's default
HEALTH_ROUND_S = 3.5  # a failure may come up to one health round (check timeout 2 s, interval 1 s) late
# A stalled scheduler leaves rotation after --health-failure-threshold (3) checks in a row got no answer.
SLOW_OUT_S = 3 * HEALTH_ROUND_S


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    with running(model_dir, log_dir, scheduler_args=SCHEDULER_ARGS) as stack:
        yield stack


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def run(stack, tokenizer, name, fails_within_s=HOP_TIMEOUT_S + HEALTH_ROUND_S):
    result = run_scenario(stack, name, REQUESTS, TOKENS, tokenizer)
    print(f"\n{name}: {dict(result.counts)}; max time to fail "
          f"{max(result.fail_times, default=0):.1f}s; {result.notes}; {result.details}")
    assert result.counts["truncated silently"] == 0, result
    assert result.counts["hung"] == 0, result
    assert result.counts["other"] == 0, result
    assert all(seconds < fails_within_s for seconds in result.fail_times), result
    return result


def test_no_fault_every_request_is_identical(stack, tokenizer):
    assert run(stack, tokenizer, "no fault").counts["identical"] == REQUESTS


def test_detokenizer_restart_loses_nothing_with_the_defaults(stack, tokenizer):
    """The restarted detokenizer (serving about a second after it starts) resumes every request from the
    scheduler's replay, well inside the default hop timeout."""
    assert run(stack, tokenizer, "detokenizer killed and restarted").counts["identical"] == REQUESTS


def test_short_scheduler_stalls_lose_nothing(stack, tokenizer):
    """Stopped three times for 2.5 s under load: merely slow, it stays in rotation, and every request completes."""
    assert run(stack, tokenizer, "scheduler stalls of 2.5s").counts["identical"] == REQUESTS


def test_detokenizer_gone_fails_every_request_explicitly(stack, tokenizer):
    logged = len(stack.procs["gateway"].log())
    result = run(stack, tokenizer, "detokenizer killed for good")
    assert result.counts["failed explicitly"] == REQUESTS
    _refused_at_once(result.admission, "detokenizer")
    # The outage of its output stream, as the gateway logs it: once when it broke, once when it was back (the
    # scenario restarts the detokenizer at its end), not at every retry.
    log = stack.procs["gateway"].log()[logged:]
    assert log.count("retrying until it is back") == 1, log[-3000:]
    assert log.count("stream is back after") <= 1, log[-3000:]  # the restart may be logged later


def test_scheduler_killed_fails_every_request_explicitly(stack, tokenizer):
    logged, detokenizer_logged = len(stack.procs["gateway"].log()), len(stack.procs["detokenizer"].log())
    result = run(stack, tokenizer, "scheduler killed")
    assert result.counts["failed explicitly"] == REQUESTS
    _refused_at_once(result.admission, "not answering")
    # The fault is logged once, with the number of requests it failed, not once per request.
    log = stack.procs["gateway"].log()[logged:]
    assert re.search(rf"{REQUESTS} requests failed \(", log), log[-3000:]
    assert not re.search(r"request [0-9a-f]{32} failed", log), log[-3000:]
    # The detokenizer's lost stream too: one warning for the outage, not one per retry.
    assert stack.procs["detokenizer"].log()[detokenizer_logged:].count("retrying until it is back") == 1


def test_scheduler_terminated_fails_its_requests_at_once(stack, tokenizer):
    """A scheduler told to stop (SIGTERM) fails what it holds in a last step, naming the stop: its clients learn
    it at once, not one hop timeout later as from a crash."""
    result = run(stack, tokenizer, "scheduler terminated", fails_within_s=HOP_TIMEOUT_S - 1)
    assert result.counts["failed explicitly"] == REQUESTS
    assert any("the scheduler was stopped" in detail for detail in result.details), result.details


def _refused_at_once(admission, missing: str):
    """While the hop is down, a new request gets 503 at once, and /health says what is missing."""
    assert admission.status == 503 and admission.seconds < 2, admission
    assert admission.health_status == 503 and not admission.health["healthy"], admission
    assert any(missing in (s["problem"] or "") for s in admission.health["schedulers"].values()), admission


def test_scheduler_stopped_fails_requests_and_leaves_no_orphans(stack, tokenizer):
    result = run(stack, tokenizer, "scheduler stopped 20s", fails_within_s=SLOW_OUT_S + HEALTH_ROUND_S)
    assert result.counts["failed explicitly"] == REQUESTS
    assert not any(note.startswith("ORPHANS") for note in result.notes), result.notes


def test_gateway_killed_its_requests_are_aborted_in_the_scheduler(stack, tokenizer):
    result = run(stack, tokenizer, "gateway killed")
    assert not any(note.startswith("ORPHANS") for note in result.notes), result.notes
