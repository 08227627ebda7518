"""The OpenAI-compatible HTTP API (docs/http.md): FastAPI on uvicorn, in the router's loop.

Every request is translated into a `pdserve.v1.GenerateRequest` (router/openai/protocol.py)
and driven through `Router.admit` / `Router.run` / `Router.finish` exactly like the gRPC
servicer, so validation, routing, queueing and cleanup are shared; the responses are shaped by
router/openai/format.py. A `RequestFailed` maps to the HTTP status of its gRPC code and
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

The first response of a request is awaited before the status line is sent, so a request that
fails before its first token (a full queue, no KV room) still gets its proper status; once
streaming (SSE), a failure arrives as one ``data: {"error": ...}`` event before
``data: [DONE]``. A client that disconnects cancels its request (`Router.finish(act,
completed=False)` frees its blocks on both pools).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pool_api.version import package_version
from protos.pdserve.v1 import generation_pb2 as gen
from router import admin_http, endpoints
from router.active import ActiveRequest, RequestFailed
from router.auth import bearer_ok
from router.core import Router
from router.http_errors import field_names, from_failed
from router.http_guard import uvicorn_options as connection_limits
from router.metrics import RouterMetrics
from router.openai.batch import batch_prompts, merged
from router.openai.batch import usage_chunk as batch_usage_chunk
from router.openai.body import BodyLimits, read_json
from router.openai.choices import Choices, collected
from router.openai.format import sse
from router.openai.protocol import (
    HTTPError,
    StreamOptions,
    bad_request,
    chat_request,
    chat_request_and_tools,
    completion_request,
)
from router.openai.tokenize import detokenize, tokenize
from router.openai.tools import ToolPlan
from router.ports import bind_socket
from router.tls import ServerTLS

log = logging.getLogger(__name__)

__all__ = [
    "HTTPError",
    "HTTPServer",
    "bind_socket",
    "chat_request",
    "completion_request",
    "create_app",
    "from_failed",
    "start_http_server",
]

T = TypeVar("T")


_VERSION = package_version()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    """The endpoints over one router; `create_app` routes to them."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.metrics = RouterMetrics.install(router)
        self.model = router.model_info.served_model_name
        self.created = int(time.time())
        self.body_limits = BodyLimits.of(router)

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

    # ---- endpoints
    def _choices(
        self,
        chat: bool,
        response_id: str,
        opts: StreamOptions,
        body: dict[str, Any],
        greq: gen.GenerateRequest,
        base: int = 0,
        tools: ToolPlan | None = None,
    ) -> Choices:
        """A formatter for each of the request's `n` choices (`Choices.of`)."""
        r = self.router
        max_n = r.limits.edge_limits().max_n
        return Choices.of(self.model, r.tokenizer, max_n, chat, response_id, opts, body, greq,
                          base, tools)  # fmt: skip

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await read_json(request, self.body_limits)
        request_id, response_id = _ids(request, body, chat=False)
        opts = StreamOptions.of(body)
        prompts = batch_prompts(body)
        if prompts is not None:  # one request per prompt, answered as one (vLLM's shape)
            greqs = [
                await asyncio.to_thread(
                    completion_request, {**body, "prompt": p}, f"{request_id}-{i}", self.router
                )
                for i, p in enumerate(prompts)
            ]
            n = max(greqs[0].sampling.n, 1)
            sets = [
                self._choices(False, response_id, opts, body, g, base=i * n)
                for i, g in enumerate(greqs)
            ]
            return await self.generate_batch(request, greqs, sets, opts, body)
        if body.get("add_special_tokens") is False:  # tokenized here: off the event loop
            greq = await asyncio.to_thread(completion_request, body, request_id, self.router)
        else:
            greq = completion_request(body, request_id)
        choices = self._choices(False, response_id, opts, body, greq)
        return await self.generate(request, greq, choices, opts, body)

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await read_json(request, self.body_limits)
        request_id, response_id = _ids(request, body, chat=True)
        opts = StreamOptions.of(body)
        # The template render and tokenization run off the event loop (the tokenizer lets go
        # of the GIL), so a huge chat does not stall every other request and /health.
        greq, tools = await asyncio.to_thread(chat_request_and_tools, self.router, body, request_id)
        choices = self._choices(True, response_id, opts, body, greq, tools=tools)
        return await self.generate(request, greq, choices, opts, body)

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "root": self.model,
            "parent": None,
            "max_model_len": self.router.model_info.max_context_length,
            "vocab_size": self.router.limits.vocab_size,  # pdserve's: bench's random ids
            "permission": [],
        }

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request, model_id: str) -> Response:
        self.authorize(request)
        if model_id != self.model:
            raise HTTPError(
                404,
                f"The model `{model_id[:64]}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._card())

    async def tokenize(self, request: Request) -> Response:
        self.authorize(request)
        body = await read_json(request, self.body_limits)
        return JSONResponse(await asyncio.to_thread(tokenize, self.router, body))

    async def detokenize(self, request: Request) -> Response:
        self.authorize(request)
        body = await read_json(request, self.body_limits)
        return JSONResponse(await asyncio.to_thread(detokenize, self.router, body))

    async def health(self) -> Response:
        """GET /health, and GET or POST /ping (vLLM's SageMaker-style probe): the same."""
        status = self.router.status()
        if status == "ok":
            return JSONResponse({"status": "ok"})
        if status == "degraded":
            # Still 200: requests are served (a load balancer keeps this router in rotation).
            degraded = self.router.degraded()
            body = {"status": "degraded", "degraded": degraded}
            return JSONResponse(body, headers={"X-PDServe-Degraded": "; ".join(degraded)})
        return JSONResponse({"status": status}, status_code=503)

    async def version(self) -> Response:
        return JSONResponse({"version": _VERSION})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- the pool admin (router/admin_http.py): the key first, whatever the body
    async def pool_status(self, request: Request) -> Response:
        self.authorize(request)
        return admin_http.status(self.router.admin)

    async def pool_change(self, request: Request, op: str) -> Response:
        self.authorize(request)
        body = await read_json(request, self.body_limits)
        change = {"add": admin_http.add, "drain": admin_http.drain, "flip": admin_http.flip}
        return await change[op](self.router.admin, body)

    # ---- generation
    async def generate(
        self,
        request: Request,
        greq: gen.GenerateRequest,
        choices: Choices,
        opts: StreamOptions,
        body: dict[str, Any],
    ) -> Response:
        """`body`: what an admission refusal names its fields after (`field_names`, worked
        out only on that path)."""
        router = self.router
        try:
            act = await router.admit(greq)
        except RequestFailed as e:
            raise from_failed(e, field_names(body, choices.fmts[0].chat)) from e
        choices.admitted(act.request.prompt_token_ids, greq)
        run = _Run(router, act, router.run(act))
        handed_off = False
        try:
            if opts.stream:
                first = await until_disconnect(request, _first(run.stream))
                handed_off = True
                return SSEResponse(
                    self._events(run, first, choices),
                    run.release,
                    headers={**_SSE_HEADERS, "X-Request-Id": act.request.request_id},
                )
            body = await until_disconnect(request, self._collect(run, choices))
            return JSONResponse(body, headers={"X-Request-Id": act.request.request_id})
        except RequestFailed as e:
            raise from_failed(e) from e
        except ClientGone:
            return Response(status_code=499)  # nobody is listening
        finally:
            if not handed_off:
                await run.release()

    async def generate_batch(
        self,
        request: Request,
        greqs: list[gen.GenerateRequest],
        sets: list[Choices],
        opts: StreamOptions,
        body: dict[str, Any],
    ) -> Response:
        """`generate` for a list of prompts: each admitted and run on its own, answered as
        one response (router/openai/batch.py); any refusal frees those already admitted."""
        router = self.router
        runs: list[_Run] = []
        try:
            for greq, choices in zip(greqs, sets, strict=True):
                act = await router.admit(greq)
                choices.admitted(act.request.prompt_token_ids, greq)
                runs.append(_Run(router, act, router.run(act)))
        except BaseException as e:  # whatever stops the admissions frees the admitted
            await asyncio.gather(*(run.release() for run in runs))
            if isinstance(e, RequestFailed):
                raise from_failed(e, field_names(body, chat=False)) from e
            raise

        async def release_all() -> None:
            await asyncio.gather(*(run.release() for run in runs))

        handed_off = False
        try:
            if opts.stream:
                handed_off = True
                return SSEResponse(self._batch_events(runs, sets), release_all, _SSE_HEADERS)
            pairs = zip(runs, sets, strict=True)
            tasks = [asyncio.ensure_future(self._collect(r, f)) for r, f in pairs]
            try:  # one choice failing ends the others (their streams are released below)
                bodies = await until_disconnect(request, asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return JSONResponse(merged(bodies))
        except RequestFailed as e:
            raise from_failed(e) from e
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_off:
                await release_all()

    async def _batch_events(self, runs: list[_Run], sets: list[Choices]) -> AsyncIterator[bytes]:
        """The choices' chunks as they come, numbered across the prompts; one usage chunk
        (summed) and `[DONE]` once every request completed."""
        queue: asyncio.Queue[tuple[int, gen.GenerateResponse | RequestFailed | None]] = (
            asyncio.Queue()
        )

        async def pump(i: int, run: _Run) -> None:
            try:
                async for resp in run.stream:
                    await queue.put((i, resp))
                await queue.put((i, None))
            except RequestFailed as e:
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
        completes: list[gen.GenerateComplete] = []
        try:
            for choices in sets:
                for chunk in choices.opening():
                    yield sse(chunk)
            done = 0
            while done < len(runs):
                i, item = await queue.get()
                if isinstance(item, RequestFailed):
                    yield sse(from_failed(item).body())
                    break
                if item is None:
                    done += 1
                    continue
                for chunk in sets[i].streamed(item):
                    yield sse(chunk)
                if item.HasField("complete"):
                    runs[i].completed = True
                    completes.append(item.complete)
            else:
                if sets[0].fmts[0].include_usage:
                    yield sse(batch_usage_chunk(sets[0].fmts[0], completes))
            yield sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, run: _Run, choices: Choices) -> dict[str, Any]:
        body = await collected(choices, run.stream)
        if body is None:
            raise RequestFailed(grpc.StatusCode.INTERNAL, "the request ended without completing")
        run.completed = True
        return body

    async def _events(
        self, run: _Run, first: gen.GenerateResponse | None, choices: Choices
    ) -> AsyncIterator[bytes]:
        try:
            for chunk in choices.opening():
                yield sse(chunk)
            resp: gen.GenerateResponse | None = first
            while resp is not None:
                for chunk in choices.streamed(resp):
                    yield sse(chunk)
                if resp.HasField("complete"):
                    run.completed = True
                    fmt = choices.fmts[0]
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


def _ids(request: Request, body: dict[str, Any], chat: bool) -> tuple[str, str]:
    """(request id, response id): the client's `X-Request-Id`, else the body's `request_id`
    (vLLM's), else the response's id."""
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    in_body = body.get("request_id")
    if in_body is not None and not isinstance(in_body, str):
        raise bad_request("request_id", "request_id must be a string")
    return request.headers.get("x-request-id") or in_body or response_id, response_id


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


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's own (404, 405) and unexpected ones included, in OpenAI's shape."""

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


def create_app(router: Router) -> FastAPI:
    """The routes (docs/http.md#endpoints). The API key guards /v1/*, /tokenize and
    /detokenize; probes, metrics, the version and the API's own docs (/docs, /redoc,
    /openapi.json) stay open, as vLLM leaves everything outside /v1."""
    app = FastAPI(title="pdserve", version=_VERSION)  # serves /docs, /redoc, /openapi.json
    app.state.openai = OpenAIApp(router)
    _install_error_handlers(app)
    post = ["POST"]
    app.add_api_route("/v1/completions", endpoints.completions, methods=post)
    app.add_api_route("/v1/chat/completions", endpoints.chat_completions, methods=post)
    app.add_api_route("/v1/models", endpoints.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", endpoints.model_card, methods=["GET"])
    app.add_api_route("/tokenize", endpoints.tokenize, methods=post)
    app.add_api_route("/detokenize", endpoints.detokenize, methods=post)
    app.add_api_route("/health", endpoints.health, methods=["GET"])
    app.add_api_route("/ping", endpoints.health, methods=["GET"], name="ping")
    app.add_api_route("/ping", endpoints.health, methods=["POST"], name="ping")
    app.add_api_route("/version", endpoints.version, methods=["GET"])
    app.add_api_route("/metrics", endpoints.metrics_text, methods=["GET"])
    app.add_api_route("/v1/admin/pool", endpoints.pool_status, methods=["GET"])
    for op in ("add", "drain", "flip"):
        app.add_api_route(f"/v1/admin/pool/{op}", endpoints.pool_change(op), methods=post)
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
            # Boundary of a stop: the server task's own error is logged, the stop goes on.
            log.exception("the HTTP server ended with an error")


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
        # the access log (one line a request, at INFO) comes with the request log opt-in
        access_log=router.cfg.log_requests,
        lifespan="off",
        timeout_graceful_shutdown=graceful_s,
        **connection_limits(router.cfg),  # head/body timeouts, keep-alive, cap
        **(tls.uvicorn_options() if tls else {}),
    )
    if router.cfg.log_requests:  # uvicorn set its loggers to `log_level` above
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server exited while starting")
        await asyncio.sleep(0.01)
    return HTTPServer(server, task, bound)
