"""gRPC plumbing shared by the services: servers, channels, health, limits.

gRPC's default 4 MiB receive limit is far below a long prompt's top-k (32k x 128
is 33 MB), so every server and channel here raises both limits to the configured
size (DESIGN.md, wire rule 4).
"""

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

DEFAULT_MAX_MESSAGE_MB = 1024


def message_options(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        # Long-lived step streams: keep idle connections alive and notice dead peers.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A restarted peer should be found again within seconds, not gRPC's default two minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def create_server(max_message_mb: int) -> grpc.aio.Server:
    # Accept the clients' keepalive pings (above) instead of answering GOAWAY too_many_pings.
    return grpc.aio.server(options=[*message_options(max_message_mb),
                                    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)])


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard health checking (every service SERVING) and reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def mark_serving(servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def create_channel(address: str, max_message_mb: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=message_options(max_message_mb))


def check_health(address: str, timeout: float = 2.0) -> bool:
    """True when the server at `address` answers SERVING (blocking; for CLIs and probes)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
