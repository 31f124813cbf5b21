"""TLS: HTTPS and TLS gRPC on the gateway's public ports, mutual TLS on the internal hops (services/common/tls.py),
with a CA and a certificate for 127.0.0.1 made in the test (harness/certificates.py).

One stack for the module: all three services with FLATWIRE_SSL_KEYFILE, _CERTFILE and _CA_CERTS, and an internal
secret (kept beside TLS)."""

import asyncio
import os
import secrets
import ssl
import subprocess
import sys

import grpc
import httpx
import openai
import pytest
from flatwire_client import FlatwireClient
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER
from flatwire_wire.submit_batch import SEND_AT
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.certificates import make_certificates
from harness.stack import running
from services.common.auth import SECRET_METADATA
from services.common.config import ServiceConfig
from services.common.rpc import check_health, internal_channel

pytestmark = pytest.mark.slow  # runs services as processes of its own

SECRET = f"internal-{secrets.token_hex(8)}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stack(model_dir, log_dir, certs):
    with running(model_dir, log_dir, scheduler_args=("--max-running-requests", "4"),
                 env={"FLATWIRE_INTERNAL_SECRET": SECRET, **certs.env()}) as stack:
        yield stack


def test_https_serves_the_apis_and_plain_http_is_refused(stack, certs):
    assert stack.http_url.startswith("https://")
    trusted = ssl.create_default_context(cafile=certs.ca)
    with httpx.Client(base_url=stack.http_url, verify=trusted, timeout=60) as http:
        reply = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}})
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 3
        model = http.get("/v1/models").json()["data"][0]["id"]
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                       http_client=httpx.Client(verify=trusted)) as client:
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.usage.completion_tokens == 2
    with pytest.raises(httpx.HTTPError):  # the TLS port does not speak plain HTTP
        httpx.get(stack.http_url.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(httpx.ConnectError):  # nor is a certificate that no trusted CA signed accepted
        httpx.get(stack.http_url + "/health", timeout=10)


def test_a_batch_that_fills_a_submit_batch_is_served_over_the_secured_hops(stack, certs):
    """More than SEND_AT prompts at once: their submits leave from the request's own task, on the gateway's blocking
    channel to the scheduler (flatwire_wire.submit_batch), which must carry the same TLS and secret as its others."""
    trusted = ssl.create_default_context(cafile=certs.ca)
    prompts = [f"Hello {i}" for i in range(SEND_AT + 3)]
    with httpx.Client(base_url=stack.http_url, verify=trusted, timeout=120) as http:
        reply = http.post("/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 200, reply.text
    assert [result["meta_info"]["completion_tokens"] for result in reply.json()] == [2] * len(prompts)


def test_public_grpc_over_tls(stack, certs):
    with FlatwireClient(stack.grpc_address, tls=certs.ca.read_bytes()) as client:
        result = client.generate("Hello", max_new_tokens=3, temperature=0, top_logprobs_num=4)
        assert result.completion_tokens == 3 and result.output.topk_ids.shape == (3, 4)
    with FlatwireClient(stack.grpc_address) as plaintext, pytest.raises(grpc.RpcError) as refused:
        plaintext.model_info()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", ["scheduler", "detokenizer"])
def test_internal_hops_take_only_peers_the_ca_signed(stack, certs, service):
    address = stack.services[service].address
    ca, key, cert = certs.ca.read_bytes(), certs.key.read_bytes(), certs.cert.read_bytes()
    assert not check_health(address)  # plaintext
    assert not check_health(address, credentials=grpc.ssl_channel_credentials(ca))  # TLS, no client certificate
    with_cert = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
    assert check_health(address, credentials=with_cert)
    if service == "scheduler":  # a certificate alone does not make calls: the internal secret is still asked for
        with grpc.secure_channel(address, with_cert) as channel:
            model_info = SCHEDULER.calls(channel)["GetModelInfo"]
            with pytest.raises(grpc.RpcError) as refused:
                model_info(EMPTY, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert model_info(EMPTY, timeout=10, metadata=[(SECRET_METADATA, SECRET)]).model


def test_the_health_command_uses_the_services_tls_variables(stack, certs):
    command = [sys.executable, "-m", "services", "health", "grpc", stack.services["scheduler"].address]
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("FLATWIRE_SSL_")}
    assert subprocess.run(command, env=plain_env, timeout=60).returncode == 1
    assert subprocess.run(command, env={**plain_env, **certs.env()}, timeout=60).returncode == 0
    http = [sys.executable, "-m", "services", "health", "http", stack.http_url + "/health"]
    assert subprocess.run(http, env={**plain_env, **certs.env()}, timeout=60).returncode == 0


def test_a_resolved_replica_is_checked_for_the_configured_name(stack, certs):
    """The gateway and detokenizer dial each address a DNS name resolves to, checking its certificate for the
    name (compose's `scheduler`, of every replica), or for --ssl-server-name when given (pods dialled by IP):
    here the certificate names localhost."""

    async def serving(name: str | None, server_name: str | None = None) -> bool:
        channel = internal_channel(stack.services["scheduler"].address, ServiceConfig(**{
            "internal_secret": SECRET, "ssl_keyfile": str(certs.key), "ssl_certfile": str(certs.cert),
            "ssl_ca_certs": str(certs.ca), "ssl_server_name": server_name}), name)
        async with channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    assert asyncio.run(serving("localhost"))
    assert not asyncio.run(serving("scheduler.elsewhere.example"))
    assert asyncio.run(serving("scheduler.elsewhere.example", server_name="localhost"))
    assert not asyncio.run(serving("localhost", server_name="scheduler.elsewhere.example"))
