"""Back-pressure: a consumer that does not keep up slows what is sent to it, within a bound.

A synthetic scheduler (1 ms steps, 8 requests x 2000 tokens of top-256 rows: 33 MB, more
than gRPC's flow-control windows absorb before a writer blocks) and a subscriber that
stops reading. The engine waits for it between steps (its queue is over
--max-subscriber-backlog) and, once it has stayed behind for --stall-timeout-s, its
stream ends with UNAVAILABLE (it would resubscribe and be replayed what it missed) and
the engine goes on. The detokenizer does the same for a gateway that stops reading.
"""

import time

import grpc
import pytest
from flatwire_wire.control import EMPTY
from flatwire_wire.detokenizer import DETOKENIZER, StreamOutputsRequest
from flatwire_wire.scheduler import SCHEDULER, LogprobParams, SamplingParams

from harness.scheduler_client import SchedulerClient
from services.common.rpc import message_options

STALL_S = 2.0
REQUESTS, TOKENS = 8, 2000


@pytest.fixture(scope="module")
def scheduler(start_service):
    _, address = start_service("scheduler", "--engine", "synthetic", "--step-ms", "1", "--max-running-requests",
                               str(REQUESTS), "--max-subscriber-backlog", "8", "--stall-timeout-s", str(STALL_S))
    return address


def _submit_all(client: SchedulerClient, owner: str | None = None) -> list[str]:
    logprob = LogprobParams(return_logprob=True, top_logprobs_num=256, logprob_start_len=-1)
    sampling = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
    return [client.submit(input_ids=[1, 2, 3], sampling=sampling, logprob=logprob, owner=owner)
            for _ in range(REQUESTS)]


def test_the_scheduler_waits_for_a_slow_subscriber_then_cuts_it(scheduler):
    channel = grpc.insecure_channel(scheduler, options=message_options(256))
    idle = SCHEDULER.calls(channel)["StreamSteps"](EMPTY)
    idle.initial_metadata()  # registered; from now on it reads nothing
    client = SchedulerClient(scheduler)
    try:
        started = time.monotonic()
        rids = _submit_all(client)
        for rid in rids:
            assert client.wait(rid, timeout=60).finish.output_tokens == TOKENS
        elapsed = time.monotonic() - started
        # Without the idle subscriber the 2000 steps take about 2.5 s; the engine held back for it first.
        assert elapsed >= STALL_S
        with pytest.raises(grpc.RpcError) as cut:
            for _ in idle:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "resubscribe" in cut.value.details()
    finally:
        client.close()
        channel.close()


def test_the_detokenizer_stops_reading_for_a_slow_gateway_then_cuts_it(scheduler, start_service):
    _, detokenizer = start_service("detokenizer", "--schedulers", scheduler, "--max-outbox-messages", "8",
                                   "--stall-timeout-s", str(STALL_S))
    channel = grpc.insecure_channel(detokenizer, options=message_options(256))
    idle = DETOKENIZER.calls(channel)["StreamOutputs"](
        StreamOutputsRequest(owner="gw-idle"))
    idle.initial_metadata()
    client = SchedulerClient(scheduler)
    try:
        started = time.monotonic()
        rids = _submit_all(client, owner="gw-idle")
        for rid in rids:  # the scheduler's own subscriber (this client) sees them all finish...
            client.wait(rid, timeout=60)
        # ...only after the detokenizer, stuck behind the idle gateway, gave up on it and read on.
        assert time.monotonic() - started >= STALL_S
        received = list(idle)  # what it had queued before the cut, then the stream ends
        assert sum(len(message.rids) for message in received) < REQUESTS * TOKENS
    finally:
        client.close()
        channel.close()
