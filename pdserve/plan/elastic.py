"""The planner on simulated time: what its decisions would do to a load that changes.

Why: in `advisory` mode the planner says what it would do and nothing changes, so whether
its advice would have brought the SLO back is a prediction, and issue 41 asks for it ("as
predicted"). This runs the planner's own tick (`router.planner.Planner.step`: its signals,
its decision, hysteresis, the forecast floor) every `interval_s` of simulated time over the
simulator's pools (`pdserve.plan.sim`, whose workers are the engine's scheduler and whose
placement is the router's), and carries each decision out there as `act` mode would:

- an add: a new worker of that role joins `start_s` later (a cold start);
- a drain: the worker takes no new request, and leaves once it holds nothing (no request,
  no block: its transfers landed);
- a flip: a drain, then the worker joins the other role `flip_s` later, its cache empty.

While an operation runs the planner holds, as its `tick` does (the forecast floor's adds
excepted). The planner reads what it reads from the router (each worker's stats and step
counters, the window of admitted and finished requests) from the simulated workers, exact
at every tick.

What must hold: the planner's decision code is not described a second time here; a change
to it changes the prediction.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pdserve.plan.sim import Outcome, SimConfig, Simulator, SimWorker, _Live
from pdserve.plan.workload import WorkloadRequest
from pool_api.messages import Role
from router.config import PlannerSettings
from router.forecast import ForecastFloor
from router.planner import Decision, Finished, Planner


@dataclass(frozen=True)
class Sample:
    """One tick: the pools' routable workers and what the planner decided."""

    t: float
    prefill: int
    decode: int
    decision: str


@dataclass
class ElasticRun:
    outcomes: list[Outcome]
    samples: list[Sample]
    decisions: list[tuple[float, str]]  # (when, the decision's line), holds left out


class ElasticSimulator(Simulator):
    """`Simulator` whose pools change under the planner's decisions (module docstring)."""

    def __init__(
        self,
        cfg: SimConfig,
        settings: PlannerSettings,
        forecast: ForecastFloor | None = None,
        start_s: float = 8.5,
        flip_s: float = 0.5,
    ) -> None:
        super().__init__(cfg)
        colocated = bool(cfg.shape.colocated)
        no_admin: Any = None  # decisions are carried out here (`_carry_out`), not by an admin
        self.planner = Planner(
            settings, no_admin, self.prefill_pool, self.decode_pool, colocated, forecast
        )
        self.planner.started_s = 0.0
        self.start_s, self.flip_s = start_s, flip_s
        self.flipping = 0  # flipped workers drained and not rejoined yet
        self.leaving: dict[str, Role | None] = {}  # draining -> the role it rejoins (a flip)
        self.samples: list[Sample] = []
        self.decisions: list[tuple[float, str]] = []
        self._names = itertools.count(1)

    def run_elastic(self, requests: Sequence[WorkloadRequest], seed: int = 0) -> ElasticRun:
        self.clock.at(self.planner.cfg.interval_s, self._tick)
        outcomes = self.run(requests, seed)
        return ElasticRun(outcomes, self.samples, self.decisions)

    # ---- the planner's tick ----------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock.now
        self._settle()
        d = self.planner.step(now, self.op_running)
        routable = (len(self.prefill_pool.routable()), len(self.decode_pool.routable()))
        self.samples.append(Sample(now, *routable, d.line()))
        if d.action != "hold":
            self.decisions.append((now, d.line()))
            self._carry_out(d)
        if self.clock.pending:  # requests still to arrive or to end (else: nothing can change)
            self.clock.at(now + self.planner.cfg.interval_s, self._tick)

    def _carry_out(self, d: Decision) -> None:
        if d.action == "add":
            for role, n in d.to_add:
                for _ in range(n):
                    self.planner.starting[role] += 1
                    name = f"{role.value}-new{next(self._names)}"
                    join = partial(self._join, role, name, True)
                    self.clock.at(self.clock.now + self.start_s, join)
        elif d.action in ("drain", "flip") and d.worker is not None:
            worker = self._worker(d.worker)
            if worker is None:
                return
            worker.load.draining = True
            self.leaving[d.worker] = d.role if d.action == "flip" else None
            self._settle()

    def _arrive(self, live: _Live) -> None:
        self.planner.window.arrivals.append(self.clock.now)
        super()._arrive(live)

    @property
    def op_running(self) -> bool:
        """An add, drain or flip it carried out has not ended (as the planner's `_ops`)."""
        return bool(self.leaving) or self.flipping > 0 or sum(self.planner.starting.values()) > 0

    # ---- pool membership -------------------------------------------------------------------
    def _worker(self, name: str) -> SimWorker | None:
        return next((w for w in self.prefill + self.decode if w.name == name), None)

    def _role(self, role: Role) -> tuple[list[SimWorker], Any]:
        """A role's simulated workers and the router's pool of them."""
        if role is Role.PREFILL:
            return self.prefill, self.prefill_pool
        return self.decode, self.decode_pool

    def _join(self, role: Role, name: str, added: bool) -> None:
        """`name` joins `role`: a new worker (`added`), or a flipped one."""
        w = self.new_worker(role, name)
        workers, pool = self._role(role)
        workers.append(w)
        pool.workers.append(w.load)
        self.by_load[id(w.load)] = w
        if added:
            self.planner.starting[role] -= 1
        else:
            self.flipping -= 1
        self._retry_waiting()

    def _settle(self) -> None:
        """Draining workers that hold nothing leave; a flipped one rejoins its new role."""
        for name, to in list(self.leaving.items()):
            w = self._worker(name)
            if w is None or w.live or w.busy or w.blocks.num_used_blocks:
                continue
            del self.leaving[name]
            workers, pool = self._role(w.role)
            workers.remove(w)
            pool.workers.remove(w.load)
            del self.by_load[id(w.load)]
            if to is not None:
                self.flipping += 1
                self.clock.at(self.clock.now + self.flip_s, partial(self._join, to, name, False))

    # ---- what the planner's window sees ----------------------------------------------------
    def finished(self, live: _Live, worker: SimWorker) -> None:
        o, req = live.outcome, live.request
        n = len(req.prompt_token_ids)
        uncached = n - live.shared_blocks * self.cfg.block_size
        self.planner.window.note(
            self.clock.now, o.arrival_s, o.first_token_s, o.last_token_s, o.output_tokens, n,
            uncached,
        )  # fmt: skip
        super().finished(live, worker)
        self._settle()

    def timed_out(self, live: _Live) -> None:
        n = len(live.request.prompt_token_ids)
        self.planner.window.items.append(Finished(self.clock.now, None, None, n, 0))


def attainment_series(
    outcomes: Sequence[Outcome], ttft_s: float, tpot_s: float, window_s: float, step_s: float = 1.0
) -> list[tuple[float, float | None]]:
    """Each `step_s`, the share of the requests that ended in the last `window_s` that met
    both bounds (None: none ended); a failed request ends when it arrived."""
    ends = sorted(
        (o.last_token_s if o.last_token_s is not None else o.arrival_s, o.meets(ttft_s, tpot_s))
        for o in outcomes
    )
    if not ends:
        return []
    out: list[tuple[float, float | None]] = []
    t = step_s
    while t <= ends[-1][0] + step_s:
        recent = [met for end, met in ends if t - window_s <= end < t]
        out.append((t, sum(recent) / len(recent) if recent else None))
        t += step_s
    return out


def recovered_after(
    series: Sequence[tuple[float, float | None]], step_at: float, step_end: float, window_s: float
) -> float | None:
    """Seconds after `step_at` when attainment was back at 90 % to stay until `step_end`
    (the window must have seen the step first); None: not within the step."""
    during = [(t, a) for t, a in series if step_at <= t < step_end and a is not None]
    for k, (t, _) in enumerate(during):
        if t > step_at + window_s and all(a >= 0.9 for _, a in during[k:] if a is not None):
            return t - step_at
    return None
