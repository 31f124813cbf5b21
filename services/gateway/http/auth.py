"""The gateway's keys on HTTP (services/common/auth.py AccessKeys: SGLang's api_key and admin_api_key).

--api-key: every route but /health needs `Authorization: Bearer KEY` (as the OpenAI client sends it).
--admin-api-key: the admin routes (ADMIN_PATHS: rollout control, SGLang's and vLLM's, and LoRA adapters) need it,
and no other key opens them; without it they need the API key like the rest. /abort_request serves both kinds:
either key passes here, and the route itself asks for the admin key when the body says abort_all (require_admin).
Anything else is answered 401 in the OpenAI error shape, with `WWW-Authenticate: Bearer`, before the
body is read. A plain ASGI middleware, outermost, so that it also covers /metrics, /openapi.json and
unknown paths, and costs no extra task per request.
"""

from fastapi import Request, Response

from services.common.auth import AccessKeys, bearer_token
from services.gateway.http.errors import error_response

OPEN_PATHS = frozenset({"/health"})
ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor", "/pause_generation",
                         "/continue_generation", "/update_weight_version", "/flush_cache",
                         "/init_weights_update_group", "/update_weights_from_distributed",
                         "/destroy_weights_update_group", "/release_memory_occupation",
                         "/resume_memory_occupation", "/begin_weight_update", "/end_weight_update",
                         "/weights_checker", "/post_process_weights",
                         # vLLM's (http/vllm_rl.py)
                         "/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping",
                         "/reset_prefix_cache", "/update_weights", "/weight_info",
                         # LoRA adapters, SGLang's and vLLM's (http/lora.py)
                         "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
                         "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
MIXED_PATHS = frozenset({"/abort_request"})  # one request by rid (ordinary), or abort_all (admin)


def _token(headers) -> bytes | str | None:
    for name, value in headers:
        if name == b"authorization":
            return bearer_token(value)
    return None


def unauthorized(admin: bool) -> Response:
    which = "admin API key: send `Authorization: Bearer <admin key>`" if admin else \
        "API key: send `Authorization: Bearer <key>`"
    return error_response(401, f"Incorrect or missing {which}", code="invalid_api_key",
                          headers={"WWW-Authenticate": 'Bearer realm="flatwire"'})


def require_admin(request: Request, keys: AccessKeys) -> Response | None:
    """A route's own check for an admin use of a MIXED_PATHS route: the 401 to answer, or None."""
    return None if keys.allows(_token(request.scope["headers"]), admin=True) else unauthorized(admin=True)


class ApiKeyMiddleware:
    def __init__(self, app, keys: AccessKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        path, token = scope["path"], _token(scope["headers"])
        admin = path in ADMIN_PATHS
        if path in MIXED_PATHS:
            allowed = self.keys.allows(token, admin=False) or self.keys.allows(token, admin=True)
        else:
            allowed = self.keys.allows(token, admin)
        if allowed:
            await self.app(scope, receive, send)
            return
        await unauthorized(admin)(scope, receive, send)
