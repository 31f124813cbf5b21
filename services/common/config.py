"""Typed service configuration, settable by CLI flag and environment variable.

Each service declares one dataclass; every field becomes a flag (`--max-top-logprobs`)
and an environment variable (`FLATWIRE_MAX_TOP_LOGPROBS`). Precedence: flag, then
environment, then the dataclass default. List fields take comma-separated values.
"""

import argparse
import dataclasses
import os
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from services.common.tls import TlsFiles

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "FLATWIRE_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
T = TypeVar("T", bound="DataclassInstance")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _base_type(annotation: Any) -> Any:
    """int | None -> int; list[str] -> list."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_origin(annotation) or annotation


def _parse(annotation: Any, raw: str) -> Any:
    kind = _base_type(annotation)
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if kind is list:
        return [item.strip() for item in raw.split(",") if item.strip()]
    return kind(raw)


def parse_config(cls: type[T], argv: list[str] | None = None, prog: str | None = None) -> T:
    """Build `cls` from flags, environment variables and defaults."""
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    for field in dataclasses.fields(cls):
        help_text = field.metadata.get("help", "")
        # A boolean flag alone means true (`--incremental-streaming-output`); a value still sets it either way.
        is_bool = _base_type(hints[field.name]) is bool
        parser.add_argument(*flags_of(field), dest=field.name, default=None, metavar=field.name.upper(),
                            help=flag_help(field.name, help_text, shown_default(field)), nargs="?" if is_bool else None,
                            const="true" if is_bool else None)
    args = parser.parse_args(argv)
    values = {}
    for field in dataclasses.fields(cls):
        raw = getattr(args, field.name)
        if raw is None:
            raw = os.environ.get(env_name(field.name))
        if raw is not None:
            try:
                values[field.name] = _parse(hints[field.name], raw)
            except ValueError as exc:
                parser.error(f"--{field.name.replace('_', '-')}: {exc}")
    try:
        return cls(**values)
    except ValueError as exc:  # a check across options (__post_init__): said as argparse says its own
        parser.error(str(exc))


def flags_of(field: dataclasses.Field) -> list[str]:
    """A field's flag, then its aliases (another server's name for the same option: vLLM's --max-loras)."""
    return ["--" + name.replace("_", "-") for name in (field.name, *field.metadata.get("aliases", ()))]


def env_flag(name: str) -> bool:
    """Whether the environment variable `name` (another program's, such as SGLang's) is set to a true boolean;
    ValueError naming it when it is set to something else."""
    raw = os.environ.get(name, "")
    try:
        return bool(raw) and _parse(bool, raw)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def shown_default(field: dataclasses.Field) -> str | None:
    """A field's default as a flag would give it; None when there is none to show (None, "", [])."""
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, list):
        default = ",".join(map(str, default))
    return None if default is None or default == "" else str(default)


def flag_help(name: str, help_text: str, default: str | None) -> str:
    """A flag's --help line: its text, then its default and its variable."""
    shown = "" if default is None else f"default {default}; "
    return f"{help_text} [{shown}env {env_name(name)}]".replace("%", "%%")  # argparse formats help with %


def require_positive(config: Any, names: tuple[str, ...]) -> None:
    """Refuse a configuration whose named fields are not all above zero, naming the flag."""
    for name in names:
        if getattr(config, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be positive")


def require_ports(config: Any, names: tuple[str, ...]) -> None:
    """Each a TCP port (0: one the system picks): 70000 would otherwise listen on 70000 mod 65536."""
    for name in names:
        if getattr(config, name) is not None and not 0 <= getattr(config, name) <= 65535:
            raise ValueError(f"--{name.replace('_', '-')}: a port, 0 to 65535")


def option(default: Any, help: str, aliases: tuple[str, ...] = ()) -> Any:
    """A config field with its help text, and other flags for it (`aliases`: field-style names, without a variable
    of their own); mutable defaults are copied per instance."""
    metadata = {"help": help, "aliases": aliases}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class ServiceConfig:
    """Options every service has."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(0, "gRPC (or HTTP, for the gateway) port")
    model: str | None = option(None, "local Hugging Face checkpoint directory, or a Hub model id (Org/Name) from "
                               "the Hugging Face cache; default: the embedded default model")
    cache_dir: str | None = option(None, "where flatwire keeps what it builds: the default model, the "
                                     "vocabulary for structured output, the detokenizer's decoding tokenizer "
                                     "(default ~/.cache/flatwire)")
    max_message_mb: int = option(1024, "gRPC message limit in MiB of what servers send and channels send and "
                                 "receive: step streams carry up to --max-running-requests requests' logprob rows "
                                 "(each bounded by the gateway's --max-logprob-elements) in one message")
    max_request_mb: int = option(32, "largest request in MiB this service's server takes: a gRPC message (more is "
                                 "RESOURCE_EXHAUSTED) and, on the gateway, an HTTP body (more is 413)")
    keepalive_s: float = option(20.0, "gRPC keepalive ping interval of this service's channels; its server permits "
                                "pings twice as often (keep it equal on every service)")
    log_level: str = option("info", "logging level: debug, info, warning, error or critical")
    internal_secret: str | None = option(None, "shared secret of the internal hops: the scheduler and detokenizer "
                                         "refuse gRPC calls without it (health excepted) and every service sends "
                                         "it; the same on every service; prefer the environment variable to the "
                                         "flag (visible in ps)")
    internal_secret_file: str | None = option(None, "read the internal secret from this file when "
                                              "--internal-secret is unset; a missing file is created with a "
                                              "random secret (services sharing a volume agree on it)")
    ssl_keyfile: str | None = option(None, "this service's TLS private key (PEM; SGLang's and uvicorn's name): on the "
                                     "gateway, HTTPS and TLS on the public gRPC port; with --ssl-ca-certs, every "
                                     "service's identity on the internal hops (services/common/tls.py)")
    ssl_certfile: str | None = option(None, "the certificate (PEM chain) of --ssl-keyfile")
    ssl_ca_certs: str | None = option(None, "the CA certificates (PEM) that signed every service's certificate: "
                                      "mutual TLS on the internal hops (the scheduler and detokenizer serve only "
                                      "peers it signed; every service checks the server's name against it); the "
                                      "same on every service")
    ssl_server_name: str | None = option(None, "with --ssl-ca-certs: the name every internal server's certificate "
                                         "is checked for, whatever address is dialled (pods dialled by IP); "
                                         "default: the configured host (a DNS name of several replicas)")
    allow_no_secret: bool = option(False, "let a scheduler or detokenizer listen beyond loopback without an internal "
                                   "secret (refused otherwise: anyone who reaches its port could read or end any "
                                   "request)")

    def __post_init__(self):
        require_positive(self, ("max_message_mb", "max_request_mb", "keepalive_s"))
        require_ports(self, ("port",))
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"--log-level: one of {', '.join(LOG_LEVELS).lower()}, not {self.log_level!r}")
        _ = self.tls  # checked now: a key without its certificate is a startup error

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.ssl_keyfile or None, self.ssl_certfile or None, self.ssl_ca_certs or None,
                        self.ssl_server_name or None)
