"""The gateway process: HTTP (uvicorn) and the public gRPC API in one event loop."""

import asyncio
import logging
import socket
import time

import uvicorn
from grpc_health.v1 import health_pb2

from services.common.auth import AccessKeys, is_loopback, resolve_internal_secret
from services.common.config import parse_config
from services.common.event_loop import run
from services.common.logs import setup_logging
from services.common.memory import freeze_heap, use_mmap_for_big_blocks
from services.common.model_store import resolve_model
from services.common.ports import port_taken
from services.common.rpc import add_health_and_reflection, create_server, listen
from services.common.tokenizer import load_tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.drain import Draining, HttpServer, serve_until_drained
from services.gateway.engine_client import EngineClient
from services.gateway.grpc_api import ADMIN_METHODS, SERVICE_NAME, add_generation_service
from services.gateway.http.app import create_app
from services.gateway.http.guards import with_timeouts

log = logging.getLogger("flatwire.gateway")
# After a drain, how long uvicorn may still take to close its connections before it cuts what is left on them.
SHUTDOWN_AFTER_DRAIN_S = 1  # uvicorn takes whole seconds
REUSE_PORT_JOIN_WAIT_S = 30  # a --reuse-port worker waits this long at most for its path before it listens


async def _report_health(engine: EngineClient, servicer) -> None:
    """gRPC health follows the engine: SERVING only while every hop is connected."""
    last = None
    while True:
        status = (health_pb2.HealthCheckResponse.SERVING if engine.healthy()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status != last:
            for name in ("", SERVICE_NAME):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(0.25)


async def _until_healthy(engine: EngineClient, most_s: float) -> None:
    """Until some scheduler's whole path to this gateway works, or `most_s` passed (then it serves anyway, and
    says it is unhealthy as any gateway would)."""
    deadline = time.monotonic() + most_s
    while not engine.healthy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def serve(config: GatewayConfig) -> None:
    if not config.reuse_port:  # said now, not once a scheduler has answered and the server binds
        for flag, port in (("--port", config.port), ("--grpc-port", config.grpc_port)):
            if port and port_taken(config.host, port):
                raise SystemExit(f"flatwire gateway: {flag} {port} is taken: another process listens on "
                                 f"{config.host}:{port}")
    resolve_internal_secret(config, log, internal_server=False)
    if not config.api_key and not is_loopback(config.host):
        log.warning("no API key (FLATWIRE_API_KEY) while listening on %s: the HTTP and gRPC APIs are open to "
                    "anyone who reaches them", config.host)
    tokenizer = load_tokenizer(resolve_model(config.model, config.cache_dir))
    engine = EngineClient(config, tokenizer)
    await engine.start()
    freeze_heap()  # the tokenizer's and the libraries' objects, kept for good: out of the collector's sight
    if config.reuse_port:  # the kernel hands connections to every listener on the port: join once this one serves
        await _until_healthy(engine, REUSE_PORT_JOIN_WAIT_S)

    grpc_server = create_server(config.max_message_mb, config.keepalive_s,
                                access=AccessKeys(config.api_key, config.admin_api_key), admin_methods=ADMIN_METHODS,
                                max_receive_mb=config.max_request_mb, reuse_port=config.reuse_port)
    add_generation_service(grpc_server, engine)
    health = add_health_and_reflection(grpc_server, [SERVICE_NAME])
    listen(grpc_server, f"{config.host}:{config.grpc_port}", config.tls.public_server())
    await grpc_server.start()
    health_task = asyncio.create_task(_report_health(engine, health))

    app = Draining(create_app(engine, config))
    protocol = with_timeouts(config.http, config.http_header_timeout_s, config.http_write_timeout_s)
    http = HttpServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                                     access_log=False, http=protocol, log_config=None,  # our log format
                                     timeout_graceful_shutdown=SHUTDOWN_AFTER_DRAIN_S,
                                     ssl_keyfile=config.tls.keyfile, ssl_certfile=config.tls.certfile))
    log.info("gateway %s: HTTP%s on %s:%d, gRPC%s on %s:%d", engine.owner, "S" if config.tls.public else "",
             config.host, config.port, " (TLS)" if config.tls.public else "", config.host, config.grpc_port)
    try:
        sockets = [shared_socket(config.host, config.port)] if config.reuse_port else None
        await serve_until_drained(http, app, grpc_server, engine, config.drain_timeout_s, sockets)  # to a signal
    finally:
        health_task.cancel()
        await grpc_server.stop(grace=0)  # already stopped, unless uvicorn failed
        await engine.stop()


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other processes may bind too (SO_REUSEPORT: --reuse-port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    config = parse_config(GatewayConfig, argv, prog)
    setup_logging(config.log_level, "gateway")
    use_mmap_for_big_blocks()  # big request buffers go back to the OS when freed (services/common/memory.py)
    run(serve(config), config.loop)
