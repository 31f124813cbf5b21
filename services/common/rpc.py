"""gRPC plumbing shared by the services: servers, channels, health, limits.

gRPC's default 4 MiB receive limit is far below a long prompt's top-k (32k x 128
is 33 MB), so every channel here raises both limits to `max_message_mb`, as does a
server for what it sends (step streams). What a server receives is only ever a
request (a prompt of max_context ids, a text within the gateway's body limit, stop
strings), so servers take at most `max_receive_mb` (--max-request-mb, 32 MiB by
default): a larger message is refused with RESOURCE_EXHAUSTED as its length arrives,
before it is buffered, instead of under the 1 GiB that steps need.

Keepalive: every channel pings its server every `keepalive_s` (with or without calls,
so a dead peer of an idle step stream is noticed), and every server permits pings
twice that often. A server that permitted less would answer GOAWAY too_many_pings
after a few pings and cut the long-lived streams.

Authentication (services/common/auth.py): `internal_secret` makes a server refuse calls without
the shared secret and a channel send it; `access` (the gateway's public server: its API and admin
keys) requires `authorization: Bearer KEY`. Health stays open; reflection is on the public server only.
"""

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import auth
from services.common.undecodable import RefuseUndecodable

DEFAULT_MAX_MESSAGE_MB = 1024
DEFAULT_KEEPALIVE_S = 20.0
# Calls a server has received that no handler has taken yet. Past the soft limit gRPC cancels new
# ones at random, past the hard one all of them; its defaults (1000, 3000) cancel part of any burst
# of a few thousand unary calls, such as a client's big batch of Submits.
MAX_PENDING_CALLS = 16384


def message_options(max_message_mb: int, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                    max_receive_mb: int | None = None) -> list[tuple[str, int]]:
    """`max_receive_mb` (default: max_message_mb) bounds what this end receives."""
    limit = max_message_mb * 1024 * 1024
    keepalive_ms = max(int(keepalive_s * 1000), 1)
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", (max_receive_mb or max_message_mb) * 1024 * 1024),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", max(keepalive_ms // 2, 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A restarted peer should be found again within half a second, not gRPC's default two minutes: requests
        # wait for it only up to the gateway's hop timeout. Every channel to one address shares this backoff (gRPC
        # pools connections process-wide), so a consumer that resubscribes on a fresh channel waits it out too.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]


def create_server(max_message_mb: int, keepalive_s: float = DEFAULT_KEEPALIVE_S, *,
                  internal_secret: str | None = None, access: auth.AccessKeys | None = None,
                  admin_methods: frozenset[str] = frozenset(), max_receive_mb: int | None = None,
                  reuse_port: bool = False) -> grpc.aio.Server:
    """With `internal_secret` or the keys of `access`, every call but health's must carry one (see auth.py;
    `admin_methods` need the admin key when there is one). `max_receive_mb`: the largest request message
    taken (default: max_message_mb). `reuse_port`: several processes may serve one port (gateway workers)."""
    interceptors = auth.server_interceptors(internal_secret=internal_secret, access=access,
                                            admin_methods=admin_methods)
    interceptors.append(RefuseUndecodable())  # innermost: undecodable payloads -> INVALID_ARGUMENT
    return grpc.aio.server(interceptors=interceptors or None, options=[
        *message_options(max_message_mb, keepalive_s, max_receive_mb),
        # The clients' pings (above) come every keepalive_s, data or not: permit twice as many.
        ("grpc.http2.min_ping_interval_without_data_ms", max(int(keepalive_s * 500), 1)),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
        # Off unless asked: with it a second server on a taken port binds too, and the kernel splits the calls
        # between them.
        ("grpc.so_reuseport", int(reuse_port)),
    ])


def listen(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> None:
    """Bind `address` (with `credentials`: TLS, tls.py), or stop the process with why: a port another process
    holds is a startup error."""
    try:
        if credentials is None:
            server.add_insecure_port(address)
        else:
            server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise SystemExit(f"cannot listen on {address}: {exc} (another server holds the port?)") from None


def add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """Standard health checking (mark_serving sets the services SERVING)."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Health and reflection: for the public server only (reflection would list internal APIs)."""
    servicer = add_health(server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def mark_serving(servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def _channel_options(max_message_mb: int, keepalive_s: float, credentials: grpc.ChannelCredentials | None,
                     server_name: str | None) -> list[tuple[str, int | str]]:
    options: list[tuple[str, int | str]] = [*message_options(max_message_mb, keepalive_s)]
    if credentials is not None and server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def create_channel(address: str, max_message_mb: int, keepalive_s: float = DEFAULT_KEEPALIVE_S, *,
                   internal_secret: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                   server_name: str | None = None) -> grpc.aio.Channel:
    """With `internal_secret`, every call on the channel carries it (see auth.py); with `credentials`, TLS, the
    server's certificate checked for `server_name` (default: the address's host)."""
    interceptors = auth.internal_secret_interceptors(internal_secret) if internal_secret else None
    options = _channel_options(max_message_mb, keepalive_s, credentials, server_name)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def create_blocking_channel(address: str, max_message_mb: int, keepalive_s: float = DEFAULT_KEEPALIVE_S, *,
                            internal_secret: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                            server_name: str | None = None) -> grpc.Channel:
    """create_channel's blocking twin: a call on it is started by the calling thread (gRPC's C core sends it then)
    and answered on gRPC's own thread, not in an event loop's turn."""
    options = _channel_options(max_message_mb, keepalive_s, credentials, server_name)
    channel = (grpc.insecure_channel(address, options=options) if credentials is None
               else grpc.secure_channel(address, credentials, options=options))
    if internal_secret:
        channel = grpc.intercept_channel(channel, auth.blocking_internal_secret_interceptor(internal_secret))
    return channel


def internal_channel(address: str, config, name: str | None = None) -> grpc.aio.Channel:
    """A channel to a scheduler or detokenizer with what a service's config (ServiceConfig) says: message limits,
    keepalive, the internal secret, mutual TLS. `name`: the configured host `address` was resolved from (a DNS
    name of several replicas): what their certificates name."""
    return create_channel(address, **_internal(config, name))


def internal_blocking_channel(address: str, config, name: str | None = None) -> grpc.Channel:
    """internal_channel's blocking twin (create_blocking_channel)."""
    return create_blocking_channel(address, **_internal(config, name))


def _internal(config, name: str | None) -> dict:
    tls = config.tls
    return {"max_message_mb": config.max_message_mb, "keepalive_s": config.keepalive_s,
            "internal_secret": config.internal_secret, "credentials": tls.internal_channel(),
            "server_name": tls.server_name or name}


def check_health(address: str, timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None) -> bool:
    """True when the server at `address` answers SERVING (blocking; for CLIs and probes; `credentials`: TLS, the
    certificate checked for `server_name`, default the address's host)."""
    return health_problem(address, timeout, credentials, server_name) is None


def health_problem(address: str, timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None,
                   server_name: str | None = None) -> str | None:
    """Why the server at `address` is not healthy (its status, or the call's error); None when it is SERVING."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    with (grpc.secure_channel(address, credentials, options=options) if credentials is not None
          else grpc.insecure_channel(address)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None
