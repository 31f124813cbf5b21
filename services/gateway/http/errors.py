"""Error responses, OpenAI-shaped on every route: {"error": {message, type, param, code}}."""

from collections.abc import Mapping
from http import HTTPStatus

import orjson
from fastapi import Response

from services.gateway.engine_client import RequestError
from services.gateway.protocol.parse import InvalidRequest

# nginx's "client closed request": nobody reads it, it marks the log line of a request whose client left.
CLIENT_CLOSED = 499
ENGINE_STATUS = {"invalid_argument": 400, "not_found": 404, "resource_exhausted": 429, "unavailable": 503,
                 "internal": 500}
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailableError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
               429: "RateLimitError"}
# Seconds a client refused by admission control (429) is told to wait: about a few steps' time.
RETRY_AFTER_S = 1


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(_body(status, message, param, code)), status_code=status, headers=headers,
                    media_type="application/json")


def _body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, HTTPStatus(status).phrase),
                      "param": param, "code": code if code is not None else status}}


def invalid_request_response(exc: InvalidRequest) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code)


def pipeline_error_response(exc: RequestError) -> Response:
    status = ENGINE_STATUS.get(exc.status, 500)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return error_response(status, exc.message, exc.field, headers=headers)


def error_body(exc: RequestError) -> dict:
    """pipeline_error_response's body, for a stream's error event."""
    return _body(ENGINE_STATUS.get(exc.status, 500), exc.message, exc.field)
