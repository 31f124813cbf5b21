"""`flatwire up`: scheduler, detokenizer and gateway as processes on loopback.

Builds, finds or downloads the model first, starts the three services (scheduler and detokenizer on free
loopback ports unless given, so that several launchers run side by side), waits until the
gateway's /health is 200, prints where to connect, then supervises them: a service
that exits is restarted with the same command after an exponential backoff
(--restart-delay-s doubling up to --restart-max-delay-s, back to the first delay once
the service has stayed up --restart-reset-s). A service that exits during startup
stops everything instead, since that is usually a setup error (port taken, bad model)
that a restart would not fix. Ctrl-C or SIGTERM stops the gateway first, and once it has drained (its
requests need the other two) the detokenizer and the scheduler; the launcher killed, they stop by themselves.

Besides its own options (UpConfig) it takes every option of the services it starts, derived from their
configs: each one given is passed on, as a flag, to every service whose config has it; the rest are left to
the services' own FLATWIRE_* variables and defaults.
"""

import argparse
import ctypes
import dataclasses
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from services.common.config import (
    ENV_PREFIX,
    ServiceConfig,
    env_name,
    flag_help,
    option,
    parse_config,
    require_ports,
    shown_default,
)
from services.common.healthcheck import http_ok
from services.common.model_store import model_name, resolve_model
from services.common.ports import port_taken
from services.common.rpc import check_health
from services.detokenizer.config import DetokenizerConfig
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig

SERVICES: dict[str, type[ServiceConfig]] = {
    "scheduler": SchedulerConfig, "detokenizer": DetokenizerConfig, "gateway": GatewayConfig}
# The launcher wires the services to each other itself.
WIRING = {"schedulers", "detokenizers"}
# Passed on in the environment, not on the services' command lines (which ps shows).
SECRETS = {"internal_secret", "api_key", "admin_api_key"}
COMPOSE_VARIABLES = {"FLATWIRE_TAG"}  # docker-compose.yml's own, read by compose, not by a service
STOP_TIMEOUT_S = 15.0  # for a service to exit once told to (a gateway: once its drain is over), before a kill
PR_SET_PDEATHSIG = 1  # prctl(2)
try:
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


@dataclass
class UpConfig:
    """flatwire up: run the whole pipeline on this machine."""

    host: str = option("127.0.0.1", "address the gateway listens on (the scheduler and detokenizer: loopback)")
    port: int = option(30000, "gateway HTTP port")
    grpc_port: int = option(30001, "gateway public gRPC port")
    scheduler_port: int | None = option(None, "scheduler port (loopback); default: a free port, picked at start")
    detokenizer_port: int | None = option(None, "detokenizer port (loopback); default: a free port, picked at "
                                          "start")
    gateway_workers: int = option(1, "gateway processes sharing the HTTP and gRPC ports (SO_REUSEPORT: the kernel "
                                  "spreads connections across them), so that a host's cores all serve clients; each "
                                  "is an ordinary gateway of the same scheduler and detokenizer")
    startup_timeout_s: float = option(600.0, "give up if the pipeline is not healthy by then")
    restart_delay_s: float = option(1.0, "wait before restarting a crashed service; doubles on each crash")
    restart_max_delay_s: float = option(30.0, "cap on the restart delay")
    restart_reset_s: float = option(60.0, "a service up this long gets the first restart delay again")

    def __post_init__(self):
        ports = ("port", "grpc_port", "scheduler_port", "detokenizer_port")
        require_ports(self, ports)
        given = [getattr(self, name) for name in ports if getattr(self, name)]
        if len(set(given)) < len(given):
            raise ValueError("--port, --grpc-port, --scheduler-port and --detokenizer-port: one port each")
        if self.gateway_workers < 1:
            raise ValueError("--gateway-workers: at least 1")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """The FLATWIRE_* variables that are no option of any service, nor of `up` (a misspelling does nothing)."""
    known = {env_name(field.name) for config in (*SERVICES.values(), UpConfig) for field in dataclasses.fields(config)}
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known | COMPOSE_VARIABLES)


def service_options() -> dict[str, dict[str, dataclasses.Field]]:
    """Each service option `flatwire up` takes -> the services that have it -> its field there: every field of
    their configs but the addresses, which are the launcher's (UpConfig's fields and WIRING)."""
    own = {field.name for field in dataclasses.fields(UpConfig)} | WIRING
    options: dict[str, dict[str, dataclasses.Field]] = {}
    for service, cls in SERVICES.items():
        for field in dataclasses.fields(cls):
            if field.name not in own:
                options.setdefault(field.name, {})[service] = field
    return options


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_option(group: argparse._ArgumentGroup, name: str, help_text: str, default: str | None, kind: Any,
                aliases: tuple[str, ...] = ()) -> None:
    """A flag as parse_config makes it (with its aliases): the raw value, None when not given; a boolean flag alone
    means true."""
    is_bool = kind in (bool, bool | None)
    group.add_argument(*map(_flag, (name, *aliases)), dest=name, default=None, metavar=name.upper(),
                       help=flag_help(name, help_text, default), nargs="?" if is_bool else None,
                       const="true" if is_bool else None)


def parse_up(argv: list[str] | None, prog: str | None) -> tuple[UpConfig, dict[str, list[str]], dict[str, str]]:
    """The launcher's config; each service's options given, as its flags; the secrets given, as variables."""
    options = service_options()
    parser = argparse.ArgumentParser(
        prog=prog, description=UpConfig.__doc__,
        epilog="Each service option goes to the services its group names, as their flag. Precedence: the flag, "
               "then the FLATWIRE_* variable (which the services read themselves), then the default. "
               f"{', '.join(sorted(map(_flag, SECRETS)))} reach the services in their environment, not on their "
               "command lines.")
    own = parser.add_argument_group("flatwire up's own options")
    for field in dataclasses.fields(UpConfig):
        _add_option(own, field.name, field.metadata["help"], shown_default(field), field.type)
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for name, fields in options.items():
        services = tuple(fields)
        if services not in groups:
            title = "all three services" if len(services) == len(SERVICES) else " and ".join(services)
            groups[services] = parser.add_argument_group(f"{title} (options passed on)")
        helps = {service: field.metadata["help"] for service, field in fields.items()}
        help_text = (next(iter(helps.values())) if len(set(helps.values())) == 1
                     else "; ".join(f"{service}: {text}" for service, text in helps.items()))
        defaults = {shown_default(field) for field in fields.values()}
        default = defaults.pop() if len(defaults) == 1 else None  # the services' helps say theirs
        field = next(iter(fields.values()))
        _add_option(groups[services], name, help_text, default, field.type, field.metadata.get("aliases", ()))
    given = {name: value for name, value in vars(parser.parse_args(argv)).items() if value is not None}
    config = parse_config(UpConfig, [f"{_flag(name)}={value}" for name, value in given.items()
                                     if name not in options], prog)
    flags = {service: [f"{_flag(name)}={value}" for name, value in given.items()
                       if service in options.get(name, {}) and name not in SECRETS] for service in SERVICES}
    return config, flags, {env_name(name): given[name] for name in SECRETS & given.keys()}


@dataclass
class Supervised:
    """One child service, restarted with exponential backoff when it exits."""

    name: str
    command: list[str]
    backoff_s: float
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while the service is down, waiting to be restarted

    def start(self) -> subprocess.Popen:
        self.proc = subprocess.Popen(self.command, preexec_fn=_as_child_of(os.getpid()))
        self.started_at = time.monotonic()
        self.restart_at = None
        return self.proc

    def supervise(self, config: UpConfig) -> None:
        """Schedule a restart if the service has exited; do it once the delay is over."""
        now = time.monotonic()
        assert self.proc is not None, "supervised before it was started"
        if self.restart_at is not None:
            if now >= self.restart_at:
                print(f"flatwire up: restarting {self.name}", file=sys.stderr, flush=True)
                self.start()
        elif self.proc.poll() is not None:
            if now - self.started_at >= config.restart_reset_s:
                self.backoff_s = config.restart_delay_s
            print(f"flatwire up: {self.name} exited with code {self.proc.returncode}; "
                  f"restarting it in {self.backoff_s:g} s", file=sys.stderr, flush=True)
            self.restart_at = now + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, config.restart_max_delay_s)


def _as_child_of(launcher: int) -> Callable[[], None]:
    """What a service runs before its command: Ctrl-C (the terminal signals the whole process group) is left to
    the launcher, which stops the services in order; and the launcher's death (kill -9, the OOM killer) stops it
    too (SIGTERM, Linux's parent-death signal), rather than leaving it serving on the ports."""

    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it died before the signal was set
            raise RuntimeError("flatwire up is gone")

    return setup


def _stop(services: list[Supervised], drain_timeout_s: float) -> None:
    """The gateways first, and only once they have drained (their requests need the other two to finish) the
    detokenizer and the scheduler; a second Ctrl-C meanwhile ends the drain (the gateways' second signal)."""
    gateways = [s.proc for s in services if s.name.startswith("gateway") and s.proc is not None]
    others = [s.proc for s in services if not s.name.startswith("gateway") and s.proc is not None]
    for group, timeout in ((gateways, drain_timeout_s + STOP_TIMEOUT_S), (others, STOP_TIMEOUT_S)):
        running = [proc for proc in group if proc.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in running:
            while True:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                except KeyboardInterrupt:
                    for other in running:
                        if other.poll() is None:
                            other.terminate()
                    continue
                break


def internal_ports(config: UpConfig) -> tuple[int, int]:
    """The scheduler's and detokenizer's ports: as configured, else free loopback ports the kernel picks
    (both held until both are picked, so they differ)."""
    with ExitStack() as held:
        scheduler, detokenizer = (port if port is not None else _hold_free_port(held)
                                  for port in (config.scheduler_port, config.detokenizer_port))
    return scheduler, detokenizer


def _hold_free_port(held: ExitStack) -> int:
    sock = held.enter_context(socket.socket())
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


class StartupFailed(Exception):
    """The pipeline did not come up; the message says which service, and where to look."""


def _wait(check, what: str, services: list[Supervised], deadline: float) -> None:
    while not check():
        for service in services:
            assert service.proc is not None, "waited on before it was started"
            if (code := service.proc.poll()) is not None:
                raise StartupFailed(f"{service.name} exited with code {code} while waiting for {what} (its log above "
                                    "says why)")
        if time.monotonic() > deadline:
            raise StartupFailed(f"{what} not ready within --startup-timeout-s")
        time.sleep(0.25)


def _listening(port: int) -> int:
    """TCP sockets listening on `port` on this host (/proc/net/tcp and tcp6: state 0A)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        count += sum(1 for row in rows if (fields := row.split())[3] == "0A"
                     and int(fields[1].rsplit(":", 1)[1], 16) == port)
    return count


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _service_config(service: str, flags: list[str], prog: str | None) -> ServiceConfig:
    """The service's config as it will read it: these flags, its variables, its defaults."""
    try:
        return parse_config(SERVICES[service], flags, f"{prog or 'flatwire up'} ({service})")
    except ValueError as exc:
        sys.exit(f"{prog or 'flatwire up'}: {service}: {exc}")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    config, flags, secret_env = parse_up(argv, prog)
    os.environ.update(secret_env)
    # A bad option is refused now, before the model is built.
    configs = {service: _service_config(service, flags[service], prog) for service in SERVICES}
    shared = configs["scheduler"]  # for the options all three share (ServiceConfig's)
    # A port another server holds is refused before anything starts: the gateway would exit, while that server's
    # /health answered the launcher as if the gateway had come up.
    for port, what in ((config.port, "HTTP port"), (config.grpc_port, "gRPC port")):
        if port_taken(config.host, port):
            sys.exit(f"{prog or 'flatwire up'}: the gateway's {what} {port} is taken: another process listens on "
                     f"{config.host}:{port}")
    # Ctrl-C or `kill`: both stop the three services. Set explicitly, since a shell that starts
    # us in the background leaves SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    model_dir = resolve_model(shared.model, shared.cache_dir)
    # The services get a configured --model as given, so that a Hub model keeps its id as its name, and resolve it
    # offline: from the cache it was just fetched into, the revision fetched here, never waiting on the Hub
    # (restarts too). The default model they get by the path it was built at.
    os.environ["HF_HUB_OFFLINE"] = "1"
    model = [] if shared.model else ["--model", str(model_dir)]
    # The internal hops use a secret of this run unless one is configured, so that no other local process can
    # call the internal ports.
    if not (shared.internal_secret or shared.internal_secret_file):
        os.environ[env_name("internal_secret")] = secrets.token_urlsafe(32)
    scheduler_port, detokenizer_port = internal_ports(config)
    scheduler = f"127.0.0.1:{scheduler_port}"
    detokenizer = f"127.0.0.1:{detokenizer_port}"
    commands = {
        "scheduler": ["--host", "127.0.0.1", "--port", str(scheduler_port)],
        "detokenizer": ["--host", "127.0.0.1", "--port", str(detokenizer_port), "--schedulers", scheduler],
        "gateway": ["--host", config.host, "--port", str(config.port), "--grpc-port", str(config.grpc_port),
                    "--schedulers", scheduler, "--detokenizers", detokenizer],
    }
    if config.gateway_workers > 1:
        commands["gateway"].append("--reuse-port")
    services = [Supervised(name, [sys.executable, "-m", "services", name, *args, *model, *flags[name]],
                           config.restart_delay_s) for name, args in commands.items()]
    services += [Supervised(f"gateway-{worker}", services[-1].command, config.restart_delay_s)
                 for worker in range(2, config.gateway_workers + 1)]
    deadline = time.monotonic() + config.startup_timeout_s
    gateway_tls = configs["gateway"].tls
    http = f"http{'s' if gateway_tls.public else ''}://{'127.0.0.1' if config.host == '0.0.0.0' else config.host}:" \
           f"{config.port}"
    # Its own children on loopback: their certificate need not name 127.0.0.1.
    own = ssl._create_unverified_context() if gateway_tls.public else None  # noqa: S323
    internal, name = shared.tls.checking_channel(), shared.tls.server_name
    try:
        for service in services:
            service.start()
        _wait(lambda: check_health(scheduler, 2.0, internal, name), "the scheduler", services, deadline)
        _wait(lambda: check_health(detokenizer, 2.0, internal, name), "the detokenizer", services, deadline)
        _wait(lambda: http_ok(f"{http}/health", 2, own), "the gateway", services, deadline)
        if config.gateway_workers > 1:  # each worker binds the shared ports once it serves
            _wait(lambda: _listening(config.port) >= config.gateway_workers, "every gateway worker", services,
                  deadline)
        print(f"\nflatwire is up (model {model_name(shared.model, model_dir)} from {model_dir})\n"
              f"  HTTP  {http}  (POST /generate, /v1/chat/completions, /v1/completions; GET /v1/models, /metrics)\n"
              f"  gRPC  {config.host}:{config.grpc_port}  (flatwire.v1.Generation)\n"
              f"  Ctrl-C stops all three (the gateway drains first); a service that crashes is restarted.\n",
              flush=True)
        while True:
            for service in services:
                service.supervise(config)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except StartupFailed as exc:
        sys.exit(f"{prog or 'flatwire up'}: {exc}")  # once `finally` has stopped the others
    finally:
        gateway_config = configs["gateway"]
        assert isinstance(gateway_config, GatewayConfig)
        _stop(services, gateway_config.drain_timeout_s)
