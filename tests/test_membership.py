"""Pool membership at run time (`router.membership`): workers added, drained and flipped
between prefill and decode under load, with nothing lost.

Real in-process workers on the tiny checkpoint behind a started Router
(`pdserve.launch.InProcessLauncher`: the same workers and the same role switch as the Ray
actors, which `tests/test_pool_admin.py` drives through `pdserve serve`). Each test checks
what a user would: every request ends with its full answer (the same greedy tokens as a
request served before any change) or a clear status, and every KV block comes back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.checkpoint import write_checkpoint
from pdserve.client import make_request
from pool_api.messages import NotServing, Role
from router.active import RequestFailed
from router.membership import PoolError
from tests.in_process import asgi_request, local_config, run_with_workers

MAX_TOKENS = 48
LONG = 1900  # tokens: seconds of decoding on the tiny model (its context is 2048)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


def _ids(i: int) -> list[int]:
    """A prompt long enough to be disaggregated (over the local-prefill threshold)."""
    return [4 + (i * 31 + j * 7) % 400 for j in range(40 + i % 5)]


async def _drive(router: Any, rid: str, i: int, max_tokens: int = MAX_TOKENS) -> list[int]:
    """One greedy request as the gRPC face drives it; what did not complete is released.
    Its own cache salt: no worker holds its prefix, so it goes where the load says (the
    tokens are the same: the kernels are batch-invariant, a cache hit changes nothing)."""
    request = make_request(
        _ids(i), rid, cache_salt=rid, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    act = await router.admit(request)
    toks: list[int] = []
    completed = False
    try:
        async for resp in router.run(act):
            toks += resp.chunk.token_ids
            completed = resp.HasField("complete")
    finally:
        router.finish(act, completed)
    return toks


def _idle(stats: Any) -> bool:
    return stats.num_running == stats.num_waiting == stats.num_reserved == 0


def _same(router: Any, got: list[list[int]], want: list[list[int]]) -> bool:
    """Every answer whole, and the same greedy tokens where the kernels are batch-invariant
    (the default: a request's tokens do not depend on its batch or its worker)."""
    workers = router.admin.launcher.workers.values()
    if all(w.engine.kernel_selection.kernels.batch_invariant for w in workers):
        return got == want
    return [len(g) for g in got] == [len(w) for w in want]


async def _until(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def _no_block_used(router: Any) -> dict[str, int]:
    """Every worker's blocks in use (its integrity checked), once they are all back."""
    launcher = router.admin.launcher
    used: dict[str, int] = {}
    for _ in range(200):
        used = {n: await w.check_integrity() for n, w in launcher.workers.items()}
        if not any(used.values()):
            break
        await asyncio.sleep(0.05)
    return used


def test_a_worker_added_under_load_takes_requests_and_a_drain_loses_none(tiny_dir: Path) -> None:
    async def body(router: Any, prefill: Any, decode: Any) -> None:
        want = {i: await _drive(router, f"ref-{i}", i) for i in range(8)}
        added = await router.admin.add(Role.DECODE)
        assert added["worker"] == "pdserve-decode-1" and added["role"] == "decode"
        status = router.admin.status()
        assert status["decode"] == 2
        assert [w["state"] for w in status["workers"]] == ["serving"] * 3

        # Load on both decode workers, then drain the new one while it decodes.
        new = router.decode.get("pdserve-decode-1")
        calls = [asyncio.ensure_future(_drive(router, f"a-{i}", i)) for i in range(8)]
        await _until(lambda: len(new.active) > 0)
        drained = asyncio.ensure_future(router.admin.drain("pdserve-decode-1", bound_s=60))
        await _until(lambda: new.retiring)
        late = [asyncio.ensure_future(_drive(router, f"b-{i}", i)) for i in range(8)]
        result = await drained
        got = await asyncio.gather(*calls, *late)

        assert result["ended"] == 0 and result["stopped"], result
        assert _same(router, got, [want[i] for i in range(8)] * 2)
        assert [w.name for w in router.decode.workers] == ["pdserve-decode-0"]
        assert "pdserve-decode-1" not in router.admin.launcher.workers  # stopped
        assert await _no_block_used(router) == {"pdserve-prefill-0": 0, "pdserve-decode-0": 0}
        assert router.admin.num_ops == {("add", "ok"): 1, ("drain", "ok"): 1}

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_a_flip_keeps_the_weights_and_the_worker_serves_its_new_role(tiny_dir: Path) -> None:
    async def body(router: Any, prefill: Any, decode: Any) -> None:
        want = {i: await _drive(router, f"ref-{i}", i) for i in range(6)}
        await router.admin.add(Role.PREFILL)
        engine = router.admin.launcher.workers["pdserve-prefill-1"].engine

        calls = [asyncio.ensure_future(_drive(router, f"a-{i}", i)) for i in range(6)]
        flipped = await router.admin.flip("pdserve-prefill-1", Role.DECODE, bound_s=60)
        calls += [asyncio.ensure_future(_drive(router, f"b-{i}", i)) for i in range(6)]
        assert _same(router, await asyncio.gather(*calls), [want[i] for i in range(6)] * 2)
        assert flipped["role"] == "decode" and flipped["ended"] == 0, flipped
        assert 0 < flipped["flip_s"] <= flipped["seconds"]
        assert [w.name for w in router.prefill.workers] == ["pdserve-prefill-0"]
        assert [w.name for w in router.decode.workers] == ["pdserve-decode-0", "pdserve-prefill-1"]
        worker = router.admin.launcher.workers["pdserve-prefill-1"]
        assert worker.role is Role.DECODE and worker.engine is engine  # no reload

        # It decodes now: with the other decode worker drained away, every request lands on
        # it; then back to prefill, and the deployment serves as before.
        await router.admin.drain("pdserve-decode-0")
        got = [await _drive(router, f"c-{i}", i) for i in range(3)]
        assert _same(router, got, [want[i] for i in range(3)])
        assert router.decode.get("pdserve-prefill-1").client.role is Role.DECODE
        await router.admin.add(Role.DECODE)
        back = await router.admin.flip("pdserve-prefill-1", Role.PREFILL)
        assert back["role"] == "prefill"
        assert router.admin.launcher.workers["pdserve-prefill-1"].engine is engine
        got = await asyncio.gather(*(_drive(router, f"d-{i}", i) for i in range(6)))
        assert _same(router, got, [want[i] for i in range(6)])
        assert not any((await _no_block_used(router)).values())

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_a_drain_past_its_bound_ends_the_rest_clearly_and_a_drained_worker_refuses(
    tiny_dir: Path,
) -> None:
    async def body(router: Any, prefill: Any, decode: Any) -> None:
        await router.admin.add(Role.DECODE)
        new = router.decode.get("pdserve-decode-1")
        # A worker drained by another router (its own drain call) refuses new requests:
        # this router places them on the other worker, and counts the first as draining.
        worker = router.admin.launcher.workers["pdserve-decode-1"]
        await worker.drain(30.0)
        with pytest.raises(NotServing):
            await worker.reserve(await router._prepare(make_request(_ids(0), "x", max_tokens=4)))
        await _until(lambda: new.draining)
        assert new.routable is False
        assert len(await _drive(router, "elsewhere", 1)) == MAX_TOKENS
        assert not new.active and router.admin.status()["workers"][2]["state"] == "draining"
        worker.undrain()  # serving again (as when the lease of a dead router's drain ends)
        await worker.drain(0.05)  # a drain's lease that no router renews runs out
        await asyncio.sleep(0.1)
        assert not worker.draining
        await _until(lambda: new.routable)

        long = [asyncio.ensure_future(_drive(router, f"long-{i}", i, LONG)) for i in range(6)]
        await _until(lambda: len(new.active) > 0)
        result = await router.admin.drain("pdserve-decode-1", bound_s=0.5)
        assert result["ended"] >= 1, result  # 0.5 s is far too short for LONG tokens
        outcomes = await asyncio.gather(*long, return_exceptions=True)
        failed = [out for out in outcomes if not isinstance(out, list)]
        # those still on the drained worker at the bound end UNAVAILABLE, saying why; the
        # rest (on the other worker) end whole
        assert len(failed) == result["ended"], outcomes
        for out in failed:
            assert isinstance(out, RequestFailed), out
            assert out.code == grpc.StatusCode.UNAVAILABLE and "drained" in out.details, out
        assert all(len(out) == LONG for out in outcomes if isinstance(out, list))
        assert await _no_block_used(router) == {"pdserve-prefill-0": 0, "pdserve-decode-0": 0}

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_a_worker_flipped_by_another_router_moves_to_its_new_pool(tiny_dir: Path) -> None:
    """Another router's admin (here: the launcher alone, as that router would call it)
    flips a worker this router holds: its stats say so, and this router moves it to the
    pool of its new role (as it does a flipped worker that Ray restarted in its first
    role); requests meanwhile are placed elsewhere and end whole."""

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        await router.admin.add(Role.PREFILL)
        calls = [asyncio.ensure_future(_drive(router, f"a-{i}", i)) for i in range(6)]
        # the other router's drain: the worker refuses new requests, and what it holds
        # from any router ends before the switch (its stats say when)
        await router.admin.launcher.workers["pdserve-prefill-1"].drain(30.0)
        held = router.prefill.get("pdserve-prefill-1")
        await _until(lambda: held.stats.draining and not held.active and _idle(held.stats))
        await router.admin.launcher.flip("pdserve-prefill-1", Role.DECODE)
        await _until(lambda: (w := router.decode.get("pdserve-prefill-1")) and w.routable)
        assert router.prefill.get("pdserve-prefill-1") is None
        calls += [asyncio.ensure_future(_drive(router, f"b-{i}", i)) for i in range(6)]
        assert [len(toks) for toks in await asyncio.gather(*calls)] == [MAX_TOKENS] * 12
        assert not any((await _no_block_used(router)).values())

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_refusals_are_clear_and_change_nothing(tiny_dir: Path) -> None:
    async def body(router: Any, prefill: Any, decode: Any) -> None:
        admin = router.admin
        with pytest.raises(PoolError, match="last decode worker") as e:
            await admin.drain("pdserve-decode-0")
        assert e.value.status == 409
        with pytest.raises(PoolError, match="no worker named") as e:
            await admin.drain("nobody")
        assert (e.value.status, e.value.field) == (404, "worker")
        with pytest.raises(PoolError, match="already") as e:
            await admin.flip("pdserve-decode-0", Role.DECODE)
        assert e.value.status == 409
        await admin.add(Role.DECODE)
        first = asyncio.ensure_future(admin.drain("pdserve-decode-1"))
        await asyncio.sleep(0)
        with pytest.raises(PoolError, match="already being drained"):
            await admin.flip("pdserve-decode-1", Role.PREFILL)
        await first
        assert [w.name for w in router.decode.workers] == ["pdserve-decode-0"]
        assert len(await _drive(router, "still", 0)) == MAX_TOKENS

        # Over HTTP: a bad body is a 400 naming the field, before anything changes.
        app = _app(router)
        for path, bad, field in (
            ("add", {"role": "router"}, "role"),
            ("add", {"role": "decode", "extra": 1}, "extra"),
            ("drain", {}, "worker"),
            ("drain", {"worker": "pdserve-decode-0", "bound_s": -1}, "bound_s"),
            ("flip", {"worker": "pdserve-decode-0", "to": 3}, "to"),
        ):
            status, _, raw = await asgi_request(app, "POST", f"/v1/admin/pool/{path}", bad)
            assert status == 400 and f'"param":"{field}"' in raw.decode(), (path, raw)
        status, _, raw = await asgi_request(
            app, "POST", "/v1/admin/pool/drain", {"worker": "pdserve-decode-0"}
        )
        assert status == 409 and b"last decode worker" in raw
        status, _, raw = await asgi_request(app, "GET", "/v1/admin/pool")
        assert status == 200 and b'"decode":1' in raw
        status, _, raw = await asgi_request(app, "GET", "/metrics")
        text = raw.decode()
        assert 'pdserve:pool_workers{model_name="tiny",role="decode",state="serving"} 1.0' in text
        ops = 'pdserve:pool_operations_total{model_name="tiny",operation="%s",outcome="%s"} 1.0'
        assert ops % ("drain", "ok") in text and ops % ("add", "ok") in text, text

    run_with_workers(local_config(tiny_dir), tiny_dir, body)


def test_the_pool_routes_need_the_api_key_whenever_one_is_set(tiny_dir: Path) -> None:
    from dataclasses import replace

    cfg = local_config(tiny_dir)
    cfg = replace(cfg, router=replace(cfg.router, api_key="s3cret"))

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        app = _app(router)
        routes = [("GET", "/v1/admin/pool", None)] + [
            ("POST", f"/v1/admin/pool/{op}", b) for op, b in (
                ("add", {"role": "decode"}),
                ("drain", {"worker": "pdserve-decode-0"}),
                ("flip", {"worker": "pdserve-prefill-0", "to": "decode"}),
            )
        ]  # fmt: skip
        for method, path, b in routes:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                status, _, raw = await asgi_request(app, method, path, b, headers)
                assert status == 401 and b"invalid_api_key" in raw, (path, headers, raw)
        assert len(router.prefill.workers) == len(router.decode.workers) == 1  # unchanged
        ok = {"authorization": "Bearer s3cret"}
        status, _, raw = await asgi_request(app, "GET", "/v1/admin/pool", None, ok)
        assert status == 200 and b'"prefill":1' in raw

    run_with_workers(cfg, tiny_dir, body)


def _app(router: Any) -> Any:
    from router.http import create_app

    return create_app(router)


def test_the_refresh_slows_down_for_large_pools() -> None:
    """Up to STATS_REFRESH_S x REFRESH_CALLS_PER_S calls (50: 25 workers' stats and index
    pulls) every STATS_REFRESH_S; past that at most REFRESH_CALLS_PER_S calls a second,
    workers added at run time included."""
    from router.clients import DecodeClient
    from router.config import RouterConfig
    from router.core import REFRESH_CALLS_PER_S, STATS_REFRESH_S
    from tests.in_process import router_without_workers

    router = router_without_workers(RouterConfig())
    assert router.refresh_interval_s() == STATS_REFRESH_S  # 2 workers
    never_called: Any = None
    for i in range(1, 199):
        router.decode.add(DecodeClient(f"pdserve-decode-{i}", never_called))
    # the in-memory index: each worker's stats and its index pull
    assert router.refresh_interval_s() == pytest.approx(2 * 200 / REFRESH_CALLS_PER_S)
    assert 2 * 200 / REFRESH_CALLS_PER_S > STATS_REFRESH_S


def test_a_spread_refresh_calls_its_workers_in_groups_over_the_interval() -> None:
    """The refresh loop's calls start in SPREAD_SLOTS groups over the interval, not in one
    burst that a request's own calls would queue behind; each worker's follow-up (the
    index pull) runs once its stats arrived; a worker that fails gets none."""
    from pool_api.messages import Role, WorkerStats
    from router.clients import DecodeClient, WorkerUnavailable
    from router.pools import SPREAD_SLOTS, Pool

    started: dict[str, float] = {}

    class Api:
        def __init__(self, name: str) -> None:
            self.name = name

        async def stats(self) -> WorkerStats:
            started[self.name] = time.monotonic()
            if self.name == "w-5":
                raise WorkerUnavailable("gone")
            return WorkerStats(self.name, Role.DECODE, 8, 8, 0, 0, 0, 0, 0, 0)

    n, spread = 32, 0.4
    pool: Pool[Any] = Pool(Role.DECODE, [DecodeClient(f"w-{i}", Api(f"w-{i}")) for i in range(n)])
    followed: list[str] = []

    async def run() -> float:
        t0 = time.monotonic()
        await pool.refresh(0.2, 2.0, spread, lambda w: followed.append(w.name))
        return t0

    t0 = asyncio.run(run())
    # a sleep never ends early (so this holds on any host, however loaded): worker i's
    # call starts no sooner than its group's share of the interval
    for i in range(n):
        slot = i * SPREAD_SLOTS // n
        assert started[f"w-{i}"] - t0 >= spread * slot / SPREAD_SLOTS - 0.005, (i, started)
    assert max(started.values()) - t0 >= spread * (SPREAD_SLOTS - 1) / SPREAD_SLOTS - 0.005
    assert sorted(followed) == sorted(f"w-{i}" for i in range(n) if i != 5)
