"""A step that raises fails the requests of that step, named with its cause, and the scheduler serves on: in process
(the failure raised as a step launches, or as its results are waited for; on the small vocabulary: tests/conftest.py
small_model_dir), and through the real services, where
the client gets HTTP 500 (gRPC INTERNAL) rather than a scheduler-gone 503, and the next request is served."""

import os
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from flatwire_client import FlatwireClient
from flatwire_wire.steps import FinishReason
from transformers import AutoModelForCausalLM

from harness.stack import running
from tests.scheduler.engine_run import Run, check, prompt

MARKED = 4000  # a token id (of the small vocabulary too): a step that holds it raises
FAULTY_STEP = Path(__file__).parent / "faulty_step"  # its sitecustomize.py makes a scheduler's model raise on it


class Raised(RuntimeError):
    pass


def faulty(run: Run, when: str) -> None:
    """The run's model raises in any step that holds MARKED: as the step launches, or when its result is read."""
    forward, launch = run.runner.forward, run.runner.launch

    def faulty_forward(batch, input_ids, positions):
        if MARKED in input_ids:
            raise Raised("the marked token")
        return forward(batch, input_ids, positions)

    def faulty_launch(batch):
        launched = launch(batch)
        if any(MARKED in row.request.input_ids for row in batch.rows):
            read = launched.result

            def result():
                read()
                raise Raised("the marked token, found late")
            launched.result = result
        return launched

    if when == "launch":
        run.runner.forward = faulty_forward
    else:
        run.runner.launch = faulty_launch


@pytest.mark.parametrize("when,overlap", [("launch", False), ("result", False), ("result", True)])
def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(small_model_dir, when, overlap):
    run = Run(small_model_dir, own_runner=True, enable_overlap_schedule=overlap)
    faulty(run, when)
    marked, other = [MARKED, *prompt(1, 6)], prompt(2, 9)
    run.submit("marked", marked, 4)
    run.submit("other", other, 4)  # admitted with it: the same step
    run.run()
    for rid in ("marked", "other"):
        finish = run.finish(rid)
        assert finish.reason is FinishReason.ERROR and finish.step_failed, finish
        assert finish.message.startswith("scheduler step failed: Raised: the marked token"), finish.message
    assert run.engine.failure is None
    reference = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32).eval()
    later = prompt(3, 9)
    run.submit("later", later, 6)
    run.run()
    check(reference, later, 6, run.result("later"))  # served, on pages the failed step wrote into
    kv = run.engine.kv
    assert kv.pages.free + kv.pages.evictable == kv.pages.usable  # no page kept by a failed request


@pytest.fixture(scope="module")
def stack(model_dir, log_dir):
    path = os.pathsep.join([str(FAULTY_STEP), os.environ.get("PYTHONPATH", "")])
    with running(model_dir, log_dir, scheduler_env={"PYTHONPATH": path,
                                                    "FLATWIRE_TEST_FAULT_TOKEN": str(MARKED)}) as stack:
        stack.wait_ready()
        yield stack


@pytest.mark.slow
def test_the_client_gets_500_naming_the_cause_and_the_next_request_is_served(stack):
    body = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        failed = http.post("/generate", json={"input_ids": [MARKED, 11, 12], **body})
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["message"] == f"scheduler step failed: RuntimeError: token {MARKED} is marked to fail"
        assert error["type"] == "InternalServerError"
        served = http.post("/generate", json={"input_ids": [10, 11, 12], **body})
        assert served.status_code == 200 and served.json()["meta_info"]["completion_tokens"] == 4
    with FlatwireClient(stack.grpc_address) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(input_ids=[MARKED, 11, 12], max_new_tokens=4)
        assert refused.value.code() is grpc.StatusCode.INTERNAL
        assert f"token {MARKED} is marked to fail" in refused.value.details()
    assert stack.procs["scheduler"].proc.poll() is None
    assert stack.procs["scheduler"].log().count(f"token {MARKED} is marked to fail") == 2  # once a failed step
