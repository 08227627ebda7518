"""The token stream (pool_api.token_stream, router.token_sink), the one token path: decode
workers push each engine step's tokens to the router over TCP; Ray carries only a heartbeat
while none come. Real sockets on loopback, real workers on the tiny checkpoint."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from decode_workers.worker import DecodeWorker
from engine.engine import LLMEngine
from engine.request import FinishReason
from engine.sampling import SamplingParams, TokenLogprob
from pdserve.checkpoint import write_checkpoint
from pdserve.client import make_request
from pdserve.config import ServeConfig
from pdserve.launch import build_router, engine_config
from pool_api.config import WorkerConfig
from pool_api.messages import Role, TokenBatch, TokenSink, WorkerRequest
from pool_api.token_stream import HEADER, SinkConnection, batch_of, delta, frame
from prefill_workers.worker import PrefillWorker
from router.active import RequestFailed
from router.clients import DecodeClient, PrefillClient
from router.token_sink import StreamLost, TokenSinkServer
from tests.in_process import generate


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


def serve_config(model: Path, colocated: bool = False, **router: Any) -> ServeConfig:
    return ServeConfig.load(
        None,
        {
            "model": {"model": str(model)},
            "transfer": {"transport": "local"},
            "router": router,
            "colocated": colocated,
        },
    )


def worker_config(cfg: ServeConfig, name: str, role: Role) -> WorkerConfig:
    return WorkerConfig(name, engine_config(cfg, Path(cfg.model.model)), cfg.transfer, cfg.index,
                        "tiny", role=role)  # fmt: skip


class CountingDecode(DecodeClient):
    def __init__(self, worker: DecodeWorker) -> None:
        super().__init__(worker.name, worker)
        self.calls: Counter[str] = Counter()

    async def heartbeat(self, request_id: str) -> bool:
        self.calls["heartbeat"] += 1
        return await super().heartbeat(request_id)


def test_delta_round_trip() -> None:
    lp = TokenLogprob(7, -0.25, ((7, -0.25), (9, -1.5)))
    for batch in (
        TokenBatch("r", (5, 7), "ab", (lp, lp), num_cached_tokens=32),
        TokenBatch("r", (), "", finished=True, finish_reason=FinishReason.LENGTH),
        TokenBatch("r", (), "", finished=True, finish_reason=FinishReason.ABORT, error="boom"),
    ):
        assert batch_of(delta(batch)) == batch


async def _sink_and_stream() -> tuple[TokenSinkServer, TokenSink]:
    server = TokenSinkServer("127.0.0.1")
    return server, await server.start()


def test_frames_arrive_in_order_and_a_lost_connection_is_told() -> None:
    async def main() -> None:
        server, sink = await _sink_and_stream()
        stream = server.open("r", "w0")
        conn = await asyncio.to_thread(SinkConnection, sink, "w0", lambda s, why: None)
        for i in range(50):
            conn.send(frame([delta(TokenBatch("r", (i,), str(i)))]))
        got = [await stream.get(5.0) for _ in range(50)]
        assert [b.token_ids for b in got if isinstance(b, TokenBatch)] == [(i,) for i in range(50)]
        conn.close()
        lost = await stream.get(5.0)
        assert isinstance(lost, StreamLost) and lost.worker == "w0"
        await server.stop()

    asyncio.run(main())


def test_a_connection_without_the_secret_is_refused() -> None:
    async def main() -> None:
        server, sink = await _sink_and_stream()
        stream = server.open("r", "w0")
        forged = TokenSink(sink.address, b"x" * 32)
        conn = await asyncio.to_thread(SinkConnection, forged, "w0", lambda s, why: None)
        conn.send(frame([delta(TokenBatch("r", (1,), "a"))]))
        assert await stream.get(1.0) is None  # nothing delivered, nothing lost
        assert server.num_rejected_total == 1
        conn.close()
        await server.stop()

    asyncio.run(main())


def test_a_router_that_reads_late_gets_every_byte_in_order() -> None:
    """Frames the socket cannot take at once queue behind each other for the flusher; none
    is reordered or lost, and sending never blocks the caller (the engine thread)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    frames = [frame([delta(TokenBatch("r", (i,), "x" * 20000))]) for i in range(200)]
    accepted: list[socket.socket] = []
    t = threading.Thread(target=lambda: accepted.append(lsock.accept()[0]))
    t.start()
    conn = SinkConnection(TokenSink(f"127.0.0.1:{port}", b"s"), "w0", lambda s, why: None)
    t.join(5)
    t0 = time.perf_counter()
    for f in frames:  # 4 MB: far past the socket buffers while nobody reads
        conn.send(f)
    assert time.perf_counter() - t0 < 1.0
    peer = accepted[0]
    want = b"".join(frames)
    got = bytearray()
    peer.settimeout(10)
    (n,) = HEADER.unpack(peer.recv(HEADER.size, socket.MSG_WAITALL))
    peer.recv(n, socket.MSG_WAITALL)  # the hello
    while len(got) < len(want):
        chunk = peer.recv(1 << 20)
        assert chunk
        got += chunk
    assert bytes(got) == want
    conn.close()
    peer.close()
    lsock.close()


@pytest.mark.parametrize("colocated", [False, True])
def test_pushed_tokens_are_the_engines_with_a_heartbeat_only_now_and_then(
    tiny_dir: Path, colocated: bool
) -> None:
    """Three requests one after another through a router: each gets the tokens the engine
    alone gives its prompt (the same arithmetic: one request at a time), every one of them
    on the token stream, with no Ray call per token (a heartbeat only after a second with
    no frame)."""
    prompts = [[4 + (i * 37 + j * 11) % 500 for j in range(40)] for i in range(3)]

    async def run() -> tuple[list[list[int]], int, int]:
        cfg = serve_config(tiny_dir, colocated)
        prefill = PrefillWorker(worker_config(cfg, "pdserve-prefill-0", Role.PREFILL))
        role = Role.COLOCATED if colocated else Role.DECODE
        decode = DecodeWorker(worker_config(cfg, "pdserve-decode-0", role))
        handle = CountingDecode(decode)
        pre = [] if colocated else [PrefillClient(prefill.name, prefill)]
        router = build_router(cfg, tiny_dir, pre, [handle])
        await router.start()
        outs: list[list[int]] = []
        try:
            for i, ids in enumerate(prompts):
                req = make_request(ids, f"r{i}", max_tokens=24, ignore_eos=True, temperature=0.0)
                outs.append((await generate(router, req))[0])
            frames = router.sinks.num_frames_total
        finally:
            await router.drain(0.0)
            prefill.shutdown()
            decode.shutdown()
        return outs, handle.calls["heartbeat"], frames

    pushed, heartbeats, frames = asyncio.run(run())
    engine = LLMEngine.from_config(engine_config(serve_config(tiny_dir), tiny_dir))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [engine.generate([ids], params)[0].output_token_ids for ids in prompts]
    assert pushed == alone and all(len(t) == 24 for t in pushed)
    assert frames >= 3 * 23  # every decode step's token came on the stream
    assert heartbeats <= 3, heartbeats


def test_a_dead_router_connection_frees_the_workers_streams(tiny_dir: Path) -> None:
    """The router's end goes away mid-stream: the worker's next send fails, it aborts the
    streams of that router and frees their blocks at once (not after the idle timeout)."""
    cfg = serve_config(tiny_dir)

    async def main() -> None:
        decode = DecodeWorker(worker_config(cfg, "pdserve-decode-0", Role.COLOCATED))
        server, sink = await _sink_and_stream()
        server.open("long", "pdserve-decode-0")
        try:
            params = SamplingParams(max_tokens=1900, ignore_eos=True)
            await decode.submit(WorkerRequest("long", tuple(range(4, 40)), params), sink)
            await asyncio.sleep(0.3)
            assert "long" in decode.streams
            await server.stop()
            deadline = time.monotonic() + 5
            while decode.streams and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert decode.streams == {}
            stats = await decode.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            decode.shutdown()

    asyncio.run(main())


def test_a_stream_whose_frames_flow_outlives_the_idle_bound(tiny_dir: Path) -> None:
    """A router gets no heartbeat call out while frames keep coming, so the worker's reaper
    must count a frame the router took as hearing from it: a stream decoding for many
    times `stream_idle_timeout_s` without a gap runs to its length, not to an abort."""
    idle_s = 0.3
    cfg = serve_config(tiny_dir)

    async def main() -> tuple[int, FinishReason | None, float]:
        wcfg = worker_config(cfg, "pdserve-decode-0", Role.COLOCATED)
        decode = DecodeWorker(replace(wcfg, stream_idle_timeout_s=idle_s))
        server, sink = await _sink_and_stream()
        stream = server.open("long", decode.name)
        try:
            t0 = time.monotonic()
            params = SamplingParams(max_tokens=1900, ignore_eos=True)
            await decode.submit(WorkerRequest("long", tuple(range(4, 40)), params), sink)
            n = 0
            while isinstance(item := await stream.get(10.0), TokenBatch):
                n += len(item.token_ids)
                if item.finished:
                    return n, item.finish_reason, time.monotonic() - t0
            return n, None, time.monotonic() - t0
        finally:
            decode.shutdown()
            await server.stop()

    n, reason, took_s = asyncio.run(main())
    assert (n, reason) == (1900, FinishReason.LENGTH), f"ended after {took_s:.2f} s"
    assert took_s > 3 * idle_s, f"{took_s:.2f} s: too quick to have met the reaper"


def test_a_request_the_worker_forgot_fails_by_heartbeat(tiny_dir: Path) -> None:
    """No more deltas come and the worker no longer knows the request: the heartbeat
    finds out and the request ends UNAVAILABLE, not hanging."""
    cfg = serve_config(tiny_dir, True, heartbeat_s=0.2)

    async def main() -> None:
        decode = DecodeWorker(worker_config(cfg, "pdserve-decode-0", Role.COLOCATED))
        router = build_router(cfg, tiny_dir, [], [DecodeClient(decode.name, decode)])
        await router.start()
        try:
            act = await router.admit(
                make_request(list(range(4, 40)), "gone", max_tokens=1900, ignore_eos=True)
            )
            t0 = time.monotonic()
            with pytest.raises(RequestFailed) as err:
                async for resp in router.run(act):
                    if resp.chunk.token_ids and "gone" in decode.streams:
                        # the worker drops it without a last delta (a bug, a lost frame)
                        await decode.loop.run(lambda: decode.engine.abort("gone"))
                        decode.streams.pop("gone")
            router.finish(act, False)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "token stream" in err.value.details
            assert time.monotonic() - t0 < 5
        finally:
            await router.drain(0.0)
            decode.shutdown()

    asyncio.run(main())


def test_requests_arriving_together_share_one_connection(tiny_dir: Path) -> None:
    """Eight submits at once open one connection to the sink: a duplicate, closed again,
    once told the router the worker's stream had ended and took the worker out of rotation."""
    cfg = serve_config(tiny_dir)

    async def main() -> None:
        decode = DecodeWorker(worker_config(cfg, "pdserve-decode-0", Role.COLOCATED))
        server, sink = await _sink_and_stream()
        streams = [server.open(f"r{i}", decode.name) for i in range(8)]
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            await asyncio.gather(*(
                decode.submit(WorkerRequest(f"r{i}", tuple(range(4, 40)), params), sink)
                for i in range(8)
            ))  # fmt: skip
            for stream in streams:
                n = 0
                while (item := await stream.get(5.0)) is not None:
                    assert isinstance(item, TokenBatch), item
                    n += len(item.token_ids)
                    if item.finished:
                        break
                assert n == 4
            assert server.num_connections_total == 1
        finally:
            decode.shutdown()
            await server.stop()

    asyncio.run(main())
