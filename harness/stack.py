"""The stack factory: scheduler(s), detokenizer(s) and gateway(s) as processes on free loopback ports.

    with running(model_dir, log_dir, scheduler_args=("--max-running-requests", "16")) as stack:
        httpx.post(f"{stack.http_url}/generate", json=...)
        stack.kill("detokenizer")
        stack.start("detokenizer")
        stack.wait_ready()

The default topology is compose's: one scheduler, one detokenizer following it, one gateway. `schedulers=N`
runs N scheduler replicas, followed by one detokenizer (`detokenizers=1`) or by one each (`detokenizers=N`);
the gateway follows all of them. Services are named by kind, the first of each kind by the kind alone:
"scheduler", "scheduler-1", ..., "detokenizer", "gateway". `add()` registers one more of a kind (a second
gateway with other options, say) beside the stack's own.
"""

import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER, SchedulerStats

from harness.procs import ServiceProcess, free_port

KINDS = ("scheduler", "detokenizer", "gateway")


@dataclass
class Service:
    """One service of a stack: what `flatwire <kind>` is given, its ports and, once started, its process."""

    name: str  # "scheduler", "scheduler-1", "detokenizer", "gateway", ...
    kind: str  # scheduler, detokenizer or gateway
    port: int  # gRPC; the gateway's HTTP
    args: list[str]  # the command line after `flatwire <kind>`
    env: dict[str, str]
    grpc_port: int | None = None  # the gateway's public gRPC
    extra: list[str] = field(default_factory=list)  # added by restart()
    proc: ServiceProcess | None = None

    @property
    def address(self) -> str:
        """host:port of its gRPC server (the gateway's public one)."""
        return f"127.0.0.1:{self.grpc_port or self.port}"

    @property
    def http_url(self) -> str:
        if self.kind != "gateway":
            raise AttributeError(f"{self.name} serves no HTTP")
        scheme = "https" if self.env.get("FLATWIRE_SSL_CERTFILE") else "http"  # started with TLS
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None


class Stack:
    """The services as processes, each startable, stoppable, signalled and restartable by name.

    `scheduler_args`, `detokenizer_args` and `gateway_args` go after each of the stack's own services of that
    kind's command line (later flags win: they may replace what the stack sets, `--detokenizers` say); `env`
    goes to every service, `scheduler_env` (and so on) to that kind's. Nothing starts before start().
    """

    def __init__(self, model_dir: Path | str, log_dir: Path, *, schedulers: int = 1, detokenizers: int = 1,
                 gateway_workers: int = 1, scheduler_args: Sequence[str] = (), detokenizer_args: Sequence[str] = (),
                 gateway_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 scheduler_env: dict[str, str] | None = None, detokenizer_env: dict[str, str] | None = None,
                 gateway_env: dict[str, str] | None = None):
        if detokenizers not in (1, schedulers):
            raise ValueError("detokenizers: 1 (following every scheduler) or one per scheduler")
        self.model = str(model_dir)
        self.log_dir = log_dir
        self.env = dict(env or {})
        self.services: dict[str, Service] = {}
        for _ in range(schedulers):
            self.add("scheduler", *scheduler_args, env=scheduler_env)
        replicas = self.scheduler_addresses
        for i in range(detokenizers):
            self.add("detokenizer", *detokenizer_args, env=detokenizer_env,
                     schedulers=replicas if detokenizers == 1 else [replicas[i]])
        self.gateway_workers = gateway_workers  # processes behind the first gateway's ports
        shared = ("--reuse-port",) if gateway_workers > 1 else ()  # flatwire up --gateway-workers
        first = self.add("gateway", *gateway_args, *shared, env=gateway_env)
        for _ in range(gateway_workers - 1):
            self.add("gateway", *gateway_args, *shared, env=gateway_env, ports_of=first)

    def add(self, kind: str, *args: str, env: dict[str, str] | None = None,
            schedulers: Sequence[str] | None = None, ports_of: Service | None = None) -> Service:
        """One more `kind` on free ports (or on `ports_of`'s: a gateway worker sharing them, --reuse-port),
        following every scheduler (and a gateway, every detokenizer) of the stack so far, `args` after its command
        line and `env` added to the stack's; registered, not started."""
        if kind not in KINDS:
            raise ValueError(f"kind: one of {', '.join(KINDS)}, not {kind!r}")
        count = sum(service.kind == kind for service in self.services.values())
        name = kind if count == 0 else f"{kind}-{count}"
        port = ports_of.port if ports_of is not None else free_port()
        command = ["--port", str(port), "--model", self.model]
        grpc_port = None
        if kind == "detokenizer":
            command += ["--schedulers", ",".join(schedulers or self.scheduler_addresses)]
        elif kind == "gateway":
            grpc_port = ports_of.grpc_port if ports_of is not None else free_port()
            command += ["--grpc-port", str(grpc_port), "--schedulers", ",".join(self.scheduler_addresses),
                        "--detokenizers", ",".join(self.detokenizer_addresses)]
        service = Service(name, kind, port, [*command, *args], {**self.env, **(env or {})}, grpc_port)
        self.services[name] = service
        return service

    # -- addresses ------------------------------------------------------------------------------------------

    def _of(self, kind: str) -> list[Service]:
        return [service for service in self.services.values() if service.kind == kind]

    @property
    def http_url(self) -> str:
        """The (first) gateway's HTTP base URL."""
        return self.services["gateway"].http_url

    @property
    def grpc_address(self) -> str:
        """The (first) gateway's public gRPC address."""
        return self.services["gateway"].address

    @property
    def scheduler_address(self) -> str:
        return self.services["scheduler"].address

    @property
    def scheduler_addresses(self) -> list[str]:
        return [service.address for service in self._of("scheduler")]

    @property
    def detokenizer_address(self) -> str:
        return self.services["detokenizer"].address

    @property
    def detokenizer_addresses(self) -> list[str]:
        return [service.address for service in self._of("detokenizer")]

    @property
    def procs(self) -> dict[str, ServiceProcess]:
        """Name -> the process of each service started so far (the latest, for one started again)."""
        return {name: service.proc for name, service in self.services.items() if service.proc is not None}

    # -- processes ------------------------------------------------------------------------------------------

    def start(self, *names: str) -> "Stack":
        """Start the named services (none given: every one not running) all at once, as `flatwire up` does
        (each waits for the hops it follows), then wait until each one's gRPC health answers, kind after kind.
        A whole stack of several schedulers is waited for until the gateway has every one in rotation."""
        chosen = [self.services[name] for name in names] if names else [
            service for service in self.services.values() if not service.running]
        for service in chosen:
            if service.running:
                raise RuntimeError(f"{service.name} is running")
            if service.proc is not None:
                service.proc.stop()  # an exited one: closes its log
            service.proc = ServiceProcess(service.kind, [*service.args, *service.extra], self.log_dir, service.env)
        for kind in KINDS:
            for service in chosen:
                if service.kind == kind:
                    self._proc(service.name).wait_healthy(service.address)
        if not names and len(self._of("scheduler")) > 1:
            self._wait_rotation()
        return self

    def _wait_rotation(self, timeout: float = 60) -> None:
        """Until the gateway's /health has every scheduler in rotation (a replica joins at a health round of
        its own, after the gateway's gRPC health answers for the first one)."""
        deadline = time.monotonic() + timeout
        while True:
            replicas = httpx.get(f"{self.http_url}/health", timeout=5).json()["schedulers"]
            if all(replica["in_rotation"] for replica in replicas.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"schedulers not in rotation after {timeout:g} s: {replicas}")
            time.sleep(0.1)

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to the service's process (SIGKILL: and reap it)."""
        proc = self._proc(name)
        proc.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.proc.wait(timeout=30)

    def kill(self, name: str) -> None:
        """SIGKILL: no goodbye on its streams."""
        self.signal(name, signal.SIGKILL)

    def stop(self, name: str) -> None:
        """Stop it as Ctrl-C does (SIGINT; SIGKILL after 15 s); a stopped (SIGSTOP) one is continued first."""
        proc = self._proc(name)
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGCONT)
        proc.stop()

    def restart(self, name: str, *args: str) -> None:
        """Stop the service (if it runs) and start it again with `args` after its command line (those of an
        earlier restart dropped: restart(name) goes back to the stack's own command)."""
        service = self.services[name]
        if service.running:
            self.stop(name)
        service.extra = list(args)
        self.start(name)

    def wait_ready(self, timeout: float = 60, gateway: str = "gateway") -> None:
        """Until the gateway admits requests (its /health is 200: the whole path works)."""
        url = self.services[gateway].http_url
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gateway} did not become healthy in {timeout:g} s")
            time.sleep(0.2)

    def wait_warm(self, timeout: float = 120, gateway: str = "gateway") -> None:
        """Until every gateway process behind `gateway`'s port has built its renderers (/server_info
        renderers_ready), so that a measurement does not share the CPU with that startup thread."""
        url, workers = self.services[gateway].http_url, self.gateway_workers
        deadline, ready = time.monotonic() + timeout, set()
        while len(ready) < workers:
            with httpx.Client(timeout=5) as client:  # a new connection each round: the kernel picks a worker
                info = client.get(f"{url}/server_info").json()
            if info["renderers_ready"]:
                ready.add(info["gateway_id"])
            if time.monotonic() > deadline:
                raise TimeoutError(f"{workers - len(ready)} of {gateway}'s processes did not build their "
                                   f"renderers in {timeout:g} s")
            time.sleep(0.1)

    def stats(self, name: str = "scheduler") -> SchedulerStats:
        """A scheduler's GetStats."""
        with grpc.insecure_channel(self.services[name].address) as channel:
            return SCHEDULER.calls(channel)["GetStats"](EMPTY, timeout=10)

    def close(self) -> None:
        """Stop every service started, last started kind first."""
        for name, service in reversed(self.services.items()):
            if service.proc is not None:
                self.stop(name)

    def _proc(self, name: str) -> ServiceProcess:
        proc = self.services[name].proc
        if proc is None:
            raise RuntimeError(f"{name} was never started")
        return proc

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def running(model_dir: Path | str, log_dir: Path, **options) -> Iterator[Stack]:
    """A Stack(model_dir, log_dir, **options), every service started; closed on the way out."""
    with Stack(model_dir, log_dir, **options) as stack:
        yield stack.start()


@contextmanager
def another_gateway(stack: Stack, *args: str) -> Iterator[httpx.Client]:
    """One more gateway on the stack's schedulers and detokenizers, with `args`, started; an HTTP client of it
    while it runs; stopped on the way out."""
    extra = stack.add("gateway", *args)
    stack.start(extra.name)
    try:
        with httpx.Client(base_url=extra.http_url, timeout=120) as client:
            yield client
    finally:
        stack.stop(extra.name)
