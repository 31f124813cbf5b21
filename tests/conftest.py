import os
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.procs import ServiceProcess, free_port
from harness.scheduler_client import SchedulerClient
from services.common.model_store import DEFAULT_CACHE_DIR, resolve_model

CACHE_DIR = Path(os.environ.get("FLATWIRE_CACHE_DIR", DEFAULT_CACHE_DIR))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded default model (built once into the cache)."""
    return resolve_model(None, CACHE_DIR)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def start_service(model_dir, log_dir):
    """start_service(command, *args) -> (process, address); stopped at session end.

    Waits until gRPC health answers SERVING on the service's port (or on
    `health_port`, for the gateway whose --port is HTTP).
    """
    started = []

    def start(command: str, *args: str, env: dict | None = None, health_port: int | None = None):
        port = free_port()
        proc = ServiceProcess(command, ["--port", str(port), "--model", str(model_dir), *args], log_dir, env)
        started.append(proc)
        address = f"127.0.0.1:{port}"
        proc.wait_healthy(f"127.0.0.1:{health_port or port}")
        return proc, address

    yield start
    for proc in reversed(started):
        proc.stop()


@pytest.fixture(scope="session")
def scheduler_address(start_service) -> str:
    _, address = start_service("scheduler", "--max-running-requests", "16")
    return address


class Stack:
    """A running scheduler + detokenizer + gateway."""

    def __init__(self, http_url: str, grpc_address: str, scheduler_address: str, detokenizer_address: str,
                 gateway: ServiceProcess):
        self.http_url = http_url
        self.grpc_address = grpc_address
        self.scheduler_address = scheduler_address
        self.detokenizer_address = detokenizer_address
        self.gateway = gateway


@pytest.fixture(scope="session")
def stack(start_service, scheduler_address) -> Stack:
    """The whole pipeline on loopback; the gateway's HTTP at stack.http_url."""
    _, detokenizer_address = start_service("detokenizer", "--schedulers", scheduler_address)
    grpc_port = free_port()
    gateway, http_address = start_service(
        "gateway", "--schedulers", scheduler_address, "--detokenizers", detokenizer_address,
        "--grpc-port", str(grpc_port), health_port=grpc_port)
    return Stack(f"http://{http_address}", f"127.0.0.1:{grpc_port}", scheduler_address, detokenizer_address,
                 gateway)


@pytest.fixture(scope="session")
def http(stack) -> httpx.Client:
    """An HTTP client of the stack's gateway."""
    with httpx.Client(base_url=stack.http_url, timeout=300) as client:
        yield client


def pytest_collection_modifyitems(items) -> None:
    """Mark `slow` every test that runs services as processes through start_service (modules that start
    processes otherwise mark themselves): `python -m pytest -m "not slow"` is the fast inner loop."""
    for item in items:
        if "start_service" in item.fixturenames:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def served_model(http) -> str:
    """The model name the OpenAI routes answer to."""
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="session")
def openai_client(stack):
    """The real `openai` package's client, on the session stack."""
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def scheduler_client(scheduler_address):
    """Submits to the session scheduler as its own owner and collects that owner's outputs."""
    client = SchedulerClient(scheduler_address)
    yield client
    client.close()


@pytest.fixture(scope="session")
def reference_model(model_dir):
    """The default checkpoint in transformers, float32: what the scheduler's outputs are checked against."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
