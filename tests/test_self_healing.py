"""The default deployment heals: `pdserve serve` with no restart flags, `kill -9` of its only
decode worker under load.

Every in-flight request ends (completed, or UNAVAILABLE) within 10 s of the kill, health says
NOT_SERVING while the decode pool has no live worker and SERVING once Ray has restarted it, and
requests succeed again within 30 s. Before `pool.max_restarts` defaulted to a bound above 0
no request succeeded again (the chaos harness set 5, which is why it passed).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.client import Client
from tests.serve_proc import ServeProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("heal"))
    yield proc
    proc.stop()


def decode_worker_pids(server: ServeProcess) -> list[int]:
    """The decode workers' processes, as the server's pool admin reports them (each
    worker's stats carry its pid): never another server's on the host (`make test` runs
    two test workers side by side)."""
    status, _, body = server.request("GET", "/v1/admin/pool", timeout_s=5)
    assert status == 200, body
    workers = json.loads(body)["workers"]
    return [w["pid"] for w in workers if w["role"] == "decode" and "pid" in w]


def health(server: ServeProcess) -> int:
    status, _, _ = server.request("GET", "/health", timeout_s=5)
    return status


def grpc_health(server: ServeProcess) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.grpc_target) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def test_kill_9_of_the_only_decode_worker_heals(server: ServeProcess) -> None:
    client = Client(server.grpc_target, timeout_s=60)
    assert client.generate("warm up", max_tokens=4, temperature=0).complete is not None
    (pid,) = decode_worker_pids(server)

    ends: list[tuple[str, float]] = []  # (outcome, monotonic end)

    def one() -> None:
        try:
            out = client.generate("a long answer", max_tokens=1500, ignore_eos=True)
            ends.append(("ok" if out.complete else "no final message", time.monotonic()))
        except grpc.RpcError as e:
            ends.append((e.code().name, time.monotonic()))

    load = [threading.Thread(target=one) for _ in range(6)]
    for t in load:
        t.start()
    time.sleep(1.0)  # the streams are decoding
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    statuses: list[int] = []
    grpc_statuses: list[str] = []
    recovered = None
    watching = True

    def watch() -> None:  # both health endpoints, sampled densely: the outage may be short
        while watching:
            statuses.append(health(server))
            grpc_statuses.append(grpc_health(server))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    while time.monotonic() - killed < 30 and recovered is None:
        try:
            out = Client(server.grpc_target, timeout_s=5).generate("probe", max_tokens=2)
            if out.complete is not None:
                recovered = time.monotonic() - killed
        except grpc.RpcError:
            time.sleep(0.3)
    for t in load:
        t.join(15)
    watching = False
    watcher.join(10)

    assert len(ends) == len(load), "a request never ended"
    assert {outcome for outcome, _ in ends} <= {"ok", "UNAVAILABLE"}, ends
    assert max(end for _, end in ends) - killed <= 10, "a request ended more than 10 s late"
    assert recovered is not None, f"nothing succeeded within 30 s:\n{server.log_tail()}"
    print(f"first request served {recovered:.1f} s after the kill")  # shown with -s
    assert 503 in statuses, "HTTP /health never said the decode pool was down"
    assert "NOT_SERVING" in grpc_statuses, "gRPC health never said the decode pool was down"
    assert server.wait_for(lambda: health(server) == 200, timeout_s=10)
    assert server.wait_for(lambda: grpc_health(server) == "SERVING", timeout_s=10)
    (new_pid,) = decode_worker_pids(server)
    assert new_pid != pid
    log = Path(server.log_path).read_text()
    assert "decode worker pdserve-decode-0 is down" in log
    assert "decode worker pdserve-decode-0 is back after" in log


class CountingWorker:
    """A worker that answers `stats` and counts the calls (the unit under test is the
    router's refresh policy, not a worker); the in-memory index pull gets no events."""

    def __init__(self, name: str, role: str, fail: bool = False) -> None:
        self.name, self.role, self.fail, self.calls = name, role, fail, 0

    async def stats(self) -> object:
        from pool_api.messages import Role, WorkerStats

        self.calls += 1
        if self.fail:
            raise ConnectionError("gone")
        return WorkerStats(self.name, Role(self.role), 8, 8, 0, 0, 0, 0, 0, 0)

    async def take_index_update(self, with_held: bool = False) -> object:
        from pool_api.messages import IndexUpdate

        return IndexUpdate(self.name, "epoch", ())


def _router(workers: list[CountingWorker]) -> object:
    from typing import Any

    from pool_api.messages import Role
    from protos.pdserve.v1 import generation_pb2 as gen
    from router.clients import DecodeClient, PrefillClient
    from router.config import RouterConfig
    from router.core import Router
    from router.pools import Pool
    from router.validation import ModelLimits

    def client(w: Any) -> Any:
        return PrefillClient(w.name, w) if w.role == "prefill" else DecodeClient(w.name, w)

    info = gen.ModelInfo(served_model_name="m", max_context_length=2048, block_size=16)
    pools: list[Any] = [Pool(Role(w.role), [client(w)]) for w in workers]
    router = Router(RouterConfig(), ModelLimits("m", 512, 2048), None, info, pools[0], pools[1],
                    "local")  # fmt: skip
    router.stats_refresh_s = 0.5
    return router


def test_server_info_is_served_from_cached_stats() -> None:
    import asyncio

    prefill, decode = CountingWorker("p", "prefill"), CountingWorker("d", "decode")
    router = _router([prefill, decode])

    async def spam() -> None:
        await router.refresh()  # type: ignore[attr-defined]
        for _ in range(200):
            info = await router.server_info()  # type: ignore[attr-defined]
            assert len(info.workers) == 2

    asyncio.run(spam())
    assert prefill.calls <= 2 and decode.calls <= 2, (prefill.calls, decode.calls)


def test_server_info_says_each_workers_health_at_once() -> None:
    """A prefill worker that never answers: GetServerInfo answers from what the router
    knows (no call to a worker), listing it as not healthy, and the router as degraded."""
    import asyncio

    prefill, decode = CountingWorker("p", "prefill", fail=True), CountingWorker("d", "decode")
    router = _router([prefill, decode])

    async def main() -> object:
        await router.refresh()  # type: ignore[attr-defined]
        calls = prefill.calls + decode.calls
        info = await router.server_info()  # type: ignore[attr-defined]
        assert prefill.calls + decode.calls == calls  # answered without asking a worker
        return info

    info: object = asyncio.run(main())
    workers = {w.name: (w.role, w.healthy) for w in info.workers}  # type: ignore[attr-defined]
    assert workers == {"p": ("prefill", False), "d": ("decode", True)}
    assert info.status == "degraded"  # type: ignore[attr-defined]
    assert "no prefill worker" in " ".join(info.degraded)  # type: ignore[attr-defined]


def test_a_down_worker_is_probed_with_backoff() -> None:
    import asyncio

    from router.pools import MAX_PROBE_INTERVAL_S

    prefill, decode = CountingWorker("p", "prefill"), CountingWorker("d", "decode", fail=True)
    router = _router([prefill, decode])
    changes: list[bool] = []

    async def record(serving: bool) -> None:
        changes.append(serving)

    router.on_serving_change = record  # type: ignore[attr-defined]

    async def refresh_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await router.refresh()  # type: ignore[attr-defined]
            await asyncio.sleep(0.05)

    asyncio.run(refresh_for(3.0))
    assert not router.serviceable()  # type: ignore[attr-defined]
    # 0.5, 1, 2 s apart: about 3 probes in 3 s against 60 refreshes
    assert 2 <= decode.calls <= 4, decode.calls
    assert prefill.calls >= 30  # a live worker is asked every refresh
    assert MAX_PROBE_INTERVAL_S <= 10
    decode.fail = False
    asyncio.run(refresh_for(3.0))
    assert router.serviceable()  # type: ignore[attr-defined]
    assert changes == [True], changes  # it came back; it was never up before
