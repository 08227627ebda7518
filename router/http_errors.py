"""The router's failures (`RequestFailed`) as OpenAI's error objects, naming the field the
HTTP body used."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from engine.sampling import InvalidParameterError
from engine.validation import ContextLengthError
from router.active import RequestFailed
from router.openai.base import CONTEXT_LENGTH_EXCEEDED, HTTPError
from router.openai.structured import structured_field
from router.validation import STRUCTURED_FIELD

# gRPC status -> (HTTP status, OpenAI error type)
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
RETRY_AFTER_S = "1"


# ---- errors -------------------------------------------------------------------------------
def field_names(body: dict[str, Any], chat: bool) -> dict[str, str]:
    """The router's field names as this body spells them (`from_failed`)."""
    names = {"prompt": "messages"} if chat else {}
    if chat and "max_completion_tokens" in body:  # it wins over max_tokens (protocol.py)
        names["max_tokens"] = "max_completion_tokens"
    if field := structured_field(body):
        names[STRUCTURED_FIELD] = field
    elif chat and body.get("tool_choice") not in (None, "none", "auto"):
        names[STRUCTURED_FIELD] = "tools"  # a forced call's grammar is its tool's schema
    return names


def from_failed(e: RequestFailed, names: Mapping[str, str] | None = None) -> HTTPError:
    """The router's failure as OpenAI's error. The context-length message loses its
    `prompt: ` prefix: it is then OpenAI's, verbatim. `names` renames the router's field
    to the one the body used: a chat's prompt is what the template made of `messages`
    (OpenAI names that field), a constraint came from `response_format`, ..."""
    status, type_ = _STATUS.get(e.code, (500, "server_error"))
    message, param, code = e.details, None, None
    cause = e.__cause__
    if isinstance(cause, InvalidParameterError):
        param = cause.field
        prefix = f"{cause.field}: "
        if names and param in names:
            param = names[param]
            message = f"{param}: " + message.removeprefix(prefix)
            prefix = f"{param}: "
        if isinstance(cause, ContextLengthError):  # OpenAI's own wording, which clients match
            code = CONTEXT_LENGTH_EXCEEDED
            message = message.removeprefix(prefix)
    elif e.code == grpc.StatusCode.NOT_FOUND:
        param, code = "model", "model_not_found"
    elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        code = "rate_limit_exceeded"
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else {}
    return HTTPError(status, message, type_, param, code, headers)
