"""The planner: pool sizes that follow the load (`planner.enabled`; docs/operations.md).

Every `interval_s` it reads its signals from the router (`Signals.read`): the attainment of
the SLO over a rolling window of finished requests, the uncached prompt tokens queued on the
prefill pool, the decode pool's free KV, the decode step time against the TPOT bound, the
KV transfers not yet acknowledged, and the length distributions of the window's requests
(p50 and p90, not means). `decide` turns them into one decision: hold, flip a worker to the
role that needs one, add a worker to it, or drain one the load no longer needs. It is a
reactive +-1 correction with hysteresis: a change needs its condition to hold `patience`
ticks in a row (a drain `DOWN_PATIENCE` times as long), and after a change the planner holds
for `patience` ticks while the pools settle; while an operation it started runs, it keeps
reading and holds. It flips before it adds (a flip costs milliseconds, a new worker loads its
model) where the donor role has the slack to give a worker (`DONOR_BUSY_MAX`), and keeps each
role within its bounds.

A missing signal is a state of its own, never a silent skip: the planner holds, says which
signal is missing, and exports it (`pdserve:planner_signal_missing`). Every decision is
logged with its reason and counted (`pdserve:planner_decisions_total`). In `advisory` mode
that is all it does; in `act` mode it carries the decision out through the pool admin
(`router.membership`), one operation at a time.

With a profile (`planner.profile`), a second loop sets a floor under the reactive one
(`router.forecast`): the workers per role that the profile's step model says the window's
arrivals and queued prompts need. Roles below it grow first (a flip, else every shortfall
at once, even while an add runs), and none is drained below it (router.forecast). Not
built: asking a cluster autoscaler for nodes (KubeRay adds nodes for Ray's workers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from engine.request import FinishReason
from pool_api.messages import Role, StatKey
from router.active import ActiveRequest, RequestObserver
from router.config import PlannerSettings
from router.forecast import Floor, ForecastFloor

if TYPE_CHECKING:
    from router.membership import PoolAdmin
    from router.pools import Pool

log = logging.getLogger(__name__)

# A prefill pool with more uncached prompt tokens queued per worker than this is behind:
# about one default step budget of work waiting on each worker.
QUEUED_TOKENS_PER_WORKER = 2048
# Below these a role has room to give a worker away (or to lose one, in a scale-down).
DONOR_KV_FREE, IDLE_KV_FREE = 0.5, 0.8
# A drain's condition must hold this many times `patience` ticks: a quiet window right
# after a load step (its requests not finished yet) must not take a worker away.
DOWN_PATIENCE = 3
# A role gives a worker away (a flip) only if its others would then be loaded at most this
# much (`Planner._grow`: prefill, busy share of wall time; decode, step time over the TPOT
# bound; either times n / (n - 1)): a donor with no slack turns the flip into the next
# shortage, and the planner into a see-saw (found by benchmarks/planner_step_mock.py).
DONOR_BUSY_MAX = 0.7
# A role gives a worker back (a drain) only if its others would then be loaded at most this
# much (the same measure as DONOR_BUSY_MAX, with more room: a drain is slow to undo), and
# the window's attainment is at least halfway from the target to 1.
IDLE_BUSY_MAX = 0.5


@dataclass(frozen=True)
class Stepped:
    """A pool's engine steps since the planner's last read (`Planner._since_last`)."""

    steps: float
    step_s: float
    wall_s: float  # summed over the workers

    @property
    def step_ms(self) -> float | None:
        """The mean step."""
        return self.step_s / self.steps * 1e3 if self.steps > 0 else None

    @property
    def busy(self) -> float | None:
        """The workers' mean share of wall time spent in steps."""
        return min(1.0, self.step_s / self.wall_s) if self.wall_s > 0 else None


@dataclass(frozen=True)
class Finished:
    """One request the window holds: when it ended and what it met."""

    at_s: float
    ttft_s: float | None  # None: no token was sent (it failed)
    tpot_s: float | None  # None: fewer than two tokens
    prompt_tokens: int
    output_tokens: int
    uncached_tokens: int = 0  # prompt tokens not served from the prefix cache


class Window(RequestObserver):
    """The finished requests of the last `window_s`, and when the requests of that window
    arrived (a router observer)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.items: deque[Finished] = deque()
        self.arrivals: deque[float] = deque()

    def on_admit(self, act: ActiveRequest) -> None:
        self.arrivals.append(act.arrival_s)

    def arrival_rate(self, now: float, span_s: float) -> float:
        """Requests admitted per second over the last `span_s` (at most the window): the
        load offered now. Completions lag it by the requests' latency, longest when
        prompts queue, which is when the floor must move."""
        while self.arrivals and self.arrivals[0] < now - self.window_s:
            self.arrivals.popleft()
        return sum(1 for t in self.arrivals if t >= now - span_s) / span_s

    def on_complete(self, act: ActiveRequest, reason: FinishReason, now: float) -> None:
        if reason is FinishReason.ABORT:
            return  # its client left: no verdict on the service
        self.note(
            now, act.arrival_s, act.first_sent_s, act.last_sent_s, act.num_sent,
            act.num_prompt_tokens, act.num_prompt_tokens - act.cached_tokens,
        )  # fmt: skip

    def on_fail(self, act: ActiveRequest, code: grpc.StatusCode, now: float) -> None:
        self.items.append(Finished(now, None, None, act.num_prompt_tokens, act.num_sent))

    def note(
        self,
        now: float,
        arrival_s: float,
        first_s: float | None,
        last_s: float | None,
        num_sent: int,
        prompt_tokens: int,
        uncached_tokens: int,
    ) -> None:
        """A request that ended at `now` with its tokens sent at these times (the router's
        requests, or `pdserve.plan.elastic`'s simulated ones)."""
        ttft = first_s - arrival_s if first_s is not None else None
        tpot = None
        if first_s is not None and last_s is not None and num_sent > 1:
            tpot = (last_s - first_s) / (num_sent - 1)
        self.items.append(Finished(now, ttft, tpot, prompt_tokens, num_sent, uncached_tokens))

    def recent(self, now: float) -> list[Finished]:
        while self.items and self.items[0].at_s < now - self.window_s:
            self.items.popleft()
        return list(self.items)


@dataclass(frozen=True)
class Signals:
    """What one tick sees. None: that signal is missing (named in `missing`)."""

    prefill_workers: int  # routable
    decode_workers: int
    finished: int  # requests in the window
    ttft_attainment: float | None
    tpot_attainment: float | None
    attainment: float | None  # within both bounds
    queued_prefill_tokens: int | None
    decode_kv_free: float | None  # free share of the decode pool's KV (reservations counted)
    decode_step_ms: float | None  # mean decode step since the last tick
    transfer_backlog: int | None  # KV transfers not yet acknowledged
    # each role's workers' mean busy share since the last tick (engine step seconds over
    # wall time); None: not known yet (the first tick, or no step counters)
    prefill_busy: float | None = None
    decode_busy: float | None = None
    prompt_p50: float | None = None
    prompt_p90: float | None = None
    output_p50: float | None = None
    output_p90: float | None = None
    # the forecast floor (`router.forecast`, with a profile): workers per role the window's
    # load needs; None without a profile, colocated, or with no finished request
    floor_prefill: int | None = None
    floor_decode: int | None = None
    floor_reason: str = ""
    missing: tuple[str, ...] = ()
    # workers an add of the planner's is starting, not serving yet (the floor counts them)
    starting_prefill: int = 0
    starting_decode: int = 0

    def gauges(self) -> dict[str, float]:
        """The signals present, as `pdserve:planner_signal{signal=...}` reports them."""
        names = (
            "finished", "ttft_attainment", "tpot_attainment", "attainment",
            "queued_prefill_tokens", "decode_kv_free", "decode_step_ms", "transfer_backlog",
            "prefill_busy", "decode_busy", "prompt_p50", "prompt_p90", "output_p50", "output_p90",
            "floor_prefill", "floor_decode",
        )  # fmt: skip
        out = {n: getattr(self, n) for n in names}
        return {n: float(v) for n, v in out.items() if v is not None}


@dataclass(frozen=True)
class Decision:
    action: str  # hold | flip | add | drain
    reason: str
    role: Role | None = None  # flip/add: the role that gains a worker; drain: loses one
    worker: str | None = None  # flip/drain: which
    # add: the workers to start at once, per role (empty: one of `role`); the forecast
    # floor's shortfall, every role's in one decision, since each add takes a cold start
    adds: tuple[tuple[Role, int], ...] = ()

    @property
    def to_add(self) -> tuple[tuple[Role, int], ...]:
        if self.adds:
            return self.adds
        return ((self.role, 1),) if self.action == "add" and self.role is not None else ()

    def line(self) -> str:
        what = self.action
        if self.action == "flip":
            what = f"flip {self.worker} to {self.role.value if self.role else '?'}"
        elif self.action == "add" and self.to_add:
            what = "add " + " and ".join(
                f"a {r.value} worker" if n == 1 else f"{n} {r.value} workers"
                for r, n in self.to_add
            )
        elif self.action == "drain":
            what = f"drain {self.worker}"
        return f"{what}: {self.reason}"


def _others_take(load: float | None, n: int, bound: float) -> bool:
    """Whether a role of `n` workers at `load` can lose one: its others, taking its share,
    would be loaded at most `bound` (False when the load is unknown or n is 1)."""
    return load is not None and n > 1 and load * n / (n - 1) <= bound


def _share(values: Sequence[float | None], bound_s: float) -> float:
    return sum(v is not None and v <= bound_s for v in values) / len(values)


def _pct(values: Sequence[int], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Planner:
    def __init__(
        self,
        cfg: PlannerSettings,
        admin: PoolAdmin,
        prefill: Pool[Any],
        decode: Pool[Any],
        colocated: bool,
        forecast: ForecastFloor | None = None,
    ) -> None:
        """`forecast`: the floor loop's model (`planner.profile`, built from the profile by
        the caller: `pdserve.plan.plan.forecast_floor`); None: the reactive loop alone."""
        self.cfg = cfg
        self.admin = admin
        self.prefill = prefill
        self.decode = decode
        self.colocated = colocated
        self.window = Window(cfg.window_s)
        self.streak: Counter[str] = Counter()  # decision key -> ticks in a row
        self.cooldown = 0  # ticks to hold after a change
        self.decisions: Counter[tuple[str, str]] = Counter()  # (action, mode) -> count
        self.last: Decision | None = None
        self.last_signals: Signals | None = None
        self.tick_s = 0.0
        # worker -> (engine steps, their seconds, when read): the counters at the last read
        self._marks: dict[str, tuple[float, float, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ops: set[asyncio.Task[None]] = set()  # the operations `act` mode runs now
        self.starting: Counter[Role] = Counter()  # workers its adds are starting, per role
        self.started_s = time.perf_counter()
        self.forecast = None if colocated else forecast

    # ---- signals -------------------------------------------------------------------------
    def read(self, now: float) -> Signals:
        recent = self.window.recent(now)
        missing: list[str] = []
        prefill_up = [w for w in self.prefill.routable() if w.stats is not None]
        decode_up = [w for w in self.decode.routable() if w.stats is not None]
        if not decode_up:
            missing.append("decode stats")
        if not self.colocated and not prefill_up:
            missing.append("prefill stats")
        if not recent:
            missing.append("finished requests")
        ttft_b, tpot_b = self.cfg.ttft_ms / 1e3, self.cfg.tpot_ms / 1e3
        ttfts = [f.ttft_s for f in recent]
        tpots = [f.tpot_s if f.ttft_s is not None else None for f in recent]
        with_tpot = [f for f in recent if f.tpot_s is not None or f.ttft_s is None]
        both = [
            f.ttft_s is not None and f.ttft_s <= ttft_b and (f.tpot_s or 0.0) <= tpot_b
            for f in recent
        ]
        queued = None
        if prefill_up or self.colocated:
            queued = sum(
                w.outstanding_tokens + (w.stats.queued_prefill_tokens if w.stats else 0)
                for w in (prefill_up if not self.colocated else decode_up)
            )
        kv_free = backlog = None
        if decode_up:
            total = sum(w.stats.num_total_blocks for w in decode_up if w.stats)
            kv_free = sum(max(w.free_blocks, 0) for w in decode_up) / total if total else None
        if prefill_up:
            backlog = sum(w.stats.num_reserved for w in prefill_up if w.stats)
        decode_steps = self._since_last(decode_up, now)
        prefill_busy = None if self.colocated else self._since_last(prefill_up, now).busy
        prompts = [f.prompt_tokens for f in recent]
        outputs = [f.output_tokens for f in recent]
        floor = self._floor(recent, now, queued)
        return Signals(
            prefill_workers=len(self.prefill.routable()),
            decode_workers=len(self.decode.routable()),
            finished=len(recent),
            ttft_attainment=_share(ttfts, ttft_b) if recent else None,
            tpot_attainment=_share(tpots, tpot_b) if with_tpot else None,
            attainment=sum(both) / len(both) if recent else None,
            queued_prefill_tokens=queued,
            decode_kv_free=kv_free,
            decode_step_ms=decode_steps.step_ms,
            transfer_backlog=backlog,
            prefill_busy=prefill_busy,
            decode_busy=decode_steps.busy,
            prompt_p50=_pct(prompts, 50),
            prompt_p90=_pct(prompts, 90),
            output_p50=_pct(outputs, 50),
            output_p90=_pct(outputs, 90),
            floor_prefill=None if floor is None else self._clamp(Role.PREFILL, floor.prefill),
            floor_decode=None if floor is None else self._clamp(Role.DECODE, floor.decode),
            floor_reason="" if floor is None else floor.reason,
            missing=tuple(missing),
            starting_prefill=self.starting[Role.PREFILL],
            starting_decode=self.starting[Role.DECODE],
        )

    def _floor(
        self, recent: Sequence[Finished], now: float, queued_tokens: int | None
    ) -> Floor | None:
        """The forecast floor at the window's load and the prompt tokens queued now (None:
        no profile, or nothing finished)."""
        if self.forecast is None or not recent:
            return None
        # the window's arrivals (or those since the planner started); the lengths of the
        # requests it finished
        span = min(self.cfg.window_s, max(now - self.started_s, self.cfg.interval_s))
        rate = self.window.arrival_rate(now, span)
        uncached = [f.uncached_tokens for f in recent]
        outputs = [f.output_tokens for f in recent]
        return self.forecast.floor(rate, uncached, outputs, queued_tokens)

    def _clamp(self, role: Role, n: int) -> int:
        c = self.cfg
        if role is Role.PREFILL:
            return min(max(n, c.min_prefill), c.max_prefill)
        return min(max(n, c.min_decode), c.max_decode)

    def _since_last(self, workers: Sequence[Any], now: float) -> Stepped:
        """The workers' engine steps, their seconds and the wall time since the last read,
        from their counters (a worker seen for the first time, or with no counters, adds
        nothing)."""
        steps = secs = wall = 0.0
        for w in workers:
            x = w.stats.extra
            if StatKey.ENGINE_STEP_SECONDS_TOTAL.value not in x:
                continue
            mark = (x.get(StatKey.ENGINE_STEPS_TOTAL.value, 0.0),
                    x[StatKey.ENGINE_STEP_SECONDS_TOTAL.value], now)  # fmt: skip
            before = self._marks.get(w.name)
            self._marks[w.name] = mark
            if before is not None:
                steps, secs = steps + mark[0] - before[0], secs + mark[1] - before[1]
                wall += now - before[2]
        return Stepped(steps, secs, wall)

    # ---- the decision --------------------------------------------------------------------
    def decide(self, s: Signals, busy: bool = False) -> Decision:
        """One tick's decision (module docstring); counts the streaks it needs. `busy`: an
        operation it started still runs."""
        if s.missing:
            self.streak.clear()
            return Decision("hold", f"signal missing: {', '.join(s.missing)}")
        if busy or self.cooldown > 0:
            # the floor's shortfall is the load's, not the pools' answer to the last change:
            # it waits neither for them to settle nor for the workers being started (which
            # it counts), since each add is a cold start of seconds
            floor = None if self.colocated else self._below_floor(s)
            if floor is None or floor.action != "add":
                if busy:
                    return Decision("hold", "an operation is under way")
                self.cooldown -= 1
                return Decision("hold", f"settling after a change ({self.cooldown + 1} ticks left)")
            want = floor
        else:
            want = self._want(s)
        if want.action == "hold":
            self.streak.clear()
            return want
        # a drain's streak is the role's: which worker is least loaded changes tick to tick
        who = "" if want.action == "drain" else want.worker
        key = f"{want.action}:{want.role}:{who}"
        self.streak = Counter({key: self.streak[key] + 1})
        # slower down than up: a drain needs its quiet to last DOWN_PATIENCE x as long
        needed = self.cfg.patience * (DOWN_PATIENCE if want.action == "drain" else 1)
        if self.streak[key] < needed:
            return Decision("hold", f"{want.line()} (held {self.streak[key]} of {needed} ticks)")
        self.streak.clear()
        self.cooldown = self.cfg.patience
        return want

    def _want(self, s: Signals) -> Decision:
        target = self.cfg.target_attainment
        assert s.ttft_attainment is not None and s.attainment is not None
        ttft_ok = s.ttft_attainment >= target
        tpot_ok = s.tpot_attainment is None or s.tpot_attainment >= target
        behind = self._behind(s)
        figures = (
            f"attainment {s.attainment:.2f} (TTFT {s.ttft_attainment:.2f}, TPOT "
            f"{'-' if s.tpot_attainment is None else f'{s.tpot_attainment:.2f}'}) of "
            f"{s.finished} requests"
        )
        if self.colocated:
            if not (ttft_ok and tpot_ok):
                return self._grow(Role.DECODE, s, figures, donor_ok=False)
            return self._shrink_idle(s, figures)
        short = self._below_floor(s)
        if short is not None:
            return short
        if not ttft_ok and (tpot_ok or behind):
            donor_ok = tpot_ok and (s.decode_kv_free or 0.0) > DONOR_KV_FREE
            return self._grow(Role.PREFILL, s, figures + ", prompts wait", donor_ok)
        if not tpot_ok:
            donor_ok = ttft_ok and not behind
            return self._grow(Role.DECODE, s, figures + ", decode steps too slow", donor_ok)
        if s.attainment < target:  # each bound alone holds, both at once do not
            return Decision("hold", f"{figures}: no single role to blame")
        return self._shrink_idle(s, figures)

    @staticmethod
    def _behind(s: Signals) -> bool:
        """The prefill pool has more uncached prompt tokens queued than it works off soon."""
        return (s.queued_prefill_tokens or 0) > QUEUED_TOKENS_PER_WORKER * max(s.prefill_workers, 1)

    def _load(self, role: Role, s: Signals) -> float | None:
        """A role's load: prefill, its workers' busy share; decode, its step time against
        the TPOT bound (a decode worker steps whenever anything runs, so its busy share says
        little about its room). None: not known yet."""
        if role is Role.PREFILL:
            return s.prefill_busy
        return None if s.decode_step_ms is None else s.decode_step_ms / self.cfg.tpot_ms

    def _below_floor(self, s: Signals) -> Decision | None:
        """Grow the roles below their forecast floor, if any: the one furthest below by a
        flip from the other role where that stays above its own floor (and has the slack,
        `_grow`); else every short role by its whole shortfall at once (a cold start takes
        seconds: one worker per decision, each after the last had joined, was the slowest
        part of the recovery from a load step; `pdserve.plan.elastic` measured it)."""
        if s.floor_prefill is None or s.floor_decode is None:
            return None
        short_p = s.floor_prefill - s.prefill_workers - s.starting_prefill
        short_d = s.floor_decode - s.decode_workers - s.starting_decode
        if max(short_p, short_d) <= 0:
            return None
        role = Role.PREFILL if short_p >= short_d else Role.DECODE
        donor_spare = (short_d if role is Role.PREFILL else short_p) < 0
        floor = s.floor_prefill if role is Role.PREFILL else s.floor_decode
        why = f"forecast floor: {role.value} needs {floor} ({s.floor_reason})"
        d = self._grow(role, s, why, donor_ok=donor_spare)
        if d.action != "add":
            return d
        short = {Role.PREFILL: short_p, Role.DECODE: short_d}
        other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
        adds = tuple((r, short[r]) for r in (role, other) if short[r] > 0)  # furthest first
        floors = {Role.PREFILL: s.floor_prefill, Role.DECODE: s.floor_decode}
        needs = ", ".join(f"{r.value} needs {floors[r]}" for r, _ in adds)
        why = f"forecast floor: {needs} ({s.floor_reason})"
        return Decision("add", why, adds[0][0], adds=adds)

    def _grow(self, role: Role, s: Signals, why: str, donor_ok: bool) -> Decision:
        c = self.cfg
        have = s.prefill_workers if role is Role.PREFILL else s.decode_workers
        donor_pool = self.decode if role is Role.PREFILL else self.prefill
        donor_have = s.decode_workers if role is Role.PREFILL else s.prefill_workers
        donor_min = c.min_decode if role is Role.PREFILL else c.min_prefill
        if have >= (c.max_prefill if role is Role.PREFILL else c.max_decode):
            return Decision("hold", f"{why}; {role.value} is at its bound ({have})")
        load = self._load(Role.DECODE if role is Role.PREFILL else Role.PREFILL, s)
        if donor_ok and load is not None and donor_have > 1:
            # its other workers take over its load
            donor_ok = _others_take(load, donor_have, DONOR_BUSY_MAX)
        if donor_ok and donor_have > donor_min and not self.colocated:
            donor = min(donor_pool.routable(), key=lambda w: len(w.active))
            return Decision("flip", why, role, donor.name)
        return Decision("add", why, role)

    def _shrink_idle(self, s: Signals, why: str) -> Decision:
        """Drain a worker of a role whose others can take its load (`IDLE_BUSY_MAX`: decode,
        its step time against the TPOT bound, with most of its KV free; prefill, its busy
        share), when the SLO holds with room (attainment at least halfway from the target to
        1), never below a role's `min_` or forecast floor. The prefill pool's load is its busy
        share over the tick, not whether a prompt waits at the instant of the tick: at a low
        rate one often does, and a pool of idle workers was never given back."""
        c = self.cfg
        if s.attainment is None or s.attainment < (1.0 + c.target_attainment) / 2:
            return Decision("hold", f"{why}: within the SLO")
        # never below the forecast floor (none without a profile)
        min_decode = max(c.min_decode, s.floor_decode or 0)
        min_prefill = max(c.min_prefill, s.floor_prefill or 0)
        decode_load = self._load(Role.DECODE, s)
        idle_decode = (s.decode_kv_free or 0.0) > IDLE_KV_FREE and (
            decode_load is None or _others_take(decode_load, s.decode_workers, IDLE_BUSY_MAX)
        )
        if s.decode_workers > min_decode and idle_decode:
            w = min(self.decode.routable(), key=lambda w: len(w.active))
            return Decision("drain", f"{why}; the decode pool is idle", Role.DECODE, w.name)
        if (
            not self.colocated
            and s.prefill_workers > min_prefill
            and not self._behind(s)
            and _others_take(s.prefill_busy, s.prefill_workers, IDLE_BUSY_MAX)
        ):
            w = min(self.prefill.routable(), key=lambda w: len(w.active))
            return Decision(
                "drain", f"{why}; the prefill pool has room to spare", Role.PREFILL, w.name
            )
        return Decision("hold", f"{why}: within the SLO")

    # ---- the loop ------------------------------------------------------------------------
    def step(self, now: float, busy: bool) -> Decision:
        """Read the signals at `now` and decide; `busy`: an operation it started still runs
        (a new worker loads for seconds), so the signals stay fresh and it holds. What one
        tick does apart from carrying the decision out: `pdserve.plan.elastic` runs it on
        simulated time."""
        s = self.read(now)
        d = self.decide(s, busy)
        self.last, self.last_signals = d, s
        self.decisions[(d.action, self.cfg.mode)] += 1
        return d

    async def tick(self) -> Decision:
        """`step`, then log the decision and, in `act` mode, carry it out."""
        t0 = time.perf_counter()
        d = self.step(t0, any(not op.done() for op in self._ops))
        self.tick_s = time.perf_counter() - t0
        if d.action == "hold":
            log.info("planner (%s): %s", self.cfg.mode, d.line())
            return d
        log.warning("planner (%s): %s", self.cfg.mode, d.line())
        if self.cfg.mode == "act":
            op = asyncio.create_task(self._act(d))
            self._ops.add(op)
            op.add_done_callback(self._ops.discard)
        return d

    async def _act(self, d: Decision) -> None:
        from router.membership import PoolError

        try:
            if d.action == "flip" and d.worker and d.role:
                await self.admin.flip(d.worker, d.role)
            elif d.action == "add":
                adds = [self._add(r) for r, n in d.to_add for _ in range(n)]
                for got in await asyncio.gather(*adds, return_exceptions=True):
                    if isinstance(got, BaseException):
                        raise got
            elif d.action == "drain" and d.worker:
                await self.admin.drain(d.worker)
        except PoolError as e:
            log.warning("planner: %s did not happen: %s", d.line(), e.message)

    async def _add(self, role: Role) -> None:
        """One worker added, counted as starting (`Signals.starting_*`) until it joined or
        failed."""
        self.starting[role] += 1
        try:
            await self.admin.add(role)
        finally:
            self.starting[role] -= 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.tick()
            except Exception:
                # Boundary of the planner loop: a bug here must not stop it, nor serving.
                log.exception("planner tick failed")

    def stop(self) -> None:
        for task in (self._task, *self._ops):
            if task is not None:
                task.cancel()
