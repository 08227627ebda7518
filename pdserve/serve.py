"""`pdserve serve`: start the deployment, serve gRPC (and the OpenAI HTTP API, docs/http.md)
until SIGINT/SIGTERM, then drain."""

from __future__ import annotations

import asyncio
import gc
import resource
import signal
import socket
import sys

from pdserve.config import ServeConfig
from pdserve.launch import Deployment
from pool_api.config import redact_url
from router.config import PlannerSettings, RouterConfig
from router.core import Router
from router.forecast import ForecastFloor
from router.http import HTTPServer, start_http_server
from router.metrics import RouterMetrics
from router.ports import check_ports
from router.service import start_server
from router.tls import ServerTLS


def freeze_startup_heap() -> None:
    """Keep what startup built (Ray, torch, gRPC: ~250k objects that live as long as the
    process) out of the garbage collector. A full collection otherwise walks all of them:
    150-180 ms during which no stream moves and no request is refused (`pdserve chaos`,
    docs/reliability.md)."""
    gc.collect()
    gc.freeze()


async def serve(
    cfg: ServeConfig,
    deployment: Deployment,
    router: Router,
    http_sock: socket.socket | None = None,
) -> int:
    http: HTTPServer | None = None
    # Signals are handled before anything is announced: a SIGTERM right after the
    # "listening" line must drain, not kill the process (Ray's or the default handler).
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        RouterMetrics.install(router)
        server = await start_server(router, cfg.router.host, cfg.router.grpc.port)
        await router.start()
        if cfg.planner.enabled:
            router.start_planner(cfg.planner, _forecast(cfg.planner))
        freeze_startup_heap()
        await server.set_serving(router.serviceable())
        router.on_serving_change = server.set_serving  # NOT_SERVING while a pool is down
        print(f"pdserve: gRPC listening on {cfg.router.host}:{server.port}", flush=True)
        if cfg.router.http.enabled:
            http = await start_http_server(
                router, cfg.router.host, cfg.router.http.port, sock=http_sock
            )
            print(f"pdserve: HTTP listening on {cfg.router.host}:{http.port}", flush=True)
        await stop.wait()
        print("pdserve: draining", file=sys.stderr, flush=True)
        await server.set_serving(False)
        await router.drain(cfg.router.drain_grace_s)
        await server.server.stop(grace=1.0)
    finally:
        if http is not None:
            await http.stop()
        await asyncio.to_thread(deployment.stop)
    print("pdserve: stopped", file=sys.stderr, flush=True)
    return 0


def reserve_ports(cfg: RouterConfig) -> socket.socket | None:
    """Fail in one line, before any worker starts, when a port is taken; the bound HTTP
    socket is kept for the server (`router.ports.check_ports`)."""
    return check_ports(cfg, keep_http=True)


def secret_lines(cfg: ServeConfig) -> list[str]:
    """What the startup log says about the secrets in use: that they are set, never them."""
    lines = []
    if cfg.router.api_key:
        lines.append("pdserve: API key required on HTTP /v1/* and gRPC")
    if cfg.index.redis_url:
        lines.append(f"pdserve: prefix index on Redis at {redact_url(cfg.index.redis_url)}")
    return lines


FD_RESERVE = 1024  # descriptors besides the two ports' connections: Ray, torch, KV, logs


def raise_fd_limit(cfg: RouterConfig) -> str | None:
    """Raise the soft RLIMIT_NOFILE toward what `max_connections` on both ports needs (as
    vLLM raises it), never above the hard limit; a warning when that is still short."""
    if not cfg.limits.max_connections:
        return None
    need = 2 * cfg.limits.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft >= need:
        return None
    return (
        f"pdserve: warning: the fd limit ({soft}) is below what router.limits.max_connections="
        f"{cfg.limits.max_connections} on both ports needs ({need}): lower max_connections or "
        "raise `ulimit -n`"
    )


def run(cfg: ServeConfig) -> int:
    tls = ServerTLS.of(cfg.router)
    if tls is not None:
        tls.check()  # a bad certificate fails here, not after the workers loaded the model
        mtls = ", client certificates required (mTLS)" if tls.mutual else ""
        print(f"pdserve: TLS on gRPC and HTTP{mtls}", file=sys.stderr, flush=True)
    http_sock = reserve_ports(cfg.router)
    if (fd_warning := raise_fd_limit(cfg.router)) is not None:
        print(fd_warning, file=sys.stderr, flush=True)
    for line in secret_lines(cfg):
        print(line, file=sys.stderr, flush=True)
    deployment = Deployment(cfg)
    try:
        router = deployment.start()  # on the main thread: Ray installs its signal handlers here
    except BaseException:
        if http_sock is not None:
            http_sock.close()
        raise
    for summary in deployment.summaries:
        print(f"pdserve: {summary.line()}", file=sys.stderr, flush=True)
    return asyncio.run(serve(cfg, deployment, router, http_sock))


def _forecast(planner: PlannerSettings) -> ForecastFloor | None:
    """The planner's floor loop from `planner.profile` (None without one)."""
    if not planner.profile:
        return None
    from pdserve.plan.plan import forecast_floor

    try:
        return forecast_floor(planner.profile, planner.profile_threads, planner.tpot_ms)
    except ValueError as e:
        raise ValueError(f"planner.profile: {e}") from None
