"""A step subscriber killed while the scheduler is writing to it: the scheduler logs one line, not grpc's
traceback at ERROR (its write is its own, so the broken connection is its to report), and keeps serving."""

import signal
import subprocess
import sys
import time

import pytest
from flatwire_wire.scheduler import LogprobParams, SamplingParams

from harness.procs import ROOT, start_service
from harness.scheduler_client import SchedulerClient

pytestmark = pytest.mark.slow  # runs a scheduler and a subscriber as processes


def test_a_subscriber_killed_mid_write_is_one_line(model_dir, tmp_path):
    scheduler, address = start_service("scheduler", [
        "--model", str(model_dir), "--engine", "synthetic", "--step-ms", "2", "--max-running-requests", "64",
        "--max-subscriber-backlog", "4", "--stall-timeout-s", "1"], tmp_path)
    try:
        client = SchedulerClient(address)
        stalled = subprocess.Popen([sys.executable, "-m", "harness.stalled_subscriber", address], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert stalled.stdout.readline().strip() == "subscribed"
            rids = [client.submit(input_ids=list(range(1000, 1016)),
                                  sampling=SamplingParams(max_new_tokens=2000, ignore_eos=True),
                                  logprob=LogprobParams(return_logprob=True, top_logprobs_num=64))
                    for _ in range(32)]
            time.sleep(3)  # its windows fill: the scheduler's write to it waits
        finally:
            stalled.send_signal(signal.SIGKILL)
            stalled.wait()
        deadline = time.monotonic() + 20
        while "broke while a step was written to it" not in scheduler.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        after = client.submit(input_ids=list(range(1000, 1016)), sampling=SamplingParams(max_new_tokens=4))
        assert len(client.wait(after, timeout=60).token_ids) == 4  # still serving the subscriber that reads
        assert all(not client.requests[rid].done.is_set() for rid in rids)  # and the long ones run on
        client.close()
    finally:
        scheduler.stop()
    log = scheduler.log()
    assert "a step subscriber's stream broke while a step was written to it" in log
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
