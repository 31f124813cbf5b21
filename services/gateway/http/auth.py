"""--api-key on HTTP: every route but /health needs `Authorization: Bearer KEY` (as the OpenAI client
sends it); anything else is answered 401 in the OpenAI error shape, with `WWW-Authenticate: Bearer`,
before the body is read. A plain ASGI middleware, outermost, so that it also covers /metrics,
/openapi.json and unknown paths, and costs no extra task per request.
"""

from services.common.auth import bearer_token, secret_matches
from services.gateway.http.errors import error_response

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                                  code="invalid_api_key",
                                  headers={"WWW-Authenticate": 'Bearer realm="flatwire"'})
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return secret_matches(bearer_token(value), self.api_key)
        return False
