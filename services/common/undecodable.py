"""Requests whose payload does not decode: INVALID_ARGUMENT with a short message, no traceback.

grpc.aio decodes a unary request before any servicer code runs (a streamed one as the
servicer reads it), and a deserializer that raises ends the call with UNKNOWN
("Unexpected <class 'google.protobuf.message.DecodeError'>: ...") after logging an ERROR
with a traceback (its `_handle_exceptions`); no servicer or interceptor can catch that.

RefuseUndecodable, a server interceptor (the innermost one: an authentication refusal
comes first), hands grpc a copy of each method handler whose deserializer returns an
Undecodable marker instead of raising, and whose behavior answers that marker with
INVALID_ARGUMENT before the servicer sees it. Handlers that take raw bytes (no
deserializer) are left as they are.
"""

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from flatwire_wire.codec import WireValueError

log = logging.getLogger("flatwire.rpc")
_CACHE_LIMIT = 4096  # wrapped handlers kept (one per method; the bound only guards against odd handlers)


class Undecodable:
    """What a tolerant deserializer returns for bytes that are not a valid message."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _message_name(deserializer) -> str:
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "the request message"


def tolerant(deserializer):
    """`deserializer`, returning an Undecodable instead of raising."""
    name = _message_name(deserializer)

    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except WireValueError as exc:  # it decodes, but its twin cannot hold it (an unknown enum number)
            return Undecodable(f"{exc} in {name}")
        except Exception:  # DecodeError, or whatever a custom deserializer raises on bad bytes
            return Undecodable(f"request: {len(raw)} bytes that do not decode as {name}")

    return deserialize


async def _refuse(request: Undecodable, context) -> None:
    log.debug("refused an undecodable request: %s", request.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _unary_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """Guards a behavior that takes one request message."""
    guarded: Callable[..., Any]  # an async generator, a coroutine or a plain function, as the behavior is
    if inspect.isasyncgenfunction(behavior):
        async def guarded(request, context):
            if isinstance(request, Undecodable):
                await _refuse(request, context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
    elif inspect.iscoroutinefunction(behavior):
        async def guarded(request, context):
            if isinstance(request, Undecodable):
                await _refuse(request, context)
            return await behavior(request, context)
    else:  # a sync behavior (run in grpc's thread pool)
        def guarded(request, context):
            if isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return behavior(request, context)
    return guarded


async def _checked(requests, context):
    async for request in requests:
        if isinstance(request, Undecodable):
            await _refuse(request, context)
        yield request


def _stream_request(behavior: Callable[..., Any]) -> Callable[..., Any] | None:
    """Guards a behavior that reads a stream of requests (sync ones are left alone)."""
    guarded: Callable[..., Any]  # an async generator or a coroutine, as the behavior is
    if inspect.isasyncgenfunction(behavior):
        async def guarded(requests, context):
            async with contextlib.aclosing(behavior(_checked(requests, context), context)) as responses:
                async for response in responses:
                    yield response
        return guarded
    if inspect.iscoroutinefunction(behavior):
        async def guarded(requests, context):
            return await behavior(_checked(requests, context), context)
        return guarded
    return None


def guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A copy of `handler` that refuses undecodable requests with INVALID_ARGUMENT."""
    if handler is None or handler.request_deserializer is None or not hasattr(handler, "_replace"):
        return handler
    if handler.request_streaming:
        kind = "stream_stream" if handler.response_streaming else "stream_unary"
        behavior = _stream_request(getattr(handler, kind))
    else:
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = _unary_request(getattr(handler, kind))
    if behavior is None:
        return handler
    return handler._replace(request_deserializer=tolerant(handler.request_deserializer), **{kind: behavior})


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Every method's handler, guarded (see guard); each guarded copy is made once."""

    def __init__(self) -> None:
        self._guarded: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        entry = self._guarded.get(id(handler))
        if entry is None or entry[0] is not handler:
            if len(self._guarded) >= _CACHE_LIMIT:
                self._guarded.clear()
            entry = self._guarded[id(handler)] = (handler, guard(handler))
        return entry[1]
