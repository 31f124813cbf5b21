"""The fuzz harness (harness/fuzz.py) in small: the whole hostile HTTP corpus, a few schema-drawn bodies
per endpoint and raw gRPC bytes per service, beside a good request. No 5xx or UNKNOWN, no hang, no
crash, and the good request never fails or changes; `python -m bench.fuzz` runs the full counts."""

import pytest

from harness import fuzz
from harness.faults import SCHEDULER_ARGS
from harness.stack import running

pytestmark = pytest.mark.slow  # runs services as processes of its own

CASES = 20


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    with running(model_dir, log_dir, scheduler_args=SCHEDULER_ARGS) as stack:
        yield stack


def test_bad_input_never_fails_the_server_or_a_good_request(stack):
    rows = fuzz.run(stack, CASES)
    print("\n" + fuzz.table(rows))
    for tally, verdict in rows:
        for outcome in ("5xx or UNKNOWN", "hung", "crashed"):
            assert tally.counts[outcome] == 0, (tally.name, outcome, tally.examples)
        assert verdict.startswith("yes"), (tally.name, verdict)
    corpus = rows[0][0]
    assert sum(corpus.counts.values()) >= 100 and corpus.counts["refused naming the field"] > 100
