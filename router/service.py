"""The router's gRPC face: `pdserve.v1.Generation` over grpc.aio, with health and reflection.

Each RPC is a thin call into `router.core.Router`; a `RequestFailed` becomes the call's status.
Health follows `Router.serviceable()` (`RouterServer.set_serving`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc
from router.active import RequestFailed
from router.auth import api_key_interceptors
from router.config import RouterConfig
from router.core import Router
from router.tls import add_port

SERVICE_NAME = "pdserve.v1.Generation"


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(
        self, request: gen.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen.GenerateResponse]:
        try:
            act = await self.router.admit(request)
        except RequestFailed as e:
            await context.abort(e.code, e.details)
            return
        completed = False
        try:
            async for resp in self.router.run(act):
                yield resp
                completed = resp.HasField("complete")
        except RequestFailed as e:
            await context.abort(e.code, e.details)  # raises; `finally` releases the request
        finally:
            self.router.finish(act, completed)

    async def Abort(
        self, request: gen.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gen.AbortResponse:
        return gen.AbortResponse(found=await self.router.abort(request.request_id))

    async def GetModelInfo(
        self, request: gen.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen.ModelInfo:
        return self.router.model_info

    async def GetServerInfo(
        self, request: gen.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen.ServerInfo:
        return await self.router.server_info()


def grpc_options(router: Router) -> list[tuple[str, int]]:
    """The largest valid request is its prompt text at the edge limit (4 bytes a character
    at most in UTF-8) plus room for the rest; a larger message is refused by gRPC itself
    before it is parsed (RESOURCE_EXHAUSTED)."""
    receive = 4 * router.limits.edge_limits().max_prompt_chars + (1 << 20)
    return [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", max(receive, 4 << 20)),
        *connection_options(router.cfg),
    ]


_MAX_MS = (1 << 31) - 1  # gRPC's millisecond arguments are C ints
MIN_CLIENT_PING_S = 10.0  # clients may ping this often, with or without calls
# Internals nobody tunes (once settings; tests lower them): a connection that has not
# completed its handshake (HTTP/2 preface, TLS) in HANDSHAKE_TIMEOUT_S is closed; keepalive
# pings every KEEPALIVE_TIME_S, answered within KEEPALIVE_TIMEOUT_S, find dead peers.
HANDSHAKE_TIMEOUT_S = 20.0
KEEPALIVE_TIME_S = 60.0
KEEPALIVE_TIMEOUT_S = 20.0


def _ms(seconds: float) -> int:
    return min(int(seconds * 1000), _MAX_MS)


def connection_options(cfg: RouterConfig) -> list[tuple[str, int]]:
    """Connection hygiene (docs/config.md#connections): streams per connection, the
    handshake deadline, keepalive both ways, idle and age limits, the connection cap.

    Age is off by default; when set, its grace is unlimited unless configured, so a Generate
    stream in flight when its connection reaches its age finishes on it (the GOAWAY only
    moves new calls to a new connection), as gRPC's own default grace does."""
    opts = [
        ("grpc.max_concurrent_streams", cfg.grpc.max_concurrent_streams),
        ("grpc.server_handshake_timeout_ms", _ms(HANDSHAKE_TIMEOUT_S)),
        ("grpc.keepalive_time_ms", _ms(KEEPALIVE_TIME_S)),
        ("grpc.keepalive_timeout_ms", _ms(KEEPALIVE_TIMEOUT_S)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_CLIENT_PING_S)),
    ]
    if cfg.grpc.max_connection_idle_s:
        opts.append(("grpc.max_connection_idle_ms", _ms(cfg.grpc.max_connection_idle_s)))
    if cfg.grpc.max_connection_age_s:
        opts.append(("grpc.max_connection_age_ms", _ms(cfg.grpc.max_connection_age_s)))
        if cfg.grpc.max_connection_age_grace_s:
            grace = _ms(cfg.grpc.max_connection_age_grace_s)
            opts.append(("grpc.max_connection_age_grace_ms", grace))
    if cfg.limits.max_connections:
        opts.append(("grpc.max_allowed_incoming_connections", cfg.limits.max_connections))
    return opts


@dataclass
class RouterServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


async def start_server(router: Router, host: str, port: int) -> RouterServer:
    """Bind the Generation service, health and reflection; health starts NOT_SERVING."""
    server = grpc.aio.server(
        options=grpc_options(router), interceptors=api_key_interceptors(router.cfg.api_key)
    )
    gen_grpc.add_GenerationServicer_to_server(GenerationService(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = add_port(server, f"{host}:{port}", router.cfg)  # TLS when configured
    await server.start()
    rs = RouterServer(server, health_servicer, bound)
    await rs.set_serving(False)
    return rs
