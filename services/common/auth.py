"""Authentication on flatwire's gRPC hops: a shared secret inside, an API key on the public API.

Internal hops (gateway -> scheduler, gateway -> detokenizer, detokenizer -> scheduler): with
`--internal-secret` (FLATWIRE_INTERNAL_SECRET) set, every call carries it as `x-flatwire-secret`
metadata (client interceptors on create_channel's channels) and the scheduler and detokenizer
refuse any call without it with UNAUTHENTICATED (a server interceptor on create_server's servers).
`--internal-secret-file` reads it from a file instead, which is created with a random secret when
missing: services that share a volume agree on one secret with no configuration.

The gateway's public gRPC API, with `--api-key`: `authorization: Bearer KEY` metadata, as for HTTP.
Its admin operations (rollout control) follow `--admin-api-key` when it is set (AccessKeys).

The standard health service (grpc.health.v1.Health) stays open everywhere: container
healthchecks and Kubernetes' gRPC probes cannot send metadata, and it tells nothing about
requests. Secrets are compared in constant time.
"""

import hmac
import logging
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

SECRET_METADATA = "x-flatwire-secret"
AUTHORIZATION_METADATA = "authorization"
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})


def secret_matches(given: str | bytes | None, expected: str) -> bool:
    """Constant-time comparison (the time depends on the length only)."""
    if given is None:
        return False
    if isinstance(given, str):
        given = given.encode("utf-8", "surrogatepass")  # never raises, whatever a client sent
    return hmac.compare_digest(given, expected.encode("utf-8", "surrogatepass"))


def bearer_token(authorization: str | bytes | None) -> str | bytes | None:
    """The token of `Bearer TOKEN` (scheme case-insensitive, RFC 6750), else None; bytes for bytes."""
    if not authorization:
        return None
    stripped = authorization.strip()
    scheme, _, token = stripped.partition(b" ") if isinstance(stripped, bytes) else stripped.partition(" ")
    return token.strip() if scheme.lower() in ("bearer", b"bearer") else None


@dataclass(frozen=True)
class AccessKeys:
    """The gateway's keys, with SGLang's semantics (its api_key and admin_api_key): the API key, when set, opens
    every operation but the admin ones; the admin key, when set, is the only key that opens the admin ones
    (without it they need the API key, like the rest; with neither, everything is open)."""

    api_key: str | None = None
    admin_api_key: str | None = None

    @property
    def any(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def allows(self, token: str | bytes | None, admin: bool) -> bool:
        """Whether a Bearer `token` opens an admin (or an ordinary) operation."""
        expected = (self.admin_api_key if admin else None) or self.api_key
        return not expected or secret_matches(token, expected)


def load_internal_secret(secret: str | None, secret_file: str | None) -> str | None:
    """The internal secret: `secret` when set; else the file's content, creating the file with a
    random secret when it does not exist (atomically: replicas starting at once agree on one)."""
    if secret or not secret_file:
        return secret or None
    path = Path(secret_file)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
            try:
                os.link(temporary, path)  # fails if another process created it first: its secret wins
            except FileExistsError:
                pass
        finally:
            temporary.unlink(missing_ok=True)
    value = path.read_text().strip()
    if not value:
        raise ValueError(f"--internal-secret-file: {path} is empty")
    return value


def is_loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def resolve_internal_secret(config, log: logging.Logger, internal_server: bool = True) -> None:
    """Set config.internal_secret from --internal-secret-file if needed. An internal server that would listen
    beyond loopback without one (anyone who reaches its port could read or end any request) exits, unless
    --allow-no-secret, and then says so."""
    config.internal_secret = load_internal_secret(config.internal_secret, config.internal_secret_file)
    if internal_server and not config.internal_secret and not is_loopback(config.host):
        if not config.allow_no_secret:
            raise SystemExit(f"--host {config.host}: listening beyond loopback needs an internal secret "
                             "(FLATWIRE_INTERNAL_SECRET or --internal-secret-file, the same on every service), or "
                             "--allow-no-secret to leave the internal hops unauthenticated")
        log.warning("no internal secret (FLATWIRE_INTERNAL_SECRET) while listening on %s: internal hops are "
                    "unauthenticated (--allow-no-secret)", config.host)


# -- servers ----------------------------------------------------------------------------------------------


def _metadata_value(metadata: Iterable | None, key: str) -> str | bytes | None:
    for name, value in metadata or ():
        if name == key:
            return value
    return None


def _refusal(message: str) -> grpc.RpcMethodHandler:
    """Ends any call with UNAUTHENTICATED. Declared stream-stream, so the server neither waits for nor
    decodes the request: the status alone ends a call of every kind on the client's side."""
    async def refuse(request_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return grpc.stream_stream_rpc_method_handler(refuse)


class MetadataAuth(grpc.aio.ServerInterceptor):
    """Serves a call only when `check` accepts its `key` metadata (or its service is open)."""

    def __init__(self, key: str, check: Callable[[str | bytes | None], bool], message: str,
                 open_services: frozenset[str] = OPEN_SERVICES):
        self._key = key
        self._check = check
        self._open = open_services
        self._refusal = _refusal(message)

    async def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").rpartition("/")[0]
        if service in self._open or self._check(_metadata_value(handler_call_details.invocation_metadata,
                                                                self._key)):
            return await continuation(handler_call_details)
        return self._refusal


def internal_secret_interceptor(secret: str) -> MetadataAuth:
    return MetadataAuth(SECRET_METADATA, lambda given: secret_matches(given, secret),
                        f"missing or wrong internal secret ({SECRET_METADATA} metadata): every flatwire service "
                        "needs the same FLATWIRE_INTERNAL_SECRET")


class PublicApiAuth(grpc.aio.ServerInterceptor):
    """The public API's keys (AccessKeys): `admin_methods` (full names, /package.Service/Method) are admin."""

    def __init__(self, keys: AccessKeys, admin_methods: frozenset[str]):
        self._keys = keys
        self._admin_methods = admin_methods
        self._refusals = {False: _refusal("missing or wrong API key: send `authorization: Bearer <key>` metadata"),
                          True: _refusal("missing or wrong admin API key: send `authorization: Bearer <admin key>` "
                                         "metadata (the gateway's --admin-api-key)")}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        admin = method in self._admin_methods
        if method.lstrip("/").rpartition("/")[0] in OPEN_SERVICES or self._keys.allows(
                bearer_token(_metadata_value(handler_call_details.invocation_metadata, AUTHORIZATION_METADATA)),
                admin):
            return await continuation(handler_call_details)
        return self._refusals[admin]


def server_interceptors(internal_secret: str | None = None, access: AccessKeys | None = None,
                        admin_methods: frozenset[str] = frozenset()) -> list[grpc.aio.ServerInterceptor]:
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if internal_secret:
        interceptors.append(internal_secret_interceptor(internal_secret))
    if access is not None and access.any:
        interceptors.append(PublicApiAuth(access, admin_methods))
    return interceptors


# -- channels ---------------------------------------------------------------------------------------------


class _AddMetadata:
    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self._pairs = pairs

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *self._pairs))


class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def metadata_interceptors(pairs: Iterable[tuple[str, str]]) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors adding `pairs` to every call, of every kind (an aio channel files each
    interceptor under one kind only, hence four)."""
    pairs = tuple(pairs)
    return [_UnaryUnary(pairs), _UnaryStream(pairs), _StreamUnary(pairs), _StreamStream(pairs)]


def internal_secret_interceptors(secret: str) -> list[grpc.aio.ClientInterceptor]:
    return metadata_interceptors([(SECRET_METADATA, secret)])


class _BlockingUnaryUnary(_AddMetadata, grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = (*(client_call_details.metadata or ()), *self._pairs)
        return continuation(client_call_details._replace(metadata=metadata), request)


def blocking_internal_secret_interceptor(secret: str) -> grpc.UnaryUnaryClientInterceptor:
    """internal_secret_interceptors for a blocking channel, whose only calls are unary (SubmitBatch)."""
    return _BlockingUnaryUnary(((SECRET_METADATA, secret),))
