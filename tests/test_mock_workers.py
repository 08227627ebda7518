"""Mock workers (`pdserve.tools.mock_workers`) behind the real router, on a real local Ray
cluster: what `make bench-pool`'s scale and planner runs rest on.

A request through the router over mock workers ends with every token it asked for; a drain
and a flip of mock workers under load lose nothing; afterwards no mock holds a request or a
block. The step model is hand-written: 10 ms a step plus 10 us a prompt token, so 8 tokens
take ~0.1 s and the drain and the flip find requests in flight, and the module's cost is
Ray's start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.tools.mock_workers import (
    MockLauncher,
    drive,
    mock_router,
    router_overhead_s,
    start_hosts,
    take_marks,
)
from pool_api.messages import Role
from protos.pdserve.v1 import generation_pb2 as gen
from tests.in_process import start_local_ray

STEP_MODEL = {"a": 0.01, "chunks": 0.0, "sum_n": 1e-5, "sum_n2": 0.0, "sum_n_ctx": 0.0,
              "batch": 1e-4, "sum_ctx": 0.0}  # fmt: skip
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[Any]]:
    import ray

    start_local_ray()
    yield start_hosts(2, STEP_MODEL)
    ray.shutdown()


def _request(i: int) -> gen.GenerateRequest:
    sampling = gen.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [100 + (i * 7 + j) % 3000 for j in range(64)]
    return gen.GenerateRequest(token_ids=gen.TokenIds(ids=ids), sampling=sampling)


def test_requests_drains_and_flips_through_mock_workers_lose_nothing(hosts: list[Any]) -> None:
    async def run() -> tuple[list[str], dict[str, Any], list[Any]]:
        placed: dict[str, Any] = {}
        router = await mock_router(2, 2, hosts, placed)
        router.admin.launcher = MockLauncher(hosts, placed)
        await router.start()
        try:
            first = [
                asyncio.ensure_future(drive(router, _request(i), MAX_TOKENS)) for i in range(24)
            ]
            await asyncio.sleep(0.02)  # some in flight on every worker
            drained = await router.admin.drain("mock-decode-0")
            flipped = await router.admin.flip("mock-prefill-1", Role.DECODE)
            more = [drive(router, _request(100 + i), MAX_TOKENS) for i in range(16)]
            outs = await asyncio.gather(*first, *more)
            stats = await asyncio.gather(
                *(w.client.stats() for w in router.prefill.workers + router.decode.workers)
            )
            return [o.outcome for o in outs], {"drain": drained, "flip": flipped}, stats
        finally:
            await router.drain(0.0)

    outcomes, ops, stats = asyncio.run(run())
    assert outcomes == ["ok"] * 40, outcomes
    assert ops["drain"] and ops["flip"], ops
    assert all(s.num_running == 0 and s.num_free_blocks == s.num_total_blocks for s in stats), stats


def test_the_router_overhead_is_measured_on_every_request(hosts: list[Any]) -> None:
    """`router_overhead_s`, what `make bench-pool` reports per request, has its marks on
    every request, disaggregated and colocated, and is a share of its latency: the time
    between the mocks' answers and their next call, not the workers' own."""

    async def run() -> list[tuple[Any, float | None]]:
        placed: dict[str, Any] = {}
        router = await mock_router(1, 1, hosts, placed)
        await router.start()
        try:
            split = [await drive(router, _request(200 + i), MAX_TOKENS) for i in range(4)]
            router.flow.colocated = True  # the decode worker runs both phases
            local = [await drive(router, _request(300 + i), MAX_TOKENS) for i in range(4)]
            marks = await take_marks(hosts)
            return [(d, router_overhead_s(d, marks.get(d.request_id, {}))) for d in split + local]
        finally:
            await router.drain(0.0)

    got = asyncio.run(run())
    assert [d.outcome for d, _ in got] == ["ok"] * 8, got
    for d, overhead in got:
        assert overhead is not None, d
        # each mock request spends at least one 10 ms step on a worker
        assert 0.0 < overhead < (d.end - d.sent) - 0.01, (d, overhead)
