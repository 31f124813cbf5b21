"""The gateway's FastAPI app: SGLang /generate, OpenAI /v1/*, vLLM's /inference/v1/generate, SGLang's and vLLM's
rollout control, /health, /metrics."""

import asyncio
import logging
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EngineClient, RequestError
from services.gateway.http import (
    generate,
    loads,
    lora,
    native,
    openai_chat,
    openai_completions,
    rollout,
    vllm_generate,
    vllm_rl,
)
from services.gateway.http.auth import ApiKeyMiddleware
from services.gateway.http.context import Gateway, gateway_of
from services.gateway.http.errors import (
    CLIENT_CLOSED,
    error_response,
    invalid_request_response,
    pipeline_error_response,
)
from services.gateway.http.guards import RequestLimits
from services.gateway.http.openapi import add_request_schemas
from services.gateway.protocol.parse import InvalidRequest

log = logging.getLogger("flatwire.gateway")


def _report_warming(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("warming up failed", exc_info=task.exception())


def create_app(engine: EngineClient, config: GatewayConfig) -> FastAPI:
    gateway = Gateway(engine, config)
    gateway.metrics.watch_engine(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        warming = asyncio.create_task(asyncio.to_thread(gateway.warm_up))
        warming.add_done_callback(_report_warming)
        yield
        warming.cancel()

    app = FastAPI(title="flatwire gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    app.include_router(generate.router)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(native.router)
    app.include_router(loads.router)
    app.include_router(rollout.router)
    app.include_router(vllm_rl.router)
    app.include_router(vllm_generate.router)
    app.include_router(lora.router)
    add_request_schemas(app)  # the routes read raw bodies: declare them in /openapi.json

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> Response:
        gateway_of(request).metrics.errors.labels(request.url.path, str(exc.status)).inc()
        return invalid_request_response(exc)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> Response:
        response = pipeline_error_response(exc)
        gateway_of(request).metrics.errors.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _routing(request: Request, exc: StarletteHTTPException) -> Response:
        """An unknown path (404) or method (405, with Allow): the error shape of every other answer."""
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _left(request: Request, exc: ClientDisconnect) -> Response:
        """A client that closed before its body arrived or its answer was ready: counted, not a traceback in the
        log (the answer is never sent: 499 is what the access log and the metrics say of it)."""
        gateway_of(request).metrics.errors.labels(request.url.path, str(CLIENT_CLOSED)).inc()
        return Response(status_code=CLIENT_CLOSED)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while some scheduler's whole path (scheduler, detokenizer, stream to here) works, else 503;
        the body says, per scheduler, what is missing."""
        report = gateway_of(request).engine.health_report()
        return Response(orjson.dumps(report), status_code=200 if report["healthy"] else 503,
                        media_type="application/json")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = gateway_of(request).metrics
        return Response(registry.render(), media_type=registry.content_type)

    # Body size and read timeout, for every route (inside the API key check: nothing unauthenticated is read).
    app.add_middleware(RequestLimits, max_body_bytes=config.max_request_mb * 1024 * 1024,
                       body_timeout_s=config.http_body_timeout_s)
    if gateway.access.any:
        # Added last, so outermost: an unauthenticated request is refused before anything reads its body.
        app.add_middleware(ApiKeyMiddleware, keys=gateway.access)
    return app
