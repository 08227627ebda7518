"""An HTTP request's body as a JSON object, bounded before and while it is parsed: its size
(`router.limits.max_body_bytes`), its nesting (`router.max_json_depth`), UTF-8 and Unicode text.
Every refusal is a 400 in OpenAI's shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from router.core import Router
from router.openai.protocol import bad_request


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


MAX_JSON_DEPTH = 32  # nesting of a request body (an internal bound, not a setting)


@dataclass(frozen=True)
class BodyLimits:
    """What an HTTP body may be before it is parsed (`router.config`): bytes and nesting."""

    max_bytes: int
    max_depth: int

    @classmethod
    def of(cls, router: Router) -> BodyLimits:
        cfg = router.cfg
        # JSON escapes make a character at most 6 bytes (\uXXXX); leave room for the rest.
        derived = 6 * router.limits.edge_limits().max_prompt_chars + (1 << 20)
        return cls(cfg.limits.max_body_bytes or derived, MAX_JSON_DEPTH)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or a 400 once it is over `max_bytes`."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= max_bytes:
                chunks.append(chunk)
            elif size > 8 * max_bytes:
                break  # past this the client is not waiting for an answer: stop reading
    except ClientDisconnect as e:  # gone, or cut off by the body timeout: not a server error
        raise bad_request(None, "the client stopped sending the request body") from e
    if size > max_bytes:
        # Read to the end (not kept) so a client still sending can read the answer.
        raise bad_request(None, f"request body is over {max_bytes} bytes")
    return b"".join(chunks)


async def read_json(request: Request, limits: BodyLimits) -> dict[str, Any]:
    """The body as a JSON object. Too large, not UTF-8, malformed, nested too deeply, not an
    object, or holding a string that is not Unicode text (a lone surrogate): a 400."""
    raw = await _read_body(request, limits.max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(None, f"request body is not valid UTF-8: {e}") from e
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise bad_request(None, "request body is nested too deeply") from e
    except ValueError as e:
        raise bad_request(None, f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise bad_request(None, "request body must be a JSON object")
    for key, value in data.items():
        _check_tree(value, str(key), str(key), 1, limits.max_depth)
    return data


def _check_tree(value: Any, param: str, path: str, depth: int, max_depth: int) -> None:
    """Depth and text of one top-level field's value; a 400 names the field and the path."""
    if depth > max_depth:
        raise bad_request(param, f"{path}: nested deeper than {max_depth} levels")
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(param, f"{path}: not valid Unicode text ({e.reason})") from e
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_tree(v, param, f"{path}.{k}", depth + 1, max_depth)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_tree(v, param, f"{path}[{i}]", depth + 1, max_depth)
