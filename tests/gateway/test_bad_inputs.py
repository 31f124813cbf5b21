"""The residual bad inputs: values that overflow the scheduler's messages, the scheduler's field names,
gRPC and HTTP validation alike, tiny temperatures, undecodable gRPC payloads, and /openapi.json."""

import asyncio
import socket
import time

import grpc
import pytest
from flatwire_client import FlatwireClient
from flatwire_wire.detokenizer import DETOKENIZER
from flatwire_wire.public import GENERATION
from flatwire_wire.rpc import FIELD_METADATA, ServiceSpec
from flatwire_wire.scheduler import SCHEDULER, LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import DetokenizeParams

from services.gateway.engine_client import EngineClient, RequestError
from services.gateway.protocol.intake import GenerateInput
from services.gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.gateway.protocol.parse import rename_field
from services.gateway.protocol.sglang import GenerateRequest
from services.gateway.protocol.vllm_generate import InferenceGenerateRequest
from tests.gateway.bodies import CHAT, COMPLETION

INT32_OVERFLOW = 2**31
INT40 = 1099511627776

# (endpoint, body, the field the 400 must name)
CASES = [
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "top_k": INT32_OVERFLOW}},
     "sampling_params.top_k"),
    ("/v1/chat/completions", {**CHAT, "top_k": INT32_OVERFLOW}, "top_k"),
    ("/v1/completions", {**COMPLETION, "top_k": INT32_OVERFLOW}, "top_k"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                   "logprob_start_len": INT40}, "logprob_start_len"),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                   "logprob_start_len": 3}, "logprob_start_len"),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": 1e39}}, "sampling_params.temperature"),
    # Past uint32 it cannot be sent to the scheduler at all (gRPC would send the request empty).
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "routed_experts_start_len": INT40},
     "routed_experts_start_len"),
    # The scheduler refused these with its own names (sampling.max_new_tokens): now the gateway does.
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": ["Hi", "Ho"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 10**7}]},
     "sampling_params[1].max_new_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, "max_tokens"),
]


@pytest.fixture(scope="module")
def client(stack):
    with FlatwireClient(stack.grpc_address) as c:
        yield c


@pytest.mark.parametrize(("endpoint", "body", "field"), CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_overflowing_and_scheduler_refused_values_are_400_naming_the_clients_field(send, endpoint, body, field):
    response = send(endpoint, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(field + ": ")
    assert "sampling." not in error["message"] and "logprob." not in error["message"]


def test_logprob_start_len_is_ignored_without_return_logprob(send):
    """As SGLang: logprob_start_len only matters with return_logprob."""
    response = send("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "logprob_start_len": INT40})
    assert response.status_code == 200, response.text


def _greedy_ids(send, **sampling) -> list[int]:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True,
                                                                    **sampling}}
    response = send("/generate", body)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_tiny_temperature_is_greedy(send, client):
    """SGLang: temperature < 1e-6 samples greedily. 1e-45 (a float32 denormal) once emitted token 0 each step."""
    greedy = _greedy_ids(send, temperature=0)
    assert greedy != [0] * len(greedy)
    assert _greedy_ids(send, temperature=1e-45) == greedy
    assert _greedy_ids(send, temperature=1e-7, seed=3) == greedy
    grpc_ids = client.generate("The capital of France is", max_new_tokens=12, ignore_eos=True, temperature=1e-45)
    assert grpc_ids.token_ids.tolist() == greedy
    chat = send("/v1/chat/completions", {**CHAT, "temperature": 1e-45, "max_tokens": 6, "seed": 1}).json()
    chat_greedy = send("/v1/chat/completions", {**CHAT, "temperature": 0, "max_tokens": 6}).json()
    assert chat["choices"][0]["message"] == chat_greedy["choices"][0]["message"]


def test_top_p_below_float32_keeps_the_most_likely_token(send):
    """top_p=1e-50 rounds to 0 as float32 (which the scheduler refuses); it means the top token alone."""
    assert _greedy_ids(send, temperature=1.0, top_p=1e-50) == _greedy_ids(send, temperature=0)


# -- the public gRPC API: /generate's validation, its own field names --------------------------------------


def _grpc_error(client, *args, **options) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(*args, **options)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value


def test_grpc_refuses_what_http_refuses_with_the_same_message(client, send):
    info = client.model_info()
    prompt = [9707] * (info.max_context - 1)
    cases = [  # (gRPC options, the same request on /generate, the gRPC field)
        ({"input_ids": prompt, "max_new_tokens": 2},
         {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}, "sampling.max_new_tokens"),
        ({"input_ids": [1, 2], "max_new_tokens": 2**32 - 1},
         {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2**32 - 1}}, "sampling.max_new_tokens"),
        ({"input_ids": [1, 2], "max_new_tokens": 2, "return_logprob": True, "logprob_start_len": 2},
         {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
          "logprob_start_len": 2}, "logprob_start_len"),
        ({"input_ids": [1, 2], "max_new_tokens": 2, "top_p": 1.5},
         {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_p": 1.5}}, "sampling.top_p"),
        ({"input_ids": [1, 2], "max_new_tokens": 2, "stop_token_ids": [10**9]},
         {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [10**9]}},
         "sampling.stop_token_ids"),
        ({"input_ids": [1, 2], "max_new_tokens": 2, "token_ids_logprob": [-3]},
         {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "token_ids_logprob": [-3]},
         "token_ids_logprob"),
    ]
    for options, body, field in cases:
        details = _grpc_error(client, **options).details()
        http_error = send("/generate", body).json()["error"]
        assert details.startswith(field + ": "), details
        assert details == http_error["message"].replace("sampling_params.", "sampling."), (details, http_error)


def test_the_default_max_new_tokens_is_cut_to_what_the_context_leaves(client, send):
    """As SGLang: a long prompt without max_new_tokens runs to the context's end; one asked for is refused (above)."""
    prompt = [9707] * (client.model_info().max_context - 3)
    body = send("/generate", {"input_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True}}).json()
    assert body["meta_info"]["completion_tokens"] == 3, body
    assert body["meta_info"]["finish_reason"]["type"] == "length"


def test_grpc_refuses_values_json_cannot_carry(client):
    assert _grpc_error(client, "Hi", max_new_tokens=2, temperature=float("nan")).details().startswith(
        "sampling.temperature: ")
    assert _grpc_error(client, "Hi", max_new_tokens=2, top_p=float("inf")).details().startswith("sampling.top_p: ")
    assert _grpc_error(client, "Hi", max_new_tokens=2, min_p=-1.0).details().startswith(
        "sampling.min_p: ")
    assert len(client.generate("still fine", max_new_tokens=2).token_ids) == 2


# -- a scheduler refusal that gets past the gateway names the client's field ------------------------------


@pytest.mark.parametrize(("detail", "fields", "expected"), [
    ("sampling.top_p: must be in (0, 1]", {"sampling": "sampling_params"}, "sampling_params.top_p"),
    ("sampling.temperature: must be a finite number >= 0", {"sampling": ""}, "temperature"),
    ("sampling.max_new_tokens: must be positive",
     ChatCompletionRequest.model_construct(max_completion_tokens=3).scheduler_fields(), "max_completion_tokens"),
    ("sampling.max_new_tokens: must be positive", ChatCompletionRequest.model_construct().scheduler_fields(),
     "max_tokens"),
    ("logprob.logprob_start_len: must be -1 (no prompt logprobs) or a prompt position",
     GenerateRequest.model_construct(text="x").scheduler_fields(0), "logprob_start_len"),
    ("logprob.top_logprobs_num: 300 exceeds the maximum 256",
     CompletionRequest.model_construct().scheduler_fields(), "logprobs"),
    ("logprob.top_logprobs_num: 300 exceeds the maximum 256",
     ChatCompletionRequest.model_construct().scheduler_fields(), "top_logprobs"),
    ("input_ids: 5000 tokens leave no room", CompletionRequest.model_construct().scheduler_fields(), "prompt"),
    ("rid: must not be empty", {"sampling": ""}, "rid"),
])
def test_scheduler_refusals_are_renamed(detail, fields, expected):
    class Refusing:
        async def submit(self, request, routing_key):
            field = grpc.aio.Metadata((FIELD_METADATA, detail.split(":", 1)[0]))  # as the scheduler sends it
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), field, details=detail)

    engine = EngineClient.__new__(EngineClient)
    engine.schedulers = Refusing()
    inp = GenerateInput(input_ids=[], sampling=SamplingParams(), logprob=LogprobParams(), detokenize=DetokenizeParams(),
                        fields=fields)
    with pytest.raises(RequestError) as caught:
        asyncio.run(engine._submit(TokenizedRequest(rid="", owner=""), inp))
    assert caught.value.status == "invalid_argument"
    assert caught.value.field == expected
    assert caught.value.message == expected + detail[detail.index(":"):]


def test_rename_field_keeps_indexes_and_unrelated_names():
    names = {"sampling_params": "sampling", "sampling_params.stop": "stop"}
    assert rename_field("sampling_params.stop[2]", "sampling_params.stop[2]: too long", names) == (
        "stop[2]", "stop[2]: too long")
    assert rename_field("sampling_params.top_k", "sampling_params.top_k: bad", names) == (
        "sampling.top_k", "sampling.top_k: bad")
    assert rename_field("sampling_params_x", "sampling_params_x: bad", names) == ("sampling_params_x",
                                                                                  "sampling_params_x: bad")
    assert rename_field(None, "whole body", names) == (None, "whole body")


# -- undecodable gRPC payloads: INVALID_ARGUMENT, no traceback ----------------------------------------------


def _methods(spec: ServiceSpec) -> list[tuple[str, bool]]:
    return [(method.path, method.server_streaming) for method in spec.methods.values()]


UNDECODABLE = [b"\xff\xff\xff", b"\x0a\x05ab", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"]


def test_undecodable_payloads_are_invalid_argument_without_a_traceback(stack, log_dir):
    targets = [
        (stack.scheduler_address, _methods(SCHEDULER)),
        (stack.detokenizer_address, _methods(DETOKENIZER)),
        (stack.grpc_address, _methods(GENERATION)),
    ]
    health = ("/grpc.health.v1.Health/Check", False)
    logs = sorted(log_dir.glob("*.log"))
    sizes = {path: path.stat().st_size for path in logs}
    for address, methods in targets:
        with grpc.insecure_channel(address) as channel:
            for method, server_streaming in [*methods, health]:
                for payload in UNDECODABLE:
                    call = (channel.unary_stream if server_streaming else channel.unary_unary)(method)
                    with pytest.raises(grpc.RpcError) as caught:
                        result = call(payload, timeout=10)
                        if server_streaming:
                            list(result)
                    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, caught.value.details())
                    assert "do not decode as" in caught.value.details(), caught.value.details()
                    assert "Unexpected" not in caught.value.details()
    # Good calls still work on every service.
    with FlatwireClient(stack.grpc_address) as client:
        assert len(client.generate("still fine", max_new_tokens=2).token_ids) == 2
    time.sleep(0.5)
    for path in logs:
        with open(path, "rb") as log:
            log.seek(sizes[path])
            written = log.read().decode(errors="replace")
        assert "Traceback" not in written and "DecodeError" not in written, (path.name, written[-2000:])


# -- /openapi.json describes every POST route's request --------------------------------------------------


@pytest.mark.parametrize(("path", "model"), [
    ("/generate", GenerateRequest), ("/v1/chat/completions", ChatCompletionRequest),
    ("/v1/completions", CompletionRequest), ("/inference/v1/generate", InferenceGenerateRequest)])
def test_openapi_declares_request_bodies(http, path, model):
    document = http.get("/openapi.json").json()
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    ref = body["content"]["application/json"]["schema"]["$ref"]
    assert ref.startswith("#/components/schemas/")
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(schema["properties"]) == set(model.model_fields)
    assert set(schema.get("required", [])) == {name for name, f in model.model_fields.items() if f.is_required()}
    # Every reference in the document resolves.
    refs = [part.split('"')[0] for part in str(document).replace("'", '"').split('"$ref": "')[1:]]
    for ref in refs:
        assert ref.rsplit("/", 1)[1] in document["components"]["schemas"], ref
    operation_ids = [operation["operationId"] for item in document["paths"].values() for operation in item.values()]
    assert len(operation_ids) == len(set(operation_ids))  # code generators need them unique


def test_clients_that_leave_mid_body_leave_no_traceback(stack, http):
    """A client that sends half a body and closes is its own business: no "Exception in ASGI application" in
    the gateway's log, and the gateway serves on."""
    host, port = stack.http_url.removeprefix("http://").rsplit(":", 1)
    before = len(stack.procs["gateway"].log())
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    for _ in range(20):
        with socket.create_connection((host, int(port))) as connection:
            connection.sendall(head + b'{"text": "half')
    time.sleep(1.0)
    assert http.get("/health").status_code == 200
    assert "Exception in ASGI application" not in stack.procs["gateway"].log()[before:]
