"""Authentication and exposure: the internal secret on every internal method, the gateway's API key on
HTTP and public gRPC, health open, reflection on the public port only, no filesystem path as model name.

One stack for the module: scheduler, detokenizer and gateway sharing an internal secret, the gateway
with an API key, on the small vocabulary's model (tests/conftest.py small_model_dir).
"""

import os
import secrets
import subprocess
import sys
import time
import uuid

import grpc
import httpx
import openai
import pytest
from flatwire_client import FlatwireClient
from flatwire_wire.control import EMPTY
from flatwire_wire.detokenizer import DETOKENIZER, StreamOutputsRequest
from flatwire_wire.rpc import ServiceSpec
from flatwire_wire.scheduler import SCHEDULER, AbortRequest, SamplingParams, SubmitBatchRequest, TokenizedRequest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from harness.procs import ServiceProcess, free_port
from harness.stack import running
from services.common.auth import SECRET_METADATA, load_internal_secret
from services.common.rpc import check_health, message_options

pytestmark = pytest.mark.slow  # runs services as processes of its own

SECRET = f"internal-{secrets.token_hex(8)}"
API_KEY = f"sk-{secrets.token_hex(8)}"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
WRONG = [None, [(SECRET_METADATA, "wrong")], [(SECRET_METADATA, SECRET + "x")], [("authorization", SECRET)]]


@pytest.fixture(scope="module")
def stack(small_model_dir, log_dir):
    # Health is open: the stack waits for each service's without a secret or a key.
    with running(small_model_dir, log_dir, scheduler_args=("--max-running-requests", "8"),
                 env={"FLATWIRE_INTERNAL_SECRET": SECRET}, gateway_env={"FLATWIRE_API_KEY": API_KEY}) as stack:
        yield stack


def unary(address: str, spec: ServiceSpec, method: str, request, metadata=None):
    with grpc.insecure_channel(address, options=message_options(64)) as channel:
        return spec.calls(channel)[method](request, metadata=metadata, timeout=30)


def first_of_stream(address: str, spec: ServiceSpec, method: str, request, metadata=None):
    """Opens a server stream; returns its initial metadata once the server has taken the call."""
    with grpc.insecure_channel(address, options=message_options(64)) as channel:
        stream = spec.calls(channel)[method](request, metadata=metadata, timeout=30)
        try:
            metadata = stream.initial_metadata()
            try:
                # A refusal ends the call right after its headers; a served stream stays open.
                error = stream.exception(timeout=1.0)
            except grpc.FutureTimeoutError:
                return metadata
            if error is not None:
                raise error
            return metadata
        finally:
            stream.cancel()


def code_of(fn, *args, **kwargs) -> grpc.StatusCode:
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def scheduler_calls(owner: str, rid: str):
    """Every Scheduler method: (name, call taking metadata)."""
    request = TokenizedRequest(rid=rid, owner=owner, input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
    return {
        "Submit": lambda address, md: unary(address, SCHEDULER, "Submit", request, md),
        "SubmitBatch": lambda address, md: unary(address, SCHEDULER, "SubmitBatch", SubmitBatchRequest([request]), md),
        "Abort": lambda address, md: unary(address, SCHEDULER, "Abort", AbortRequest(rid=rid), md),
        "StreamSteps": lambda address, md: first_of_stream(address, SCHEDULER, "StreamSteps", EMPTY, md),
        "GetModelInfo": lambda address, md: unary(address, SCHEDULER, "GetModelInfo", EMPTY, md),
        "GetStats": lambda address, md: unary(address, SCHEDULER, "GetStats", EMPTY, md),
    }


def stream_outputs(address: str, metadata, owner: str = "someone-else"):
    return first_of_stream(address, DETOKENIZER, "StreamOutputs", StreamOutputsRequest(owner=owner), metadata)


@pytest.mark.parametrize("method", ["Submit", "SubmitBatch", "Abort", "StreamSteps", "GetModelInfo", "GetStats"])
def test_scheduler_refuses_calls_without_the_secret(stack, method):
    call = scheduler_calls("intruder", f"auth-{uuid.uuid4().hex}")[method]
    for metadata in WRONG:
        assert code_of(call, stack.scheduler_address, metadata) == UNAUTHENTICATED, (method, metadata)


def test_detokenizer_refuses_calls_without_the_secret(stack):
    for metadata in WRONG:
        assert code_of(stream_outputs, stack.detokenizer_address, metadata) == UNAUTHENTICATED, metadata


def test_a_service_with_another_secret_says_so(stack, small_model_dir, log_dir):
    """An error naming the likely cause, not the INFO line of a server that is not up yet, forever."""
    detokenizer = ServiceProcess("detokenizer", ["--port", str(free_port()), "--model", str(small_model_dir),
                                                 "--schedulers", stack.scheduler_address], log_dir,
                                 {"FLATWIRE_INTERNAL_SECRET": SECRET + "-other"})
    try:
        deadline = time.monotonic() + 60
        while "refuses this service (UNAUTHENTICATED" not in detokenizer.log():
            assert time.monotonic() < deadline and detokenizer.proc.poll() is None, detokenizer.log()
            time.sleep(0.2)
        assert "ERROR" in detokenizer.log() and "internal secret" in detokenizer.log()
        assert "not up yet" not in detokenizer.log()
    finally:
        detokenizer.stop()


def test_internal_methods_are_served_with_the_secret(stack):
    good = [(SECRET_METADATA, SECRET)]
    owner, rid = f"auth-test-{uuid.uuid4().hex[:8]}", f"auth-{uuid.uuid4().hex}"
    calls = scheduler_calls(owner, rid)
    assert calls["GetModelInfo"](stack.scheduler_address, good).vocab_size > 0
    assert calls["GetStats"](stack.scheduler_address, good) is not None
    calls["StreamSteps"](stack.scheduler_address, good)
    # Submit as a gateway would, read it back from the detokenizer as its owner, then Abort.
    with grpc.insecure_channel(stack.detokenizer_address, options=message_options(64)) as channel:
        stream = DETOKENIZER.calls(channel)["StreamOutputs"](StreamOutputsRequest(owner=owner), metadata=good,
                                                              timeout=60)
        stream.initial_metadata()
        calls["Submit"](stack.scheduler_address, good)
        seen = set()
        for step in stream:
            seen.update(start.rid for start in step.started)
            if rid in seen:
                break
        stream.cancel()
    assert rid in seen
    # Served: NOT_FOUND once the 2-token request has finished, OK while it runs; never UNAUTHENTICATED.
    assert code_of(calls["Abort"], stack.scheduler_address, good) in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND)


def test_health_is_open_everywhere(stack):
    for address in (stack.scheduler_address, stack.detokenizer_address, stack.grpc_address):
        assert check_health(address), address
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reply = httpx.get(f"{stack.http_url}/health", timeout=10)
    assert reply.status_code == 200 and reply.json()["healthy"]


def reflection_services(address: str, metadata=None) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 metadata=metadata, timeout=10))
        return [service.name for service in reply.list_services_response.service]


def test_reflection_only_on_the_public_port(stack):
    for address in (stack.scheduler_address, stack.detokenizer_address):
        assert code_of(reflection_services, address) == UNAUTHENTICATED
        assert code_of(reflection_services, address, [(SECRET_METADATA, SECRET)]) == grpc.StatusCode.UNIMPLEMENTED
    assert code_of(reflection_services, stack.grpc_address) == UNAUTHENTICATED
    assert "flatwire.v1.Generation" in reflection_services(stack.grpc_address, [("authorization", f"Bearer {API_KEY}")])


def test_pipeline_end_to_end(stack):
    reply = httpx.post(f"{stack.http_url}/generate", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                       json={"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["completion_tokens"] == 4


def openai_client(stack, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=api_key, max_retries=0, timeout=120)


def test_openai_client_needs_the_key(stack, small_model_dir):
    with openai_client(stack, "sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.models.list()
        assert refused.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=small_model_dir.name, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2)
    with openai_client(stack, API_KEY) as client:
        [model] = client.models.list().data
        assert model.id == small_model_dir.name  # --model was a path: its name only
        reply = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize("method,path", [("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/generate"),
                                         ("POST", "/v1/completions"), ("GET", "/openapi.json"),
                                         ("GET", "/no-such-route"), ("GET", "/get_server_info"),
                                         ("GET", "/health_generate"), ("POST", "/flush_cache"),
                                         ("POST", "/tokenize"), ("POST", "/abort_request"),
                                         ("GET", "/v1/models/x")])
def test_http_routes_need_the_key(stack, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        reply = httpx.request(method, stack.http_url + path, headers=headers, timeout=30, json={"text": "x"})
        assert reply.status_code == 401, (path, headers, reply.text)
        assert reply.headers["www-authenticate"].startswith("Bearer")
        error = reply.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "AuthenticationError" and error["message"]


def test_metrics_with_the_key(stack):
    for scheme in ("Bearer", "bearer"):
        reply = httpx.get(f"{stack.http_url}/metrics", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=30)
        assert reply.status_code == 200, reply.text


def test_public_grpc_needs_the_key(stack, small_model_dir):
    for api_key in (None, "wrong"):
        with FlatwireClient(stack.grpc_address, api_key=api_key) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate("Hello", max_new_tokens=2)
            assert refused.value.code() == UNAUTHENTICATED
            assert code_of(client.model_info) == UNAUTHENTICATED
    with FlatwireClient(stack.grpc_address, api_key=API_KEY) as client:
        result = client.generate("Hello", max_new_tokens=3, temperature=0, top_logprobs_num=4)
        assert result.completion_tokens == 3 and result.output.topk_ids.shape == (3, 4)
        assert client.model_info().model == small_model_dir.name


def test_internal_secret_file(tmp_path):
    path = tmp_path / "run" / "internal-secret"
    created = load_internal_secret(None, str(path))
    assert len(created) >= 32 and path.read_text().strip() == created
    assert load_internal_secret("", str(path)) == created  # a second service reads the same one
    assert load_internal_secret("explicit", str(path)) == "explicit"
    assert load_internal_secret(None, None) is None and load_internal_secret("", None) is None


@pytest.mark.parametrize("service", ["scheduler", "detokenizer"])
def test_an_internal_server_beyond_loopback_needs_a_secret(service, small_model_dir):
    """Without a secret on 0.0.0.0 it exits at once naming the fix; --allow-no-secret starts it, with a warning."""
    command = [sys.executable, "-m", "services", service, "--host", "0.0.0.0", "--port", "0", "--model",
               str(small_model_dir), *(["--schedulers", "127.0.0.1:1"] if service == "detokenizer" else [])]
    env = {key: value for key, value in os.environ.items() if not key.startswith("FLATWIRE_INTERNAL_SECRET")}
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "needs an internal secret" in refused.stderr, refused.stderr[-2000:]
    allowed = subprocess.Popen([*command, "--allow-no-secret"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        log = ""
        for line in allowed.stderr:
            log += line
            if "serving on" in line:
                break
        assert "unauthenticated (--allow-no-secret)" in log, log[-2000:]
    finally:
        allowed.kill()
        allowed.wait()
