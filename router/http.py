"""The OpenAI-compatible HTTP API (docs/http.md): FastAPI on uvicorn, in the router's loop.

Every request is translated into a `pdserve.v1.GenerateRequest` and driven through
`Router.admit` / `Router.run` / `Router.finish` exactly like the gRPC servicer, so validation,
routing, queueing and cleanup are shared. A `RequestFailed` maps to the HTTP status of its
gRPC code and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

The first response of a request is awaited before the status line is sent, so a request that
fails before its first token (a full queue, no KV room) still gets its proper status; once
streaming (SSE), a failure arrives as one ``data: {"error": ...}`` event before
``data: [DONE]``. A client that disconnects cancels its request (`Router.finish(act,
completed=False)` frees its blocks on both pools).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from engine.sampling import InvalidParameterError
from engine.validation import ContextLengthError
from protos.pdserve.v1 import generation_pb2 as gen
from router.auth import bearer_ok
from router.metrics import RouterMetrics
from router.service import ActiveRequest, RequestFailed, Router
from router.tls import ServerTLS

T = TypeVar("T")

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_FINISH = {
    gen.FINISH_REASON_STOP: "stop",
    gen.FINISH_REASON_LENGTH: "length",
    gen.FINISH_REASON_ABORT: "abort",
    gen.FINISH_REASON_UNSPECIFIED: "stop",
}
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
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- errors -------------------------------------------------------------------------------
class HTTPError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(param: str | None, message: str) -> HTTPError:
    return HTTPError(400, message, param=param)


def from_failed(e: RequestFailed) -> HTTPError:
    """The router's failure as OpenAI's error. The context-length message loses its
    `prompt: ` prefix: it is then OpenAI's, verbatim."""
    status, type_ = _STATUS.get(e.code, (500, "server_error"))
    message, param, code = e.details, None, None
    cause = e.__cause__
    if isinstance(cause, InvalidParameterError):
        param = cause.field
        prefix = f"{cause.field}: "
        if isinstance(cause, ContextLengthError):  # OpenAI's own wording, which clients match
            code = "context_length_exceeded"
            message = message.removeprefix(prefix)
    elif e.code == grpc.StatusCode.NOT_FOUND:
        param, code = "model", "model_not_found"
    elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        code = "rate_limit_exceeded"
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else {}
    return HTTPError(status, message, type_, param, code, headers)


# ---- request parsing ----------------------------------------------------------------------
def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


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
        return cls(cfg.max_body_bytes or derived, cfg.max_json_depth)


async def read_json(request: Request, limits: BodyLimits) -> dict[str, Any]:
    """The body as a JSON object. Too large, not UTF-8, malformed, nested too deeply, not an
    object, or holding a string that is not Unicode text (a lone surrogate): a 400."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limits.max_bytes:
            chunks.append(chunk)
        elif size > 8 * limits.max_bytes:
            break  # past this the client is not waiting for an answer: stop reading
    if size > limits.max_bytes:
        # Read to the end (not kept) so a client still sending can read the answer.
        raise bad_request(None, f"request body is over {limits.max_bytes} bytes")
    try:
        text = b"".join(chunks).decode("utf-8")
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


def _num(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad_request(key, f"{key} must be a number, got {json.dumps(v)}")
    return float(v)


def _int(d: dict[str, Any], key: str, bounds: tuple[int, int] = _INT32) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(key, f"{key} must be an integer, got {json.dumps(v)}")
    if not bounds[0] <= v <= bounds[1]:
        raise bad_request(key, f"{key} is out of range: {v}")
    return v


def _bool(d: dict[str, Any], key: str) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad_request(key, f"{key} must be a boolean, got {json.dumps(v)}")
    return v


def _str(d: dict[str, Any], key: str) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(key, f"{key} must be a string")
    return v


def _unsupported(d: dict[str, Any], key: str, ok: Any, what: str) -> None:
    v = d.get(key)
    if v is not None and v != ok and v not in ({}, []):
        raise bad_request(key, f"{key} is not supported ({what})")


def sampling_params(d: dict[str, Any], max_tokens: int | None) -> gen.SamplingParams:
    """OpenAI's sampling fields (plus vLLM's extras) as the proto; unset stays unset."""
    s = gen.SamplingParams()
    for key in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        v = _num(d, key)
        if v is not None:
            setattr(s, key, v)
    top_k = _int(d, "top_k")
    if top_k is not None and top_k not in (-1, 0):  # vLLM: -1 or 0 disables top-k
        s.top_k = top_k
    for key in ("min_tokens", "n"):
        iv = _int(d, key)
        if iv is not None:
            setattr(s, key, iv)
    seed = _int(d, "seed", _INT64)
    if seed is not None:
        s.seed = seed
    if max_tokens is not None:
        s.max_tokens = max_tokens
    ignore_eos = _bool(d, "ignore_eos")
    if ignore_eos is not None:
        s.ignore_eos = ignore_eos
    stop = d.get("stop")
    if isinstance(stop, str):
        s.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        s.stop.extend(stop)
    elif stop is not None:
        raise bad_request("stop", "stop must be a string or a list of strings")
    ids = d.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and _INT32[0] <= t <= _INT32[1]
            for t in ids
        ):
            raise bad_request("stop_token_ids", "stop_token_ids must be a list of integers")
        s.stop_token_ids.extend(ids)
    return s


@dataclass
class StreamOptions:
    stream: bool = False
    include_usage: bool = False


def stream_options(d: dict[str, Any]) -> StreamOptions:
    stream = bool(_bool(d, "stream"))
    so = d.get("stream_options")
    if so is None:
        return StreamOptions(stream)
    if not isinstance(so, dict):
        raise bad_request("stream_options", "stream_options must be an object")
    if not stream:
        raise bad_request("stream_options", "stream_options is only allowed when stream is true")
    return StreamOptions(stream, bool(_bool(so, "include_usage")))


def _common(d: dict[str, Any], request_id: str) -> gen.GenerateRequest:
    model = _str(d, "model") or ""
    r = gen.GenerateRequest(request_id=request_id, model=model)
    salt = _str(d, "cache_salt")
    if salt:
        r.cache_salt = salt
    return r


def completion_request(d: dict[str, Any], request_id: str) -> gen.GenerateRequest:
    """POST /v1/completions body -> GenerateRequest (one prompt)."""
    _unsupported(d, "echo", False, "echo must be false")
    _unsupported(d, "best_of", 1, "best_of must be 1")
    _unsupported(d, "suffix", "", "no suffix")
    _unsupported(d, "logit_bias", None, "no logit_bias")
    r = _common(d, request_id)
    prompt = d.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        r.text = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if not all(_INT32[0] <= t <= _INT32[1] for t in prompt):
            raise bad_request("prompt", "prompt token ids are out of range")
        r.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("prompt", "batched prompts are not supported: send one prompt")
    elif prompt is None or prompt == []:
        raise bad_request("prompt", "prompt is required")
    else:
        raise bad_request("prompt", "prompt must be a string or a list of token ids")
    r.sampling.CopyFrom(sampling_params(d, _int(d, "max_tokens")))
    logprobs = _int(d, "logprobs")
    if logprobs is not None:
        r.sampling.logprobs = logprobs
    return r


def chat_messages(d: dict[str, Any]) -> list[dict[str, str]]:
    msgs = d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(where, f"{where} must be an object")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise bad_request(f"{where}.role", f"{where}.role must be one of {list(_CHAT_ROLES)}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise bad_request(f"{where}.content", "only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content", f"{where}.content must be a string")
        out.append({"role": str(role), "content": content})
    return out


def chat_request(router: Router, d: dict[str, Any], request_id: str) -> gen.GenerateRequest:
    """POST /v1/chat/completions body -> GenerateRequest (the template-rendered prompt)."""
    _unsupported(d, "logit_bias", None, "no logit_bias")
    _unsupported(d, "tools", None, "no tool calling")
    _unsupported(d, "functions", None, "no function calling")
    rf = d.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise bad_request("response_format", "only response_format {'type': 'text'} is supported")
    messages = chat_messages(d)
    limit = router.limits.edge_limits().max_prompt_chars
    if sum(len(m["content"]) for m in messages) > limit:  # before the template runs
        raise bad_request("messages", f"messages hold over {limit} characters of content")
    r = _common(d, request_id)
    if router.tokenizer is None:
        raise bad_request("messages", "this model has no tokenizer; use /v1/completions")
    try:
        # Tokenized here, without special tokens again: the template placed BOS (if any),
        # as HF's apply_chat_template(tokenize=True) and vLLM do.
        ids = router.tokenizer.encode_chat(messages)
    except ValueError as e:  # ChatTemplateError: the template's own message
        raise bad_request("messages", str(e).removeprefix("messages: ")) from e
    r.token_ids.ids.extend(ids)
    max_tokens = _int(d, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int(d, "max_tokens")
    if max_tokens is None:  # as vLLM: the rest of the context, or generation_config's
        # max_new_tokens if smaller (at least 1, so an overlong prompt meets the
        # context-length check rather than a max_tokens one)
        rest = max(router.limits.max_model_len - len(ids), 1)
        max_tokens = min(rest, router.limits.sampling_defaults.max_tokens or rest)
    r.sampling.CopyFrom(sampling_params(d, max_tokens))
    top = _int(d, "top_logprobs")
    if _bool(d, "logprobs"):
        r.sampling.logprobs = top or 0
    elif top:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
    return r


# ---- response formatting ------------------------------------------------------------------
def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def usage_dict(c: gen.GenerateComplete) -> dict[str, Any]:
    u = c.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


@dataclass
class Formatter:
    """OpenAI's JSON for one request: `text_completion` or `chat.completion`."""

    chat: bool
    id: str
    model: str
    router: Router
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # completions logprobs: text offset of the next token

    def _token(self, token_id: int) -> str:
        tok = self.router.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id], skip_special_tokens=False)

    def logprobs(self, lps: list[gen.TokenLogprob]) -> dict[str, Any] | None:
        if not lps:
            return None
        if self.chat:
            content = []
            for lp in lps:
                s = self._token(lp.token_id)
                content.append(
                    {
                        "token": s,
                        "logprob": _finite(lp.logprob),
                        "bytes": list(s.encode()),
                        "top_logprobs": [
                            {
                                "token": (ts := self._token(t.token_id)),
                                "logprob": _finite(t.logprob),
                                "bytes": list(ts.encode()),
                            }
                            for t in lp.top
                        ],
                    }
                )
            return {"content": content, "refusal": None}
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s = self._token(lp.token_id)
            tokens.append(s)
            token_lps.append(_finite(lp.logprob))
            tops.append({self._token(t.token_id): _finite(t.logprob) for t in lp.top})
            offsets.append(self._offset)
            self._offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    # streaming
    def chunk(
        self,
        text: str,
        lps: list[gen.TokenLogprob],
        finish: str | None = None,
        role: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text or role:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(lps)
        choice["finish_reason"] = finish
        out = self._envelope([choice], stream=True)
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, c: gen.GenerateComplete) -> dict[str, Any]:
        out = self._envelope([], stream=True)
        out["usage"] = usage_dict(c)
        return out

    # whole response
    def full(
        self, text: str, lps: list[gen.TokenLogprob], c: gen.GenerateComplete
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(lps)
        choice["finish_reason"] = _FINISH[c.finish_reason]
        out = self._envelope([choice], stream=False)
        out["usage"] = usage_dict(c)
        return out


def sse(data: dict[str, Any] | str) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n".encode()


# ---- disconnects --------------------------------------------------------------------------
class ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class SSEResponse(StreamingResponse):
    """SSE that always runs `cleanup` once it is done, however it ended: finished, client
    gone mid-send, or never started (a generator closed before its first step skips its
    own `finally`)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        cleanup: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _aclose(self.body_iterator)
            await self._cleanup()


# ---- the app ------------------------------------------------------------------------------
@dataclass
class _Run:
    """One admitted request: its response stream and whether it completed."""

    router: Router
    act: ActiveRequest
    stream: AsyncIterator[gen.GenerateResponse]
    completed: bool = False
    released: bool = False

    async def release(self) -> None:
        """Forget the request once (not completed: free its blocks on both pools)."""
        if not self.released:
            self.released = True
            self.router.finish(self.act, self.completed)
            await _aclose(self.stream)


class OpenAIApp:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.metrics = RouterMetrics.install(router)
        self.model = router.model_info.served_model_name
        self.created = int(time.time())

    def authorize(self, request: Request) -> None:
        if not bearer_ok(request.headers.get("authorization"), self.router.cfg.api_key):
            raise HTTPError(
                401,
                "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                param=None,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def ready(self) -> bool:
        return self.router.serviceable()

    async def generate(
        self, request: Request, greq: gen.GenerateRequest, fmt: Formatter, opts: StreamOptions
    ) -> Response:
        router = self.router
        try:
            act = router.admit(greq)
        except RequestFailed as e:
            raise from_failed(e) from e
        run = _Run(router, act, router.run(act))
        handed_off = False
        try:
            if opts.stream:
                first = await until_disconnect(request, _first(run.stream))
                handed_off = True
                return SSEResponse(
                    self._events(run, first, fmt),
                    run.release,
                    headers={**_SSE_HEADERS, "X-Request-Id": act.request.request_id},
                )
            body = await until_disconnect(request, self._collect(run, fmt))
            return JSONResponse(body, headers={"X-Request-Id": act.request.request_id})
        except RequestFailed as e:
            raise from_failed(e) from e
        except ClientGone:
            return Response(status_code=499)  # nobody is listening
        finally:
            if not handed_off:
                await run.release()

    async def _collect(self, run: _Run, fmt: Formatter) -> dict[str, Any]:
        text: list[str] = []
        lps: list[gen.TokenLogprob] = []
        async for resp in run.stream:
            if resp.HasField("chunk"):
                text.append(resp.chunk.text)
                lps.extend(resp.chunk.logprobs)
            else:
                run.completed = True
                return fmt.full("".join(text), lps, resp.complete)
        raise RequestFailed(grpc.StatusCode.INTERNAL, "the request ended without completing")

    async def _events(
        self, run: _Run, first: gen.GenerateResponse | None, fmt: Formatter
    ) -> AsyncIterator[bytes]:
        try:
            if fmt.chat:
                yield sse(fmt.chunk("", [], role=True))
            resp: gen.GenerateResponse | None = first
            while resp is not None:
                if resp.HasField("chunk"):
                    c = resp.chunk
                    if c.text or c.logprobs:
                        yield sse(fmt.chunk(c.text, list(c.logprobs)))
                else:
                    run.completed = True
                    yield sse(fmt.chunk("", [], _FINISH[resp.complete.finish_reason]))
                    if fmt.include_usage:
                        yield sse(fmt.usage_chunk(resp.complete))
                    break
                resp = await _first(run.stream)
            yield sse("[DONE]")
        except RequestFailed as e:
            yield sse(from_failed(e).body())
            yield sse("[DONE]")
        finally:
            await run.release()


async def _first(stream: AsyncIterator[gen.GenerateResponse]) -> gen.GenerateResponse | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _aclose(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def create_app(router: Router) -> FastAPI:
    oa = OpenAIApp(router)
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.openai = oa

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, exc: StarletteHTTPException) -> Response:
        return HTTPError(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error",
            headers=dict(exc.headers) if exc.headers else None,
        ).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        return HTTPError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    body_limits = BodyLimits.of(router)

    def ids(request: Request, chat: bool) -> tuple[str, str]:
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return request.headers.get("x-request-id") or response_id, response_id

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        oa.authorize(request)
        body = await read_json(request, body_limits)
        request_id, response_id = ids(request, chat=False)
        opts = stream_options(body)
        greq = completion_request(body, request_id)
        fmt = Formatter(False, response_id, oa.model, router, opts.include_usage)
        return await oa.generate(request, greq, fmt, opts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        oa.authorize(request)
        body = await read_json(request, body_limits)
        request_id, response_id = ids(request, chat=True)
        opts = stream_options(body)
        greq = chat_request(router, body, request_id)
        fmt = Formatter(True, response_id, oa.model, router, opts.include_usage)
        return await oa.generate(request, greq, fmt, opts)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        oa.authorize(request)
        card = {
            "id": oa.model,
            "object": "model",
            "created": oa.created,
            "owned_by": "pdserve",
            "root": oa.model,
            "parent": None,
            "max_model_len": router.model_info.max_context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        if oa.ready():
            return JSONResponse({"status": "ok"})
        status = "draining" if router.draining else "not ready"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(oa.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# ---- the server ---------------------------------------------------------------------------
class _EmbeddedServer(uvicorn.Server):
    """uvicorn as one task of the host's loop: the host (`pdserve serve`) owns SIGINT and
    SIGTERM and drains; uvicorn must not take the signals over."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound to host:port (0 picks a free port)."""
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@dataclass
class HTTPServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, give open connections a moment, then close them."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            self.server.force_exit = True
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        except Exception:
            pass


async def start_http_server(
    router: Router,
    host: str,
    port: int,
    graceful_s: int = 1,
    sock: socket.socket | None = None,
) -> HTTPServer:
    """Serve the OpenAI API on host:port (or on `sock`, bound beforehand) in the running
    loop; returns once it listens. HTTPS (and mTLS) when the router's config has a
    certificate (router/tls.py)."""
    tls = ServerTLS.of(router.cfg)
    sock = sock or bind_socket(host, port)
    bound = int(sock.getsockname()[1])
    config = uvicorn.Config(
        create_app(router),
        log_config=None,  # leave the process's logging alone
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=graceful_s,
        **(tls.uvicorn_options() if tls else {}),
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server exited while starting")
        await asyncio.sleep(0.01)
    return HTTPServer(server, task, bound)
