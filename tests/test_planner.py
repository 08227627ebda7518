"""The planner (`router.planner`): its decisions from its signals, and, in act mode on real
in-process workers, a decision carried out through the pool admin.

The decision tests feed `Planner.decide` signals built by hand (the unit under test is the
decision; the pools they name hold clients that are never called). The act test runs a
real deployment in process whose SLO no request can meet, and checks the planner grows the
prefill pool (by the rule: the decode pool cannot give a worker away, so it adds one)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.checkpoint import write_checkpoint
from pdserve.client import make_request
from pool_api.messages import Role, StatKey, WorkerStats
from router.clients import DecodeClient, PrefillClient
from router.config import PlannerSettings
from router.membership import PoolAdmin
from router.planner import Decision, Planner, Signals
from router.pools import Pool
from tests.in_process import local_config, run_with_workers


def _pool(role: Role, n: int) -> Pool[Any]:
    never_called: Any = None
    cls = PrefillClient if role is Role.PREFILL else DecodeClient
    pool: Pool[Any] = Pool(role, [cls(f"pdserve-{role.value}-{i}", never_called) for i in range(n)])
    for w in pool.workers:
        w.stats = WorkerStats(w.name, role, 100, 100, 0, 0, 0, 0, 0, 0)
    return pool


def _planner(num_prefill: int = 1, num_decode: int = 2, **cfg: Any) -> Planner:
    prefill, decode = _pool(Role.PREFILL, num_prefill), _pool(Role.DECODE, num_decode)
    admin = PoolAdmin(prefill, decode, None, lambda name: 0, False, 60.0)  # type: ignore[arg-type]
    settings = PlannerSettings(enabled=True, **{"patience": 2, **cfg})
    forecast = None
    if settings.profile:  # as `pdserve serve` builds it
        from pdserve.serve import _forecast

        forecast = _forecast(settings)
    return Planner(settings, admin, prefill, decode, colocated=False, forecast=forecast)


def _signals(p: Planner, **kw: Any) -> Signals:
    base: dict[str, Any] = dict(
        prefill_workers=len(p.prefill.workers),
        decode_workers=len(p.decode.workers),
        finished=50,
        ttft_attainment=1.0,
        tpot_attainment=1.0,
        attainment=1.0,
        queued_prefill_tokens=100,
        decode_kv_free=0.6,
        decode_step_ms=30.0,
        transfer_backlog=0,
    )
    return Signals(**{**base, **kw})


def test_a_missing_signal_holds_and_says_which() -> None:
    p = _planner()
    d = p.decide(_signals(p, missing=("finished requests",)))
    assert d.action == "hold" and "signal missing: finished requests" in d.reason


def test_slow_first_tokens_flip_a_decode_worker_with_room_after_patience() -> None:
    p = _planner()
    slow = _signals(p, ttft_attainment=0.5, attainment=0.5)
    first = p.decide(slow)
    assert first.action == "hold" and "held 1 of 2 ticks" in first.reason
    second = p.decide(slow)
    assert (second.action, second.role, second.worker) == (
        "flip",
        Role.PREFILL,
        "pdserve-decode-0",
    )
    # then it holds while the pools settle, whatever the signals say
    settling = [p.decide(slow) for _ in range(2)]
    assert all(d.action == "hold" and "settling" in d.reason for d in settling)


def test_it_adds_where_no_role_can_give_a_worker_and_holds_at_the_bound() -> None:
    p = _planner(num_decode=1, patience=1)
    slow_decode = _signals(p, tpot_attainment=0.4, attainment=0.4, ttft_attainment=0.5)
    d = p.decide(slow_decode)
    assert (d.action, d.role) == ("add", Role.DECODE), d  # no donor: prefill is behind too
    q = _planner(num_decode=4, patience=1, max_decode=4)
    d = q.decide(_signals(q, tpot_attainment=0.4, attainment=0.4))
    assert d.action == "hold" and "at its bound" in d.reason


def test_a_role_without_slack_gives_no_worker_away() -> None:
    """Decode steps too slow, prompts fine: one of 2 prefill workers flips to decode only if
    the other can take its load (busy x 2 / 1 within DONOR_BUSY_MAX); else a worker is
    added. Flipping a busy prefill worker made the planner see-saw between the roles. And
    the other way round, on the decode pool's step time."""
    from router.planner import DONOR_BUSY_MAX

    slow_decode = {"tpot_attainment": 0.5, "attainment": 0.5}
    for busy, want in ((0.3, "flip"), (0.6, "add"), (None, "flip")):
        p = _planner(num_prefill=2, num_decode=1, patience=1)
        d = p.decide(_signals(p, **slow_decode, prefill_busy=busy))
        assert (d.action, d.role) == (want, Role.DECODE), (busy, d)
    assert 0.3 * 2 <= DONOR_BUSY_MAX < 0.6 * 2
    # prompts wait: a decode worker flips only if the others' steps stay within the TPOT
    # bound's share (step 30 of 200 ms x 2 / 1 = 0.3; 100 of 200 x 2 = 1.0)
    slow_prompts = {"ttft_attainment": 0.5, "attainment": 0.5}
    for step_ms, want in ((30.0, "flip"), (100.0, "add")):
        p = _planner(num_prefill=1, num_decode=2, patience=1)
        d = p.decide(_signals(p, **slow_prompts, decode_step_ms=step_ms))
        assert (d.action, d.role) == (want, Role.PREFILL), (step_ms, d)


def test_busy_shares_come_from_the_workers_step_seconds() -> None:
    """A role's busy share is its workers' engine step seconds over wall time between two
    reads (unknown at the first)."""
    p = _planner(num_prefill=1, num_decode=1)
    (w,) = p.prefill.workers
    stats = w.stats
    assert stats is not None

    def at(step_s: float) -> None:
        w.stats = replace(stats, extra={StatKey.ENGINE_STEP_SECONDS_TOTAL.value: step_s})

    at(10.0)
    assert p._since_last(p.prefill.routable(), now=100.0).busy is None
    at(13.0)
    assert p._since_last(p.prefill.routable(), now=104.0).busy == pytest.approx(0.75)


def test_an_idle_pool_gives_back_a_worker_but_never_below_its_floor() -> None:
    p = _planner(num_decode=2, patience=1)
    idle = _signals(p, decode_kv_free=0.95, decode_step_ms=10.0, queued_prefill_tokens=0)
    waits = [p.decide(idle) for _ in range(2)]  # slower down than up: 3 x patience
    assert all(d.action == "hold" and "of 3 ticks" in d.reason for d in waits), waits
    d = p.decide(idle)
    assert (d.action, d.role) == ("drain", Role.DECODE)
    q = _planner(num_prefill=1, num_decode=1, patience=1)
    assert q.decide(_signals(q, decode_kv_free=0.95, queued_prefill_tokens=0)).action == "hold"


def test_a_prefill_pool_with_room_is_given_back_after_a_burst() -> None:
    """Three prefill workers 20 % busy (the other two would be 30 %) drain one after 3 x
    patience ticks, though a prompt waits at some ticks and the least-loaded worker changes
    from tick to tick (both had kept the pool at its burst size: a drain's streak was per
    worker, and any waiting prompt reset it). 40 % busy (60 % for the others) holds, and so
    does an attainment short of halfway from the target to 1."""
    p = _planner(num_prefill=3, num_decode=1, patience=1)
    decisions = []
    for tick in range(3):
        p.prefill.workers[tick].active.add(f"r{tick}")  # another worker is least loaded
        queued = 600 if tick % 2 else 0
        decisions.append(p.decide(_signals(p, prefill_busy=0.2, queued_prefill_tokens=queued)))
    assert [d.action for d in decisions] == ["hold", "hold", "drain"], decisions
    assert decisions[-1].role is Role.PREFILL
    for busy, attainment in ((0.4, 1.0), (0.2, 0.94)):
        q = _planner(num_prefill=3, num_decode=1, patience=1)
        sig = _signals(q, prefill_busy=busy, attainment=attainment, ttft_attainment=attainment)
        assert all(q.decide(sig).action == "hold" for _ in range(4)), (busy, attainment)


# A step model in `pdserve profile`'s JSON: 10 ms a step, 0.1 ms per prompt token, 2 ms per
# decode row. A 500-token prompt pass: 60 ms; a decode batch within a 100 ms TPOT bound: 45.
STEP_MODEL = {"a": 0.01, "chunks": 0.0, "sum_n": 1e-4, "sum_n2": 0.0, "sum_n_ctx": 0.0,
              "batch": 0.002, "sum_ctx": 0.0}  # fmt: skip


def _profile(tmp_path: Path) -> Path:
    import json

    path = tmp_path / "profile.json"
    body = {"block_size": 16, "kv_bytes_per_block": 1, "pool_blocks": 1,
            "workers": {"2": {"step_model": STEP_MODEL}}}  # fmt: skip
    path.write_text(json.dumps(body))
    return path


def test_the_forecast_floor_sizes_each_role_from_the_profile(tmp_path: Path) -> None:
    """At 20 req/s of 500 uncached prompt tokens and 100 output tokens: prefill busy 20 x
    60 ms = 1.2 workers, at 70 % -> 2; decode 2000 tokens/s against 45 rows per 100 ms step
    (450/s) at 70 % -> 7. Any thread count the profile lacks reads its smallest size."""
    from pdserve.plan.plan import forecast_floor

    f = forecast_floor(_profile(tmp_path), threads=1, tpot_ms=100.0)
    assert f.threads == 2
    floor = f.floor(20.0, [500] * 10, [100] * 10)
    assert (floor.prefill, floor.decode) == (2, 7), floor
    assert "batch 45" in floor.reason and "steady state" in floor.reason
    assert (f.floor(0.0, [], []).prefill, f.floor(0.0, [], []).decode) == (0, 0)


def test_the_planner_grows_to_its_forecast_floor_and_never_drains_below_it(
    tmp_path: Path,
) -> None:
    """The window's load at the floor the profile gives (read, clamped to the bounds); a
    role below its floor grows first (a flip from a role above its own floor, else an add),
    and an idle role at its floor is not drained."""
    import time

    from router.planner import Finished

    p = _planner(num_prefill=1, num_decode=2, patience=1, tpot_ms=100.0,
                 profile=str(_profile(tmp_path)), max_decode=8)  # fmt: skip
    now = time.perf_counter()
    p.started_s = now - p.cfg.window_s
    n = int(20 * p.cfg.window_s)  # 20 req/s over the window, arrived and finished
    for i in range(n):
        p.window.items.append(Finished(now - i / 20, 0.1, 0.01, 600, 100, 500))
    p.window.arrivals.extend(now - (n - i) / 20 for i in range(n))
    s = p.read(now)
    assert (s.floor_prefill, s.floor_decode) == (2, 7), s
    assert "20.00 req/s" in s.floor_reason, s.floor_reason
    short = _signals(p, floor_prefill=2, floor_decode=7, floor_reason="test")
    d = p.decide(short)  # decode is 5 short, prefill 1; no donor to spare: both at once
    assert (d.action, d.role) == ("add", Role.DECODE) and "forecast floor" in d.reason, d
    assert d.to_add == ((Role.DECODE, 5), (Role.PREFILL, 1)), d
    assert d.line().startswith("add 5 decode workers and a prefill worker: forecast floor"), d
    q = _planner(num_prefill=1, num_decode=2, patience=1)
    d = q.decide(_signals(q, floor_prefill=2, floor_decode=1, floor_reason="test"))
    assert (d.action, d.role, d.worker) == ("flip", Role.PREFILL, "pdserve-decode-0"), d
    r = _planner(num_prefill=1, num_decode=2, patience=1)
    idle = _signals(r, decode_kv_free=0.95, decode_step_ms=10.0, queued_prefill_tokens=0)
    at_floor = [r.decide(replace(idle, floor_prefill=1, floor_decode=2)) for _ in range(4)]
    assert all(d.action == "hold" for d in at_floor), at_floor
    assert [r.decide(idle) for _ in range(3)][-1].action == "drain"  # no floor: it drains


def test_the_floor_works_off_the_queued_prompts_on_top_of_the_rate(tmp_path: Path) -> None:
    """Prompt tokens queued now count as that many more prompts arriving over BACKLOG_S,
    for prefill (they must be computed) and for decode (they reach it as they are): after
    a load step the queue it built must drain, not only stop growing."""
    from pdserve.plan.plan import forecast_floor
    from router.forecast import BACKLOG_S

    f = forecast_floor(_profile(tmp_path), threads=1, tpot_ms=100.0)
    prompts, outputs = [500] * 10, [100] * 10
    queued = int(500 * 20 * BACKLOG_S)  # 20 req/s more, over BACKLOG_S
    with_backlog = f.floor(20.0, prompts, outputs, queued_tokens=queued)
    doubled = f.floor(40.0, prompts, outputs)
    plain = f.floor(20.0, prompts, outputs)
    assert (with_backlog.prefill, with_backlog.decode) == (doubled.prefill, doubled.decode)
    assert with_backlog.prefill > plain.prefill and with_backlog.decode > plain.decode
    assert "s of prompts queued" in with_backlog.reason, with_backlog.reason


def test_the_window_rate_is_its_arrivals_not_its_completions() -> None:
    """Admissions, counted over the span asked for and forgotten past the window: the load
    offered now, which completions lag while prompts queue."""
    from router.planner import Window

    w = Window(10.0)
    for t in range(30):  # one a second for 30 s, then four a second for 5 s
        w.arrivals.append(float(t))
    for k in range(20):
        w.arrivals.append(30.0 + k / 4)
    assert w.arrival_rate(35.0, 5.0) == pytest.approx(4.0)
    assert w.arrival_rate(35.0, 10.0) == pytest.approx((5 + 20) / 10)
    assert min(w.arrivals) >= 25.0  # past the window: forgotten


def test_a_floor_add_is_not_held_by_the_settling_after_a_change(tmp_path: Path) -> None:
    """After a change the reactive loop waits `patience` ticks for the pools to settle; a
    shortfall of the forecast floor is the load's, not the pools' answer, and goes ahead."""
    p = _planner(num_prefill=1, num_decode=1, patience=1)
    p.cooldown = 2
    d = p.decide(_signals(p, floor_prefill=3, floor_decode=1, floor_reason="test"))
    assert d.to_add == ((Role.PREFILL, 2),), d
    q = _planner(num_prefill=1, num_decode=1, patience=1)
    q.cooldown = 2
    d = q.decide(_signals(q, ttft_attainment=0.5, attainment=0.5))  # reactive: it settles
    assert d.action == "hold" and "settling" in d.reason, d


def test_while_its_adds_start_the_floor_adds_only_what_they_do_not_cover() -> None:
    """An operation under way holds the planner, except for the forecast floor's shortfall
    beyond the workers already starting: the load can outgrow an add that was sized while
    the window still held the quiet phase, and a second cold start need not wait for the
    first."""
    p = _planner(num_prefill=1, num_decode=1, patience=1)
    short = _signals(p, floor_prefill=3, floor_decode=1, floor_reason="test", starting_prefill=1)
    d = p.decide(short, busy=True)
    assert d.to_add == ((Role.PREFILL, 1),), d
    covered = replace(short, starting_prefill=2)
    d = p.decide(covered, busy=True)
    assert (d.action, d.reason) == ("hold", "an operation is under way"), d
    d = p.decide(_signals(p, ttft_attainment=0.5, attainment=0.5), busy=True)  # reactive
    assert (d.action, d.reason) == ("hold", "an operation is under way"), d


def test_one_decision_starts_every_worker_it_adds_at_once() -> None:
    """act mode carries an add of several workers out as that many adds, concurrently (a
    cold start each: one after the other would take their sum)."""

    class Admin:
        def __init__(self) -> None:
            self.calls: list[Role] = []
            self.running = 0
            self.most = 0

        async def add(self, role: Role) -> dict[str, Any]:
            self.calls.append(role)
            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(0.05)
            self.running -= 1
            return {}

    p = _planner()
    admin = Admin()
    p.admin = admin  # type: ignore[assignment]
    d = Decision("add", "test", Role.DECODE, adds=((Role.DECODE, 2), (Role.PREFILL, 1)))
    asyncio.run(p._act(d))
    assert admin.calls == [Role.DECODE, Role.DECODE, Role.PREFILL] and admin.most == 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.mark.parametrize("mode", ["advisory", "act"])
def test_an_unmet_slo_grows_the_prefill_pool_in_act_mode_only(tiny_dir: Path, mode: str) -> None:
    """A TTFT bound no request meets (0.001 ms), one decode worker (it cannot give one
    away): the planner decides to add a prefill worker; act mode adds it, advisory only
    counts the decision. Requests meanwhile all end whole."""

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        settings = PlannerSettings(
            enabled=True, mode=mode, interval_s=0.05, ttft_ms=0.001, patience=1, max_prefill=2
        )  # type: ignore[arg-type]
        planner = router.start_planner(settings)
        ids = [4 + j * 7 % 400 for j in range(40)]
        for i in range(3):
            req = make_request(ids, f"r{i}", cache_salt=f"r{i}", max_tokens=8, temperature=0.0)
            act = await router.admit(req)
            async for _ in router.run(act):
                pass
            router.finish(act, True)
        deadline = asyncio.get_running_loop().time() + 30
        while not planner.decisions.get(("add", mode)):
            assert asyncio.get_running_loop().time() < deadline, planner.last
            await asyncio.sleep(0.05)
        if mode == "act":  # added once, then held at the bound (max_prefill=2)
            # the add runs until its worker joined and reported its stats
            while len(router.prefill.workers) < 2 or planner._ops:
                assert asyncio.get_running_loop().time() < deadline, planner.last
                await asyncio.sleep(0.05)
            # several more ticks (counted, not slept: a loaded host ticks late), past the
            # settling after the add
            ticks = sum(planner.decisions.values())
            while sum(planner.decisions.values()) < ticks + 3:
                assert asyncio.get_running_loop().time() < deadline, planner.last
                await asyncio.sleep(0.05)
            assert "at its bound" in planner.last.reason, planner.last
        assert len(router.prefill.workers) == (2 if mode == "act" else 1)
        assert planner.last_signals is not None and planner.last_signals.ttft_attainment == 0.0

    run_with_workers(local_config(tiny_dir), tiny_dir, body)
