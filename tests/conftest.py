import os

# No test has a GPU: Triton kernels (services/scheduler/model/triton_attention.py) run in Triton's interpreter on
# CPU tensors. Read when triton is first imported, which transformers may do below.
os.environ["TRITON_INTERPRET"] = "1"
# One thread per process for torch's intra-op work: the suite runs three test processes, and the services they start,
# on two cores; a second OpenMP thread per process finds no core of its own and spins in OpenMP's barriers (the
# engine tests took 2 to 4 times as long, and as much more CPU). Read when torch is imported, below; the services
# the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.checkpoints import small_vocabulary_checkpoint
from harness.procs import start_service as harness_start_service
from harness.scheduler_client import SchedulerClient
from harness.stack import Stack
from services.common.model_store import DEFAULT_CACHE_DIR, resolve_model

CACHE_DIR = Path(os.environ.get("FLATWIRE_CACHE_DIR", DEFAULT_CACHE_DIR))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded default model (built once into the cache)."""
    return resolve_model(None, CACHE_DIR)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> Path:
    """The default model's architecture on a small vocabulary (harness.checkpoints.SMALL_VOCABULARY, and its
    tokenizer), built once per test process: what the engine and scheduler tests run on, that need no text, and the
    stacks whose subject is the processes (launcher, router, auth, the synthetic engine's): their services start
    without reading 248k tokens."""
    return small_vocabulary_checkpoint(tmp_path_factory.mktemp("small-vocabulary"))


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def start_service(model_dir, log_dir):
    """start_service(command, *args, env=None) -> (process, address): a scheduler or detokenizer of its own on a free
    port (harness.procs.start_service), once its gRPC health answers SERVING; stopped at session end."""
    started = []

    def start(command: str, *args: str, env: dict | None = None):
        proc, address = harness_start_service(command, ["--model", str(model_dir), *args], log_dir, env)
        started.append(proc)
        return proc, address

    yield start
    for proc in reversed(started):
        proc.stop()


@pytest.fixture(scope="session")
def session_stack(model_dir, log_dir) -> Iterator[Stack]:
    """The session's scheduler, detokenizer and gateway (harness.stack.Stack), each started when a test first
    needs it: scheduler_address starts the scheduler alone, stack the other two."""
    with Stack(model_dir, log_dir, scheduler_args=("--max-running-requests", "16")) as stack:
        yield stack


@pytest.fixture(scope="session")
def scheduler_address(session_stack) -> str:
    session_stack.start("scheduler")
    return session_stack.scheduler_address


@pytest.fixture(scope="session")
def stack(session_stack, scheduler_address) -> Stack:
    """The whole pipeline on loopback; the gateway's HTTP at stack.http_url."""
    session_stack.start("detokenizer", "gateway")
    return session_stack


@pytest.fixture(scope="session")
def http(stack) -> httpx.Client:
    """An HTTP client of the stack's gateway."""
    with httpx.Client(base_url=stack.http_url, timeout=300) as client:
        yield client


DURATIONS_KEY = "flatwire/work-unit-seconds"  # pytest's cache: how long each work unit took when it last ran
# That cache entry as a full run left it, committed, so that a fresh clone (CI's) orders its units as well.
# Refresh after a full run: cp .pytest_cache/v/flatwire/work-unit-seconds tests/work_units.json
COMMITTED_DURATIONS = Path(__file__).with_name("work_units.json")
# Modules whose tests share nothing of module scope (each starts what it needs): each test a work unit of its own.
SPREAD = frozenset({"tests/deploy/test_launcher.py", "tests/scheduler/test_tensor_parallel_models.py"})
_took: dict[str, float] = {}


def work_unit(nodeid: str) -> str:
    """What pytest-xdist hands a test process at once: a test module (its tests run in one process, in their
    order, sharing the module's fixtures and the session's stack), or a test of a module in SPREAD."""
    module = nodeid.split("::")[0]
    return nodeid if module in SPREAD else module


def pytest_xdist_make_scheduler(config, log):
    """pyproject's `-n 3 --dist loadscope`: work_unit's units to whichever process is free, in collection order
    (the longest first: pytest_collection_modifyitems), so that no process idles at the end while another
    runs a long one. (`--dist loadgroup` would do, but pytest-xdist 3.8 cannot rename pytest 9's node ids: its
    xdist_group marks are ignored.) Another --dist on the command line: pytest-xdist's own."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Mark `slow` every test that runs services as processes through start_service or the session's stack
    (modules that start processes otherwise mark themselves): `python -m pytest -m "not slow"` is the fast inner
    loop. Then order the work units (work_unit) longest first: as long as they took when they last ran (pytest's
    cache, else COMMITTED_DURATIONS), or for a new unit 10 s a test that runs processes and 0.5 s another."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        if "start_service" in item.fixturenames or "session_stack" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
        units.setdefault(work_unit(item.nodeid), []).append(item)
    cache = getattr(config, "cache", None)
    took = json.loads(COMMITTED_DURATIONS.read_text())
    took.update(cache.get(DURATIONS_KEY, {}) if cache is not None else {})

    def cost(unit: str) -> float:
        return took.get(unit) or sum(10.0 if item.get_closest_marker("slow") else 0.5 for item in units[unit])

    items[:] = [item for unit in sorted(units, key=cost, reverse=True) for item in units[unit]]


def pytest_runtest_logreport(report) -> None:
    """Sums each work unit's setup, call and teardown (in the process that reports them all: the controller)."""
    unit = work_unit(report.nodeid)
    _took[unit] = _took.get(unit, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    cache = getattr(session.config, "cache", None)
    if cache is not None and _took and not hasattr(session.config, "workerinput"):
        cache.set(DURATIONS_KEY, {**cache.get(DURATIONS_KEY, {}), **{u: round(s, 2) for u, s in _took.items()}})


@pytest.fixture(scope="session")
def served_model(http) -> str:
    """The model name the OpenAI routes answer to."""
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="session")
def openai_client(stack):
    """The real `openai` package's client, on the session stack."""
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def lone_scheduler_address(start_service, small_model_dir) -> str:
    """A scheduler that no detokenizer follows, for tests that read its step stream themselves: the session's
    detokenizer adopts the owners it sees within --owner-grace-s of its start and, since such a test never
    subscribes there, aborts their requests once that grace has passed. Its output ships on the steps it was
    made, however late the test reads it (--stream-coalesce-tokens 1): these tests check each entry. These tests
    send token ids and read no text: it serves the small vocabulary (small_model_dir)."""
    _, address = start_service("scheduler", "--model", str(small_model_dir), "--max-running-requests", "16",
                               "--stream-coalesce-tokens", "1")
    return address


@pytest.fixture(scope="module")
def scheduler_client(lone_scheduler_address):
    """Submits to a scheduler of its own (lone_scheduler_address) as its own owner and collects that owner's
    outputs."""
    client = SchedulerClient(lone_scheduler_address)
    yield client
    client.close()


@pytest.fixture(scope="session")
def stack_reference_model(model_dir):
    """The session stack's checkpoint (the default model) in transformers, float32: what the end-to-end tests'
    outputs are checked against."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference_model(small_model_dir):
    """The lone scheduler's checkpoint (small_model_dir) in transformers, float32: what its outputs are checked
    against."""
    return AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32).eval()
