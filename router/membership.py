"""Pool membership at run time: workers added, drained and switched between the roles.

The router's pools are lists it may change while it serves (`Pool.add`, `Pool.remove`). What
starts and stops worker processes is the deployment's (`WorkerLauncher`, implemented by
`pdserve.launch.Deployment` over Ray); this module owns the order of the steps, so that
nothing in flight is lost:

- **add**: the launcher starts a worker and checks it pairs with this router (checkpoint,
  wire version, KV layout); it joins its pool, and takes requests once its first stats
  arrive (a routable worker is up and not draining).
- **drain**: no new request goes to it from this router (`WorkerLoad.retiring`) nor, once it
  is told (`drain`), from any other (it refuses them: `WorkerDraining`, placed elsewhere).
  What it holds runs to its end: the requests this router tracks on it, and, from its
  stats, its running, waiting and reserved work (a prefill worker's leases are its KV
  transfers not yet acknowledged). The drain has a bound: past it, this router ends its
  calls to the worker (a prompt pass or a reservation not yet used is placed again; a
  stream under way ends UNAVAILABLE, naming the drain), and the worker ends the rest and
  frees their blocks. Then it leaves the pool, its prefix-index entries are dropped, and
  the launcher stops it.
- **flip**: a drain, then the worker switches role in place (weights and KV cache kept,
  `pdserve.worker_actor`), and joins the other pool. Its prefix blocks stay in the index:
  the same worker holds them.

One operation per worker at a time; a drain that would leave a role with no routable
worker is refused (the router could not serve).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pool_api.messages import Role
from pool_api.prefix_index import PrefixIndex
from router.clients import DecodeClient, PrefillClient
from router.pools import Pool, WorkerLoad

log = logging.getLogger(__name__)

DEFAULT_DRAIN_BOUND_S = 60.0
"""How long a drain waits for what a worker holds to end, by default (a request's worst
case is its whole decode, which at the default model's speed on a CPU is under a minute)."""
_POLL_S = 0.05  # how often a drain looks again (the stats refresh is 0.2 s)
_JOIN_WAIT_S = 30.0  # how long an added or flipped worker may take to send its first stats
# How long a new worker may take to start: Ray may have no node with the pool's resources
# (then the actor would wait forever); past this the launcher stops it and the add fails.
LAUNCH_WAIT_S = 300.0
# A drain's hold on its worker (`WorkerBase.drain`): renewed every _RENEW_S while the drain
# waits, so a worker whose draining router died serves again within DRAIN_LEASE_S.
DRAIN_LEASE_S = 10.0
_RENEW_S = 2.0


class WorkerLauncher(Protocol):
    """What starts, switches and stops worker processes (`pdserve.launch.Deployment`)."""

    async def launch(self, role: Role) -> PrefillClient | DecodeClient:
        """A new worker of `role`, ready and checked against this router."""
        ...

    async def flip(self, name: str, to: Role) -> tuple[PrefillClient | DecodeClient, float]:
        """Worker `name`, drained, switched to role `to` in place; its client of the new
        role and the switch's seconds on the worker."""
        ...

    async def retire(self, name: str) -> None:
        """Stop worker `name` (drained) and forget it."""
        ...

    def client(self, name: str, role: Role) -> PrefillClient | DecodeClient:
        """A client of role `role` for worker `name` (one found serving another role than
        its pool's: `PoolAdmin.reconcile`)."""
        ...


class PoolError(Exception):
    """A pool operation refused: `status` is its HTTP status (400 bad field, 404 no such
    worker, 409 conflicting state, 501 no launcher), `field` the request field to blame."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


@dataclass
class DrainResult:
    worker: str
    drained_s: float  # from the drain's start until nothing was left, or the bound
    ended: int  # requests still there at the bound, ended (0: nothing lost to the bound)


class PoolAdmin:
    def __init__(
        self,
        prefill: Pool[PrefillClient],
        decode: Pool[DecodeClient],
        index: PrefixIndex,
        in_flight: Callable[[str], int],
        colocated: bool,
        deadline_s: float,
    ) -> None:
        """`in_flight(name)`: the requests this router has on worker `name`;
        `deadline_s`: the deadline of every call to a worker (router.worker_call_timeout_s),
        given to the clients of workers that join."""
        self.prefill = prefill
        self.decode = decode
        self.index = index
        self.in_flight = in_flight
        self.colocated = colocated
        self.deadline_s = deadline_s
        self.launcher: WorkerLauncher | None = None  # the deployment sets it
        self.busy: dict[str, str] = {}  # worker name -> the operation under way on it
        self.num_ops: dict[tuple[str, str], int] = {}  # (operation, outcome) -> count

    # ---- what the pools are --------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Every worker: its role, state and load, as `GET /v1/admin/pool` answers."""
        now = time.monotonic()
        workers = []
        for pool in (self.prefill, self.decode):
            for w in pool.workers:
                workers.append(_worker_status(w, self.busy.get(w.name), now))
        return {
            "mode": "colocated" if self.colocated else "disaggregated",
            "prefill": sum(w.routable for w in self.prefill.workers),
            "decode": sum(w.routable for w in self.decode.workers),
            "workers": workers,
        }

    def _find(self, name: str) -> tuple[Pool[Any], WorkerLoad[Any]]:
        for pool in (self.prefill, self.decode):
            w = pool.get(name)
            if w is not None:
                return pool, w
        raise PoolError(404, f"no worker named {name!r} in this router's pools", "worker")

    def _need_launcher(self, what: str) -> WorkerLauncher:
        if self.launcher is None:
            raise PoolError(501, f"{what}: this router has no worker launcher (in-process pools)")
        return self.launcher

    def _claim(self, name: str, op: str) -> None:
        if name in self.busy:
            raise PoolError(409, f"{name} is already being {self.busy[name]}ed", "worker")
        self.busy[name] = op

    def _count(self, op: str, outcome: str) -> None:
        self.num_ops[(op, outcome)] = self.num_ops.get((op, outcome), 0) + 1

    def reconcile(self) -> list[str]:
        """Move each worker whose stats say it serves another role than its pool's into the
        pool of that role (another router flipped it, or Ray restarted a flipped worker in
        the role it started with); until then it takes no new request (not routable).
        Returns the workers moved."""
        moved = []
        pools: tuple[Pool[Any], ...] = (self.prefill, self.decode)
        for pool in pools:
            for w in list(pool.workers):
                if not w.misplaced or w.name in self.busy or self.launcher is None:
                    continue
                assert w.stats is not None
                role = w.stats.role
                w.client.retire(f"serves {role.value} now")
                pool.remove(w.name)
                joined = self._join(self.launcher.client(w.name, role))
                joined.stats, joined.stats_at_s, joined.healthy = w.stats, w.stats_at_s, True
                moved.append(w.name)
                log.warning(
                    "pool: %s serves %s now (flipped elsewhere, or restarted in its first role)"
                    ": moved to the %s pool",
                    w.name,
                    role.value,
                    role.value,
                )
        return moved

    # ---- add -----------------------------------------------------------------------------
    async def add(self, role: Role) -> dict[str, Any]:
        launcher = self._need_launcher("add")
        if role is Role.PREFILL and self.colocated:
            raise PoolError(400, "a colocated deployment has no prefill pool", "role")
        t0 = time.monotonic()
        try:
            try:
                client = await asyncio.wait_for(launcher.launch(role), LAUNCH_WAIT_S)
            except asyncio.TimeoutError as e:
                raise PoolError(
                    409,
                    f"the new {role.value} worker did not start within {LAUNCH_WAIT_S:g} s "
                    "(no node with the pool's resources free?); it was stopped",
                ) from e
            w = self._join(client)
            await self._until_stats(w)
        except PoolError:
            self._count("add", "failed")
            raise
        except Exception as e:
            self._count("add", "failed")
            log.warning("adding a %s worker failed: %s", role.value, e)
            raise PoolError(409, f"the new {role.value} worker did not join: {e}") from e
        took = time.monotonic() - t0
        self._count("add", "ok")
        log.warning("pool: %s joined the %s pool in %.1f s", w.name, client.role.value, took)
        return {"worker": w.name, "role": client.role.value, "seconds": round(took, 3)}

    def _join(self, client: PrefillClient | DecodeClient) -> WorkerLoad[Any]:
        client.deadline_s = self.deadline_s
        if isinstance(client, PrefillClient):
            return self.prefill.add(client)
        return self.decode.add(client)

    async def _until_stats(self, w: WorkerLoad[Any]) -> None:
        """Returns once the refresh loop has heard from the new worker (it is routable)."""
        deadline = time.monotonic() + _JOIN_WAIT_S
        while not w.routable:
            if time.monotonic() > deadline:
                raise PoolError(409, f"{w.name} sent no stats within {_JOIN_WAIT_S:g} s")
            await asyncio.sleep(_POLL_S)

    # ---- drain ---------------------------------------------------------------------------
    async def drain(self, name: str, bound_s: float = DEFAULT_DRAIN_BOUND_S) -> dict[str, Any]:
        """Drain worker `name`, then stop it (see the module docstring)."""
        launcher = self.launcher
        pool, w = self._find(name)
        self._refuse_last(pool, w, "drain")
        self._claim(name, "drain")
        try:
            result = await self._drain(pool, w, bound_s)
            w.client.retire("was drained and stopped")
            pool.remove(name)
            await self.index.drop(name)
            if launcher is not None:
                await launcher.retire(name)
        except BaseException:
            self._count("drain", "failed")
            if pool.get(name) is w:  # it stays: taking requests again (its lease runs out)
                w.retiring = False
            raise
        finally:
            self.busy.pop(name, None)
        self._count("drain", "ok")
        log.warning(
            "pool: %s drained in %.1f s and stopped (%d requests ended at the bound)",
            name,
            result.drained_s,
            result.ended,
        )
        return {
            "worker": name,
            "drained_s": round(result.drained_s, 3),
            "ended": result.ended,
            "stopped": launcher is not None,
        }

    def _refuse_last(self, pool: Pool[Any], w: WorkerLoad[Any], op: str) -> None:
        others = [x for x in pool.routable() if x is not w]
        if w.routable and not others:
            raise PoolError(
                409,
                f"{op} {w.name}: it is the last {pool.role.value} worker taking requests; add "
                "one first",
                "worker",
            )

    async def _drain(self, pool: Pool[Any], w: WorkerLoad[Any], bound_s: float) -> DrainResult:
        """No new requests; wait for what it holds to end, up to `bound_s`; past the bound,
        end this router's calls to it and have the worker end the rest."""
        t0 = time.monotonic()
        w.retiring = True
        await self._hold(w)
        deadline, renew = t0 + bound_s, t0 + _RENEW_S
        while not self._idle(w):
            if time.monotonic() >= renew:
                renew = time.monotonic() + _RENEW_S
                await self._hold(w)
            if time.monotonic() >= deadline:
                left = self.in_flight(w.name)
                log.warning(
                    "drain of %s: bound of %g s passed with %d requests of this router still "
                    "there: ending them",
                    w.name,
                    bound_s,
                    left,
                )
                w.client.retire(f"was drained (its bound of {bound_s:g} s passed)")
                return DrainResult(w.name, time.monotonic() - t0, left)
            await asyncio.sleep(_POLL_S)
        return DrainResult(w.name, time.monotonic() - t0, 0)

    async def _hold(self, w: WorkerLoad[Any]) -> None:
        """Tell the worker to refuse new requests (again: the lease is renewed)."""
        try:
            await w.client.drain(DRAIN_LEASE_S)
        except Exception as e:  # a dead worker is drained already: nothing runs there
            log.warning("drain of %s: the worker did not answer (%s)", w.name, e)

    def _idle(self, w: WorkerLoad[Any]) -> bool:
        """Nothing of this router's on it, and its own stats, taken since the drain began
        (they say `draining`), show nothing running, waiting or reserved."""
        if self.in_flight(w.name) or w.active:
            return False
        s = w.stats
        if not w.healthy:  # down: whatever it held is gone with it
            return True
        return (
            s is not None
            and s.draining
            and s.num_running == 0
            and s.num_waiting == 0
            and s.num_reserved == 0
        )

    def _keep(self, name: str, role: Role, launcher: WorkerLauncher) -> None:
        """A flip failed part way (the worker died during it, or never answered): the
        worker stays in exactly one pool, its first role's, marked down, so the refresh
        probes it until it answers (Ray restarts a dead actor in the role it started
        with; one that did switch is moved by `reconcile` once its stats say so)."""
        for pool in (self.prefill, self.decode):
            if pool.get(name) is not None:
                pool.remove(name)
        w = self._join(launcher.client(name, role))
        w.mark_down("its flip failed")

    # ---- flip ----------------------------------------------------------------------------
    async def flip(
        self, name: str, to: Role, bound_s: float = DEFAULT_DRAIN_BOUND_S
    ) -> dict[str, Any]:
        """Drain worker `name`, switch its role in place, and add it to the other pool."""
        launcher = self._need_launcher("flip")
        if self.colocated:
            raise PoolError(400, "a colocated deployment's workers run both phases", "to")
        pool, w = self._find(name)
        if w.client.role is to:
            raise PoolError(409, f"{name} is a {to.value} worker already", "to")
        self._refuse_last(pool, w, "flip")
        self._claim(name, "flip")
        t0 = time.monotonic()
        try:
            drained = await self._drain(pool, w, bound_s)
            w.client.retire(f"was switched to {to.value}")
            pool.remove(name)
            client, switch_s = await launcher.flip(name, to)
            joined = self._join(client)
            await self._until_stats(joined)
        except BaseException as e:
            self._count("flip", "failed")
            if pool.get(name) is w:  # it failed while draining: the worker stays as it was
                w.retiring = False
            else:
                self._keep(name, w.client.role, launcher)
            if isinstance(e, PoolError) or not isinstance(e, Exception):
                raise
            log.warning("flip of %s failed: %s", name, e)
            raise PoolError(409, f"flip of {name} failed: {e}") from e
        finally:
            self.busy.pop(name, None)
        took = time.monotonic() - t0
        self._count("flip", "ok")
        log.warning(
            "pool: %s flipped to %s in %.3f s on the worker (%.1f s with its drain)",
            name,
            to.value,
            switch_s,
            took,
        )
        return {
            "worker": name,
            "role": to.value,
            "drained_s": round(drained.drained_s, 3),
            "ended": drained.ended,
            "flip_s": round(switch_s, 6),
            "seconds": round(took, 3),
        }


def _worker_status(w: WorkerLoad[Any], op: str | None, now: float) -> dict[str, Any]:
    if op is not None:
        state = f"{op}ing"
    elif w.stats is None and w.down_since is None:
        state = "joining"  # no stats yet: it takes requests once they come
    elif not w.healthy:
        state = "down"
    elif w.draining or w.retiring:
        state = "draining"
    else:
        state = "serving"
    out: dict[str, Any] = {
        "name": w.name,
        "role": w.client.role.value,
        "state": state,
        "in_flight": len(w.active),
    }
    s = w.stats
    if s is not None:
        out.update(
            pid=s.pid,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_reserved=s.num_reserved,
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            num_requests_total=s.num_requests_total,
            stats_age_s=round(now - w.stats_at_s, 3),
        )
    return out
