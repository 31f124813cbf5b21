"""The gateway process: HTTP (uvicorn) and the public gRPC API in one event loop."""

import asyncio
import logging

import uvicorn
from grpc_health.v1 import health_pb2
from transformers import AutoTokenizer

from services.common.config import parse_config
from services.common.logs import setup_logging
from services.common.model_store import resolve_model
from services.common.rpc import add_health_and_reflection, create_server
from services.gateway.config import GatewayConfig
from services.gateway.engine import Engine
from services.gateway.grpc_api import SERVICE_NAME, add_generation_service
from services.gateway.http.app import create_app

log = logging.getLogger("flatwire.gateway")


async def _report_health(engine: Engine, servicer) -> None:
    """gRPC health follows the pipeline: SERVING only while every hop is connected."""
    last = None
    while True:
        status = (health_pb2.HealthCheckResponse.SERVING if engine.healthy()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status != last:
            for name in ("", SERVICE_NAME):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(0.25)


async def serve(config: GatewayConfig) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model, config.cache_dir))
    engine = Engine(config, tokenizer)
    await engine.start()

    grpc_server = create_server(config.max_message_mb, config.keepalive_s)
    add_generation_service(grpc_server, engine)
    health = add_health_and_reflection(grpc_server, [SERVICE_NAME])
    grpc_server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await grpc_server.start()
    health_task = asyncio.create_task(_report_health(engine, health))

    http = uvicorn.Server(uvicorn.Config(create_app(engine, config), host=config.host, port=config.port,
                                         log_level=config.log_level.lower(), access_log=False))
    log.info("gateway %s: HTTP on %s:%d, gRPC on %s:%d", engine.owner, config.host, config.port, config.host,
             config.grpc_port)
    try:
        await http.serve()  # returns on SIGINT/SIGTERM
    finally:
        health_task.cancel()
        await grpc_server.stop(grace=2)
        await engine.stop()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    config = parse_config(GatewayConfig, argv, prog)
    setup_logging(config.log_level, "gateway")
    asyncio.run(serve(config))
