"""Connection hygiene (docs/config.md#connections), over real sockets on loopback.

- HTTP (router/http_guard.py on uvicorn, in process on a router without workers): 20
  connections with half a request head (some silent, some trickling bytes) are all answered
  408 and closed within the header timeout while a normal request still works; a stalled
  body is dropped, an idle keep-alive connection closed, a half head after a keep-alive
  wait closed again; one connection over the cap is refused at once with 503 (HTTP) or
  closed (gRPC).
- gRPC router server: its options as configured; a third stream on a connection allowing
  two waits; silent TCP connections are closed after the handshake timeout; an idle
  connection gets GOAWAY.
- grpc KV endpoint: Push streams beyond its limit are refused at once with
  RESOURCE_EXHAUSTED (a real transfer fails fast instead of hanging behind idle streams, and
  lands once the idle ones are cancelled); a stream that stalls mid-frame is cancelled after
  the idle timeout and its reservation failed, its blocks freed.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import kv_procs
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.block_manager import BlockManager
from kv_transfer.config import TransferConfig
from kv_transfer.receiver import KVReceiver, ReservationState
from kv_transfer.sender import KVSender
from kv_transfer.transports.base import get_transport
from kv_transfer.transports.grpc_stream import (
    PUSH_METHOD,
    GrpcEndpoint,
    GrpcTransport,
    encode_data_chunk,
)
from kv_transfer.wire import TransferError, as_bytes, block_runs, frame_regions, make_header
from protos.pdserve.v1 import kv_transfer_pb2 as pb
from router import http_guard, service
from router.config import GrpcSettings, HttpSettings, LimitSettings, RouterConfig
from tests.in_process import servers_without_workers

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 1.0  # every timeout under test
LATE_S = 2.5  # later than this after its deadline counts as never (2 shared cores)
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "


# ---- servers in process ---------------------------------------------------------------------
@dataclass
class Servers:
    grpc_port: int
    http_port: int


@contextlib.contextmanager
def serving(cfg: RouterConfig) -> Iterator[Servers]:
    """The router's gRPC server and HTTP app on a router without workers, on their own loop."""
    with servers_without_workers(cfg) as (grpc_port, http_port):
        yield Servers(grpc_port, http_port)


# The connection timeouts nobody tunes are module constants; here they are TIMEOUT_S.
DEFAULT_TIMEOUTS = {
    (http_guard, "HEADER_TIMEOUT_S"): http_guard.HEADER_TIMEOUT_S,
    (http_guard, "BODY_TIMEOUT_S"): http_guard.BODY_TIMEOUT_S,
    (service, "HANDSHAKE_TIMEOUT_S"): service.HANDSHAKE_TIMEOUT_S,
}


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, name in DEFAULT_TIMEOUTS:
        monkeypatch.setattr(module, name, TIMEOUT_S)


def router_cfg(max_connections: int = 1024, **grpc_settings: Any) -> RouterConfig:
    return RouterConfig(
        http=HttpSettings(port=0, keepalive_timeout_s=TIMEOUT_S),
        grpc=GrpcSettings(port=0, **grpc_settings),
        limits=LimitSettings(max_connections=max_connections),
    )


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def read_to_close(s: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (monotonic)."""
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got, time.monotonic()


def health_status(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


# ---- HTTP ----------------------------------------------------------------------------------
def test_half_sent_heads_are_closed_within_the_header_timeout() -> None:
    """20 connections owe the rest of their request head: 5 send nothing, 10 half a head,
    5 trickle a byte every 0.2 s (a deadline, not an idle limit). All get 408 and are
    closed about TIMEOUT_S after they connected; a whole request meanwhile gets 200."""
    with serving(router_cfg()) as srv:
        socks, opened = [], []
        for i in range(20):
            socks.append(connect(srv.http_port))
            opened.append(time.monotonic())
            if i >= 5:
                socks[-1].sendall(HALF_HEAD)
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.2):
                for s in socks[15:]:
                    with contextlib.suppress(OSError):
                        s.sendall(b"x")

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        assert health_status(srv.http_port) == 200  # while all 20 are open
        try:
            results = [read_to_close(s) for s in socks]
        finally:
            stop.set()
            trickler.join(5)
            for s in socks:
                s.close()
        after = [round(closed - t0, 2) for (_, closed), t0 in zip(results, opened, strict=True)]
        print(f"20 half-sent requests closed after {min(after)}-{max(after)} s")
        assert all(got.startswith(b"HTTP/1.1 408 ") for got, _ in results), results
        assert all(0.9 * TIMEOUT_S <= a <= TIMEOUT_S + LATE_S for a in after), after
        assert health_status(srv.http_port) == 200


def read_health(s: socket.socket) -> bytes:
    """One whole /health response (a short JSON body) off a keep-alive connection."""
    got = b""
    while not got.endswith(b"}"):
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    return got


def test_stalled_body_and_idle_keepalive_are_closed() -> None:
    """A body that stops, a keep-alive connection left idle after its response, and half a
    head sent during a keep-alive wait: each closed about TIMEOUT_S after its last byte."""
    health = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with serving(router_cfg()) as srv:
        body = connect(srv.http_port)  # promises 100 bytes, sends 10
        body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b"{" * 10
        )
        t_body = time.monotonic()
        idle = connect(srv.http_port)  # one whole request, then nothing
        idle.sendall(health)
        t_idle = time.monotonic()
        again = connect(srv.http_port)  # one whole request, half of the next one
        again.sendall(health)
        assert read_health(again).startswith(b"HTTP/1.1 200 ")
        time.sleep(TIMEOUT_S / 2)  # within the keep-alive wait
        again.sendall(HALF_HEAD)
        t_again = time.monotonic()
        try:
            got_body, closed_body = read_to_close(body)
            got_idle, closed_idle = read_to_close(idle)
            got_again, closed_again = read_to_close(again)
        finally:
            for s in (body, idle, again):
                s.close()
        after = [t1 - t0 for t0, t1 in ((t_body, closed_body), (t_idle, closed_idle))]
        after.append(closed_again - t_again)
        print(
            "stalled body, idle keep-alive, half head after keep-alive closed after "
            + ", ".join(f"{a:.2f}" for a in after)
            + " s"
        )
        assert all(0.9 * TIMEOUT_S <= a <= TIMEOUT_S + LATE_S for a in after), after
        assert got_body == b""  # the request saw a disconnect
        assert got_idle.startswith(b"HTTP/1.1 200 ") and got_idle.endswith(b"}")
        assert got_again.startswith(b"HTTP/1.1 408 ")


def test_one_connection_over_the_cap_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = 4
    monkeypatch.setattr(http_guard, "HEADER_TIMEOUT_S", 30.0)
    with serving(router_cfg(max_connections=cap)) as srv:
        held = [connect(srv.http_port) for _ in range(cap)]
        time.sleep(0.2)  # the server has taken them all
        extra = connect(srv.http_port)
        t0 = time.monotonic()
        got, closed = read_to_close(extra)
        extra.close()
        assert got.startswith(b"HTTP/1.1 503 ") and closed - t0 < 1.0, got
        held.pop().close()
        time.sleep(0.2)
        assert health_status(srv.http_port) == 200  # a freed slot serves again
        for s in held:
            s.close()

        target = f"127.0.0.1:{srv.grpc_port}"
        local = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
        channels = [grpc.insecure_channel(target, options=local) for _ in range(cap + 1)]
        try:
            codes = [_check(ch) for ch in channels]
        finally:
            for ch in channels:
                ch.close()
        assert codes == [grpc.StatusCode.OK] * cap + [grpc.StatusCode.UNAVAILABLE], codes


# ---- gRPC ----------------------------------------------------------------------------------
def _check(channel: grpc.Channel, timeout_s: float = 5.0) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s
        )
    except grpc.RpcError as e:
        code: grpc.StatusCode = e.code()
        return code
    return grpc.StatusCode.OK


def test_grpc_options_follow_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.service import connection_options

    for (module, name), default in DEFAULT_TIMEOUTS.items():
        monkeypatch.setattr(module, name, default)
    defaults = dict(connection_options(RouterConfig()))
    assert defaults["grpc.max_concurrent_streams"] == 1024
    assert defaults["grpc.server_handshake_timeout_ms"] == 20_000
    assert defaults["grpc.keepalive_time_ms"] == 60_000
    assert defaults["grpc.keepalive_timeout_ms"] == 20_000
    assert defaults["grpc.max_connection_idle_ms"] == 300_000
    assert defaults["grpc.max_allowed_incoming_connections"] == 1024
    assert "grpc.max_connection_age_ms" not in defaults  # age off: streams are never cut
    aged = dict(connection_options(RouterConfig(grpc=GrpcSettings(max_connection_age_s=1800))))
    assert aged["grpc.max_connection_age_ms"] == 1_800_000
    assert "grpc.max_connection_age_grace_ms" not in aged  # unlimited grace (gRPC's default)
    graced = RouterConfig(
        grpc=GrpcSettings(max_connection_age_s=1800, max_connection_age_grace_s=1e9)
    )
    assert dict(connection_options(graced))["grpc.max_connection_age_grace_ms"] == 2**31 - 1
    off = dict(
        connection_options(
            RouterConfig(
                grpc=GrpcSettings(max_connection_idle_s=0),
                limits=LimitSettings(max_connections=0),
            )
        )
    )
    assert "grpc.max_allowed_incoming_connections" not in off
    assert "grpc.max_connection_idle_ms" not in off
    with pytest.raises(ValueError, match=r"router\.limits\.max_connections=-1 must be >= 1"):
        LimitSettings(max_connections=-1)
    with pytest.raises(ValueError, match=r"router\.http\.keepalive_timeout_s=0 must be > 0"):
        HttpSettings(keepalive_timeout_s=0)


def test_grpc_streams_handshakes_and_idle_connections() -> None:
    cfg = router_cfg(max_concurrent_streams=2, max_connection_idle_s=TIMEOUT_S)
    with serving(cfg) as srv:
        target = f"127.0.0.1:{srv.grpc_port}"
        silent = [connect(srv.grpc_port) for _ in range(5)]  # never send the HTTP/2 preface
        t0 = time.monotonic()
        with grpc.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
            for w in watches:
                next(w)  # both streams open
            assert _check(ch, TIMEOUT_S) == grpc.StatusCode.DEADLINE_EXCEEDED  # no third
            watches[0].cancel()
            assert _check(ch) == grpc.StatusCode.OK
            watches[1].cancel()
            states: list[tuple[float, grpc.ChannelConnectivity]] = []
            t_idle = time.monotonic()
            ch.subscribe(lambda s: states.append((time.monotonic() - t_idle, s)))
            closed = [read_to_close(s)[1] - t0 for s in silent]
            for s in silent:
                s.close()
            deadline = time.monotonic() + TIMEOUT_S + LATE_S
            while time.monotonic() < deadline and (
                not states or states[-1][1] != grpc.ChannelConnectivity.IDLE
            ):
                time.sleep(0.05)
        print(f"silent gRPC connections closed after {min(closed):.2f}-{max(closed):.2f} s")
        assert all(0.9 * TIMEOUT_S <= c <= TIMEOUT_S + LATE_S for c in closed), closed
        assert states[-1][1] == grpc.ChannelConnectivity.IDLE, states  # GOAWAY: idle


# ---- the grpc KV endpoint ------------------------------------------------------------------
RX_BLOCKS = 16


class Rx:
    def __init__(self) -> None:
        self.cache = kv_procs.make_cache("float32", RX_BLOCKS)
        self.blocks = BlockManager(RX_BLOCKS, kv_procs.BLOCK_SIZE)
        self.receiver = KVReceiver(self.cache, self.blocks, lease_s=30.0, transport="grpc")


@contextlib.contextmanager
def kv_endpoint(max_streams: int) -> Iterator[tuple[Rx, GrpcEndpoint]]:
    rx = Rx()
    transport = get_transport("grpc", timeout_s=TIMEOUT_S)
    assert isinstance(transport, GrpcTransport)
    transport.max_push_streams = max_streams
    endpoint = transport.listen(rx.receiver)
    assert isinstance(endpoint, GrpcEndpoint) and endpoint.max_streams == max_streams
    rx.receiver.address = endpoint.address
    try:
        yield rx, endpoint
    finally:
        endpoint.close()


def push_call(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    return channel.stream_unary(PUSH_METHOD, response_deserializer=pb.TransferAck.FromString)


def final_code(call: Any, timeout_s: float) -> grpc.StatusCode:
    """How a push call ended (FutureTimeoutError if it has not within `timeout_s`)."""
    call.exception(timeout=timeout_s)
    code: grpc.StatusCode = call.code()
    return code


def stalled(first: list[bytes], release: threading.Event) -> Iterator[bytes]:
    """A push that sends `first`, then nothing until `release` (or 30 s)."""
    yield from first
    release.wait(30)


def src_cache() -> Any:
    cache = kv_procs.make_cache("float32", kv_procs.SRC_BLOCKS)
    kv_procs.fill(cache, 11)
    return cache


def test_kv_push_streams_over_the_limit_are_refused_not_queued() -> None:
    limit = 3
    release = threading.Event()
    with kv_endpoint(limit) as (rx, endpoint):
        channel = grpc.insecure_channel(endpoint.address)
        sender = KVSender(src_cache(), "p", get_transport("grpc", timeout_s=10.0))
        try:
            t0 = time.monotonic()
            idle = [push_call(channel).future(stalled([], release)) for _ in range(limit + 2)]
            # The two over the limit end at once; the others cannot end before the idle limit.
            deadline = time.monotonic() + TIMEOUT_S / 2
            while sum(f.done() for f in idle) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            refused = [f for f in idle if f.done()]
            assert [f.code() for f in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
            ticket = rx.receiver.reserve("r", 16 * 3 + 5)
            src_ids = kv_procs.spread_ids(len(ticket.dst_block_ids))
            t_send = time.monotonic()
            with pytest.raises(TransferError, match="RESOURCE_EXHAUSTED"):
                sender.send(ticket, src_ids)  # refused at once, not after its 10 s timeout
            refused_after = time.monotonic() - t_send
            res = rx.receiver.get(ticket.transfer_id)
            assert res is not None and res.state is ReservationState.RESERVED
            waiting = [f for f in idle if f not in refused]
            codes = [final_code(f, TIMEOUT_S + LATE_S) for f in waiting]  # after the idle limit
            assert codes == [grpc.StatusCode.CANCELLED] * limit
            cancelled_after = time.monotonic() - t0
            assert endpoint.servicer.idle.num_cancelled == limit
            ack = sender.send(ticket, src_ids)  # the slots are free again
            assert ack.status == pb.TRANSFER_STATUS_COMPLETE
            landed = rx.cache.data[:, :, list(ticket.dst_block_ids)]
            assert kv_procs.same_bytes(landed, kv_procs.source_pages("float32", 11, src_ids))
        finally:
            release.set()
            sender.close()
            channel.close()
    print(
        f"push over the limit refused in {refused_after:.3f} s; "
        f"idle streams cancelled after {cancelled_after:.2f} s"
    )
    assert refused_after < 5.0  # refused, not left to its 10 s transport timeout
    assert 0.9 * TIMEOUT_S <= cancelled_after <= TIMEOUT_S + LATE_S


def test_kv_push_stalled_mid_frame_is_cancelled_and_its_blocks_freed() -> None:
    release = threading.Event()
    with kv_endpoint(4) as (rx, endpoint):
        free_before = rx.blocks.num_free_blocks
        ticket = rx.receiver.reserve("r", 16 * 2 + 3)
        assert rx.blocks.num_free_blocks < free_before
        src = src_cache()
        src_ids = kv_procs.spread_ids(len(ticket.dst_block_ids))
        dst = list(ticket.dst_block_ids)
        h = make_header("r", ticket.transfer_id, src.spec, 0, 1, src_ids, dst)
        regions = frame_regions(src, 0, 1, block_runs(src_ids, dst), "src")
        payload = b"".join(as_bytes(r).numpy().tobytes() for r in regions)
        first = [
            pb.KVChunk(header=h).SerializeToString(),
            encode_data_chunk(memoryview(payload[: len(payload) // 2])),  # half a frame
        ]
        with grpc.insecure_channel(endpoint.address) as channel:
            t0 = time.monotonic()
            call = push_call(channel).future(stalled(first, release))
            try:
                assert final_code(call, TIMEOUT_S + LATE_S) == grpc.StatusCode.CANCELLED
                deadline = time.monotonic() + LATE_S
                while rx.receiver.get(ticket.transfer_id) is not None:
                    assert time.monotonic() < deadline, "the reservation was not failed"
                    time.sleep(0.02)
                freed_after = time.monotonic() - t0
            finally:
                release.set()
        assert rx.blocks.num_free_blocks == free_before  # its blocks are free again
        rx.blocks.check_integrity()
        assert endpoint.servicer.idle.num_cancelled == 1
    print(f"stalled push cancelled and its blocks freed after {freed_after:.2f} s")
    assert 0.9 * TIMEOUT_S <= freed_after <= TIMEOUT_S + LATE_S


def test_transfer_config_max_push_streams() -> None:
    assert TransferConfig().max_push_streams == GrpcTransport.max_push_streams == 128
    with pytest.raises(ValueError, match="max_push_streams"):
        TransferConfig(max_push_streams=0)


# ---- the fd limit --------------------------------------------------------------------------
def test_fd_limit_is_raised_toward_the_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from pdserve import serve

    limits = {"soft": 400, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))

    def setrlimit(_: int, new: tuple[int, int]) -> None:
        limits["soft"] = new[0]

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert serve.raise_fd_limit(RouterConfig(limits=LimitSettings(max_connections=1024))) is None
    assert limits["soft"] == 2 * 1024 + serve.FD_RESERVE
    limits["soft"] = 400
    warning = serve.raise_fd_limit(RouterConfig(limits=LimitSettings(max_connections=4096)))
    assert limits["soft"] == 4096 and warning is not None and "max_connections" in warning
    assert serve.raise_fd_limit(RouterConfig(limits=LimitSettings(max_connections=0))) is None
