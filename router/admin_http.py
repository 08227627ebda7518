"""The pool admin over HTTP (`router.membership`; docs/operations.md):

- `GET /v1/admin/pool`: every worker, its role, state and load;
- `POST /v1/admin/pool/add` `{"role": "prefill"|"decode"}`;
- `POST /v1/admin/pool/drain` `{"worker": NAME, "bound_s": S?}`: drain, then stop it;
- `POST /v1/admin/pool/flip` `{"worker": NAME, "to": "prefill"|"decode", "bound_s": S?}`.

They sit under /v1, so they need the API key whenever one is set, like every /v1 route
(`OpenAIApp.authorize` runs first). A body is checked whole before anything changes: an
unknown or malformed field is a 400 naming it. An operation answers when it is done (a
drain waits for what the worker holds to end), with what it did.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi.responses import JSONResponse

from pool_api.messages import Role
from router.membership import DEFAULT_DRAIN_BOUND_S, PoolAdmin, PoolError
from router.openai.base import HTTPError, bad_request

MAX_BOUND_S = 3600.0
_FIELDS = {
    "add": ("role",),
    "drain": ("worker", "bound_s"),
    "flip": ("worker", "to", "bound_s"),
}


def _check_fields(op: str, body: dict[str, Any]) -> None:
    for key in body:
        if key not in _FIELDS[op]:
            allowed = ", ".join(_FIELDS[op])
            raise bad_request(key, f"{key}: unknown field (pool/{op} takes {allowed})")


def _role(body: dict[str, Any], field: str) -> Role:
    value = body.get(field)
    if value not in (Role.PREFILL.value, Role.DECODE.value):
        raise bad_request(field, f"{field} must be 'prefill' or 'decode', got {value!r}")
    return Role(value)


def _worker(body: dict[str, Any]) -> str:
    value = body.get("worker")
    if not isinstance(value, str) or not value:
        raise bad_request("worker", "worker must be a worker's name (GET /v1/admin/pool)")
    return value


def _bound(body: dict[str, Any]) -> float:
    value = body.get("bound_s", DEFAULT_DRAIN_BOUND_S)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request("bound_s", f"bound_s must be a number of seconds, got {value!r}")
    if not 0 < value <= MAX_BOUND_S:
        raise bad_request("bound_s", f"bound_s must be in (0, {MAX_BOUND_S:g}], got {value}")
    return float(value)


async def _answer(op: Awaitable[dict[str, Any]]) -> JSONResponse:
    try:
        return JSONResponse(await op)
    except PoolError as e:
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        raise HTTPError(e.status, e.message, kind, param=e.field) from e


def status(admin: PoolAdmin) -> JSONResponse:
    return JSONResponse(admin.status())


async def add(admin: PoolAdmin, body: dict[str, Any]) -> JSONResponse:
    _check_fields("add", body)
    return await _answer(admin.add(_role(body, "role")))


async def drain(admin: PoolAdmin, body: dict[str, Any]) -> JSONResponse:
    _check_fields("drain", body)
    return await _answer(admin.drain(_worker(body), _bound(body)))


async def flip(admin: PoolAdmin, body: dict[str, Any]) -> JSONResponse:
    _check_fields("flip", body)
    worker, to, bound = _worker(body), _role(body, "to"), _bound(body)
    return await _answer(admin.flip(worker, to, bound))
