"""Pieces several test modules stand up in the test process: a fresh local Ray cluster, and
a Router whose pools never get called."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from pdserve.launch import init_ray, run_with_workers
from router.config import RouterConfig

__all__ = ["run_with_workers"]


def start_local_ray() -> None:
    """A fresh local Ray cluster for one test module (any cluster this process had is shut
    down first; never one found on the host). The workers ask for 0.5 logical CPUs each, and
    run at niceness 0 (`init_ray`): the other pytest worker, at 0, would otherwise starve
    them."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(
        worker_niceness=0,
        address="local",
        num_cpus=4,
        namespace="pdserve",
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def local_config(model_dir: Any) -> Any:
    """The serve config of in-process workers on `model_dir`: the `local` KV transport."""
    from pdserve.config import ServeConfig

    return ServeConfig.load(
        None, {"model": {"model": str(model_dir)}, "transfer": {"transport": "local"}}
    )


def router_without_workers(
    cfg: RouterConfig, num_free_blocks: int = 8, num_running: int = 0, num_requests_total: int = 0
) -> Any:
    """A Router whose pools report one healthy worker each (8 blocks, these stats) and never
    get called: enough for model info, health, auth, metrics and the TLS handshake."""
    from pool_api.messages import Role, WorkerStats
    from protos.pdserve.v1 import generation_pb2 as gen
    from router.clients import DecodeClient, PrefillClient
    from router.core import Router
    from router.pools import Pool
    from router.validation import ModelLimits

    never_called: Any = None  # the pools' workers answer nothing: their stats are set here

    def pool(role: Role) -> Pool[Any]:
        client = (
            PrefillClient("pdserve-prefill-0", never_called)
            if role is Role.PREFILL
            else DecodeClient("pdserve-decode-0", never_called)
        )
        p: Pool[Any] = Pool(role, [client])
        p.workers[0].stats = WorkerStats(
            name=client.name,
            role=role,
            num_free_blocks=num_free_blocks,
            num_total_blocks=8,
            num_running=num_running,
            num_waiting=0,
            num_reserved=0,
            queued_prefill_tokens=0,
            num_requests_total=num_requests_total,
            num_preemptions_total=0,
        )
        return p

    info = gen.ModelInfo(served_model_name="m", max_context_length=2048, block_size=16)
    limits = ModelLimits("m", 512, 2048)
    return Router(cfg, limits, None, info, pool(Role.PREFILL), pool(Role.DECODE), "local")


@contextlib.contextmanager
def servers_without_workers(cfg: RouterConfig) -> Iterator[tuple[int, int]]:
    """The router's gRPC server and HTTP app over `router_without_workers(cfg)`, on an event
    loop thread of their own; yields (gRPC port, HTTP port)."""
    import asyncio
    import threading

    from router.http import start_http_server
    from router.service import start_server

    router = router_without_workers(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def up() -> tuple[Any, Any]:
        grpc_server = await start_server(router, "127.0.0.1", 0)
        await grpc_server.set_serving(True)
        return grpc_server, await start_http_server(router, "127.0.0.1", 0)

    grpc_server, http_server = call(up())
    try:
        yield grpc_server.port, http_server.port
    finally:
        call(http_server.stop(2.0))
        call(grpc_server.server.stop(grace=0.1))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def asgi_call(
    app: Any,
    method: str,
    path: str,
    body: dict[str, Any] | bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request through the ASGI app, no server: (status, headers, body)."""
    import asyncio

    return asyncio.run(asgi_request(app, method, path, body, headers))


async def asgi_request(
    app: Any,
    method: str,
    path: str,
    body: dict[str, Any] | bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """`asgi_call` on the running event loop (a started Router's)."""
    import asyncio
    import json

    raw = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
    sent: list[dict[str, Any]] = []
    done = False

    async def receive() -> dict[str, Any]:
        nonlocal done
        if done:
            await asyncio.sleep(3600)  # the client stays; never disconnects
        done = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    hdrs = {"content-type": "application/json", **(headers or {})}
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    start = sent[0]
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    got = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], got, out


async def generate(router: Any, request: Any) -> tuple[list[int], Any]:
    """One request through a started Router, as its gRPC face drives it: the token ids it
    sent and its ActiveRequest (for placement, timings)."""
    act = await router.admit(request)
    toks: list[int] = []
    try:
        async for resp in router.run(act):
            toks += resp.chunk.token_ids
    finally:
        router.finish(act, True)
    return toks, act


async def all_of(workers: Any, calls: dict[str, Any]) -> dict[str, Any]:
    """Await each of `calls` (name -> coroutine): all at once where every worker's kernels
    are batch-invariant (the selection's probe says so: a row's floats do not depend on its
    batch, so the answers are those of one at a time, in a fraction of the time), else one
    at a time, in order (then each runs alone in its batch)."""
    import asyncio

    if all(w.engine.kernel_selection.kernels.batch_invariant for w in workers):
        return dict(zip(calls, await asyncio.gather(*calls.values()), strict=True))
    return {name: await call for name, call in calls.items()}
