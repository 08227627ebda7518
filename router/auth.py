"""The one API key (`router.api_key`, `--api-key`, env PDSERVE_API_KEY) for HTTP and gRPC.

HTTP sends ``Authorization: Bearer <key>``; gRPC sends the same as call metadata
(``authorization: Bearer <key>``). Health checks (HTTP /health, gRPC grpc.health.v1) and
gRPC reflection stay open. The key is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

# gRPC services that never need the key: probes and tooling.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
UNAUTHENTICATED_MESSAGE = "missing or invalid API key (send `authorization: Bearer <key>`)"


def bearer_ok(header: str | None, api_key: str | None) -> bool:
    """Whether an ``Authorization`` header value carries `api_key` (always, when no key)."""
    if not api_key:
        return True
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the key with UNAUTHENTICATED, before the handler runs."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        header = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key.lower() == "authorization":
                header = value if isinstance(value, str) else value.decode(errors="replace")
                break
        if bearer_ok(header, self._api_key):
            return handler
        return _denial(handler)


def _denial(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def api_key_interceptors(api_key: str | None) -> list[grpc.aio.ServerInterceptor]:
    return [ApiKeyInterceptor(api_key)] if api_key else []
