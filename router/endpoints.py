"""The HTTP endpoints FastAPI calls (`router.http.create_app` registers them).

They are module functions that find the app's `OpenAIApp` on the request, never its bound
methods: FastAPI caches each endpoint's signature in module-level LRU caches keyed on the
callable (fastapi.dependencies.models, 4096 entries), where a bound method would keep its
router, and any workers hosted in the process, alive after the app is gone."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from fastapi import Request, Response


class OpenAIApp(Protocol):
    """What the endpoints call (`router.http.OpenAIApp`; not imported: it imports this)."""

    async def completions(self, request: Request) -> Response: ...
    async def chat_completions(self, request: Request) -> Response: ...
    async def models(self, request: Request) -> Response: ...
    async def model_card(self, request: Request, model_id: str) -> Response: ...
    async def tokenize(self, request: Request) -> Response: ...
    async def detokenize(self, request: Request) -> Response: ...
    async def health(self) -> Response: ...
    async def version(self) -> Response: ...
    async def metrics_text(self) -> Response: ...
    async def pool_status(self, request: Request) -> Response: ...
    async def pool_change(self, request: Request, op: str) -> Response: ...


def _oa(request: Request) -> OpenAIApp:
    oa: OpenAIApp = request.app.state.openai
    return oa


async def completions(request: Request) -> Response:
    return await _oa(request).completions(request)


async def chat_completions(request: Request) -> Response:
    return await _oa(request).chat_completions(request)


async def models(request: Request) -> Response:
    return await _oa(request).models(request)


async def model_card(request: Request, model_id: str) -> Response:
    return await _oa(request).model_card(request, model_id)


async def tokenize(request: Request) -> Response:
    return await _oa(request).tokenize(request)


async def detokenize(request: Request) -> Response:
    return await _oa(request).detokenize(request)


async def health(request: Request) -> Response:
    return await _oa(request).health()


async def version(request: Request) -> Response:
    return await _oa(request).version()


async def metrics_text(request: Request) -> Response:
    return await _oa(request).metrics_text()


async def pool_status(request: Request) -> Response:
    return await _oa(request).pool_status(request)


def pool_change(op: str) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint of `POST /v1/admin/pool/<op>` (one module-level function per op)."""
    return _POOL_CHANGES[op]


async def _pool_add(request: Request) -> Response:
    return await _oa(request).pool_change(request, "add")


async def _pool_drain(request: Request) -> Response:
    return await _oa(request).pool_change(request, "drain")


async def _pool_flip(request: Request) -> Response:
    return await _oa(request).pool_change(request, "flip")


_POOL_CHANGES = {"add": _pool_add, "drain": _pool_drain, "flip": _pool_flip}
