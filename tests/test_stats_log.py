"""The router's books without a server: the vLLM-named metrics' semantics, the one abort a
client that leaves adds, the observer fan-out, the request log and the periodic stats line
(router/metrics.py, router/active.py, router/stats_log.py), on a Router whose pools are
never called (tests/in_process.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest

from engine.request import FinishReason
from engine.sampling import SamplingParams
from pool_api.messages import WorkerRequest
from router.active import ActiveRequest, Observers, RequestObserver
from router.config import RouterConfig
from router.metrics import RouterMetrics, one_two_five
from router.stats_log import RequestLog, Snapshot, StatsLog, byte_rate, stats_line
from tests.in_process import router_without_workers

SECRET_PROMPT = "the prompt text never reaches a log"


def value(m: RouterMetrics, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(
        s.value
        for f in m.registry.collect()
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def make_router(**cfg: Any) -> tuple[Any, RouterMetrics]:
    router = router_without_workers(RouterConfig(**cfg))
    return router, RouterMetrics.install(router)


def admit(router: Any, rid: str = "r1", n_prompt: int = 10, cached: int = 0) -> ActiveRequest:
    wr = WorkerRequest(rid, tuple(range(n_prompt)), SamplingParams())
    act = ActiveRequest(wr, 0.0)
    act.cached_tokens = cached
    router.active[rid] = act
    router.num_queued += 1
    router.metrics.on_admit(act)
    return act


def send(router: Any, act: ActiveRequest, n: int) -> None:
    router.chunk(act, list(range(n)), "x" * n, ())


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Router.finish spawns its cleanup: it needs a running loop."""
    lp = asyncio.new_event_loop()
    asyncio.set_event_loop(lp)
    yield lp
    lp.run_until_complete(asyncio.sleep(0))
    lp.close()
    asyncio.set_event_loop(None)


def run(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> Any:
    async def call() -> Any:
        return fn(*args)

    return loop.run_until_complete(call())


def test_token_counters_and_histograms(loop: asyncio.AbstractEventLoop) -> None:
    router, m = make_router()
    act = admit(router, n_prompt=40, cached=32)
    send(router, act, 1)  # the first token (the prefill result)
    send(router, act, 3)
    send(router, act, 2)
    run(loop, router.complete, act, FinishReason.LENGTH)
    run(loop, router.finish, act, True)
    p = "pdserve:"
    assert value(m, p + "generation_tokens_total", role="router") == 6
    assert value(m, p + "prompt_tokens_total") == 40
    assert value(m, p + "prefill_tokens_cached_total") == 32
    assert value(m, p + "prefill_tokens_computed_total") == 8
    assert value(m, p + "time_to_second_token_seconds_count") == 1
    assert value(m, p + "request_time_per_output_token_seconds_count") == 1
    assert value(m, p + "request_prompt_tokens_sum") == 40
    assert value(m, p + "request_generation_tokens_sum") == 6
    assert value(m, p + "request_success_total", finished_reason="length") == 1
    assert value(m, p + "request_success_total", finished_reason="abort") == 0
    # not disaggregated (no prefill timings): no transfer observed
    assert value(m, p + "request_kv_transfer_bytes_count") == 0


def test_transfer_histograms_and_one_token_request(loop: asyncio.AbstractEventLoop) -> None:
    router, m = make_router()
    act = admit(router)
    act.timings.transfer_ms, act.timings.transfer_total_ms = 1.0, 4.0
    act.kv_transfer_bytes = 123_456
    send(router, act, 1)
    run(loop, router.complete, act, FinishReason.STOP)
    run(loop, router.finish, act, True)
    assert value(m, "pdserve:request_kv_transfer_bytes_sum") == 123_456
    assert value(m, "pdserve:request_kv_transfer_seconds_sum") == pytest.approx(0.004)
    assert value(m, "pdserve:kv_transfer_seconds_sum") == pytest.approx(0.001)
    # one output token: no second token, no time per output token
    assert value(m, "pdserve:time_to_second_token_seconds_count") == 0
    assert value(m, "pdserve:request_time_per_output_token_seconds_count") == 0


def test_client_gone_is_one_abort(loop: asyncio.AbstractEventLoop) -> None:
    router, m = make_router()
    gone = admit(router, "gone")
    send(router, gone, 2)
    run(loop, router.finish, gone, False)  # the client disconnected mid-stream
    assert value(m, "pdserve:request_success_total", finished_reason="abort") == 1
    assert value(m, "pdserve:e2e_request_latency_seconds_count") == 1
    # its completion went out, then the client left before the server noticed: no abort
    late = admit(router, "late")
    send(router, late, 1)
    run(loop, router.complete, late, FinishReason.STOP)
    run(loop, router.finish, late, False)
    # it failed after admission (RequestFailed): a failure, not an abort
    failed = admit(router, "failed")
    failed.failure = grpc.StatusCode.UNAVAILABLE
    run(loop, router.finish, failed, False)
    assert value(m, "pdserve:request_success_total", finished_reason="abort") == 1
    assert value(m, "pdserve:request_success_total", finished_reason="stop") == 1
    assert value(m, "pdserve:request_success_total") == 2
    assert router.num_queued == 0 and not router.active


def test_observers_fan_out_and_install_is_idempotent() -> None:
    seen: list[str] = []

    class Spy(RequestObserver):
        def on_complete(self, act: ActiveRequest, reason: FinishReason, now: float) -> None:
            seen.append(reason.value)

    router, m = make_router(log_requests=True)
    assert RouterMetrics.install(router) is m
    assert isinstance(router.metrics, Observers)
    assert router.metrics.find(RequestLog) is not None
    assert router.metrics.observers[0] is m  # the metrics first
    router.metrics.add(Spy())
    act = admit(router)
    send(router, act, 1)
    router.complete(act, FinishReason.STOP)
    router.complete(act, FinishReason.STOP)  # counted once whatever calls it again
    assert seen == ["stop"]
    assert value(m, "pdserve:request_success_total") == 1


def test_request_log_line(loop: asyncio.AbstractEventLoop, caplog: Any) -> None:
    router, _ = make_router(log_requests=True)
    caplog.set_level(logging.INFO, logger="router.stats_log.requests")
    act = admit(router, "id\nforged line", n_prompt=12, cached=4)
    send(router, act, 3)
    run(loop, router.complete, act, FinishReason.LENGTH)
    run(loop, router.finish, act, True)
    failed = admit(router, "f1")
    failed.failure = grpc.StatusCode.RESOURCE_EXHAUSTED
    run(loop, router.finish, failed, False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "\n" not in lines[0] and "'id\\nforged line'" in lines[0]
    for part in ("finished: length", "prompt_tokens=12", "cached_tokens=4"):
        assert part in lines[0]
    assert "completion_tokens=3" in lines[0] and "ttft=" in lines[0] and "e2e=" in lines[0]
    assert "failed: RESOURCE_EXHAUSTED" in lines[1]
    assert all(SECRET_PROMPT not in line for line in lines)


def test_request_log_off_by_default() -> None:
    router, _ = make_router()
    assert router.metrics.find(RequestLog) is None


def test_stats_line_from_the_metrics(loop: asyncio.AbstractEventLoop) -> None:
    router, m = make_router(stats_log_interval_s=5.0)
    assert isinstance(router.stats_log, StatsLog)
    assert router.stats_log.interval_s == 5.0
    prev = Snapshot.of(m.registry, 0.0)
    act = admit(router, n_prompt=100, cached=50)
    act.timings.transfer_ms = 1.0
    act.kv_transfer_bytes = 2_000_000_000
    send(router, act, 1)
    send(router, act, 19)
    run(loop, router.complete, act, FinishReason.LENGTH)
    run(loop, router.finish, act, True)
    router.decode.workers[0].stats = replace(router.decode.workers[0].stats, num_free_blocks=6)
    cur = Snapshot.of(m.registry, 2.0)
    line = stats_line(prev, cur)
    assert "Avg prompt throughput: 50.0 tokens/s" in line
    assert "Avg generation throughput: 10.0 tokens/s" in line
    assert "Running: 0 reqs, Waiting: 0 reqs" in line
    assert "KV cache usage: decode 25.0%, prefill 0.0%" in line
    assert "Prefix cache hit rate: 50.0%" in line
    assert "KV transfer: 1.000 GB/s" in line
    assert cur.active(prev) and not cur.active(cur)


def test_the_transfer_rate_reads_at_every_scale() -> None:
    """A small model moves kilobytes a request: its rate must not print as 0.000 GB/s."""
    assert [byte_rate(r) for r in (1.5e9, 2.5e6, 3.4e5, 12.0, 0.0)] == [
        "1.500 GB/s",
        "2.5 MB/s",
        "340.0 kB/s",
        "12 B/s",
        "0 B/s",
    ]


def test_stats_log_levels(loop: asyncio.AbstractEventLoop, caplog: Any) -> None:
    router, _ = make_router()
    sl = router.stats_log
    assert sl is not None and sl.interval_s == 10.0  # the default
    caplog.set_level(logging.DEBUG, logger="router.stats_log")
    prev = sl.snapshot()
    act = admit(router)
    send(router, act, 1)
    prev, active = sl.log_once(prev, False)  # traffic: INFO
    run(loop, router.complete, act, FinishReason.STOP)
    run(loop, router.finish, act, True)
    prev, active = sl.log_once(prev, active)  # the interval after it: INFO (drops to 0)
    sl.log_once(prev, active)  # idle: DEBUG
    levels = [r.levelno for r in caplog.records if r.name == "router.stats_log"]
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG]
    assert "Running: 1 reqs" in caplog.records[0].getMessage()


def test_stats_log_off_and_validated() -> None:
    router, _ = make_router(stats_log_interval_s=0)
    assert router.stats_log is None
    with pytest.raises(ValueError, match="stats_log_interval_s"):
        RouterConfig(stats_log_interval_s=-1)


def test_one_two_five_buckets() -> None:
    assert one_two_five(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_cache_config_info() -> None:
    _, m = make_router()
    rows = [
        s.labels
        for f in m.registry.collect()
        for s in f.samples
        if s.name == "pdserve:cache_config_info"
    ]
    assert {r["role"] for r in rows} == {"prefill", "decode"}
    for r in rows:
        assert r["block_size"] == "16" and r["num_gpu_blocks"] == "8"
        assert r["enable_prefix_caching"] == "True" and r["cache_dtype"]
