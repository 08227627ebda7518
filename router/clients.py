"""Typed clients of the worker pools: the only place the router calls a worker.

Each method of `PrefillClient` / `DecodeClient` names one worker method (`pool_api.api`), so
mypy checks every call the router makes. A client wraps either a plain in-process worker
(tests, benchmarks) or a Ray actor handle (`ray_api`), and turns a lost actor into
`WorkerUnavailable`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar, cast

from engine.loop import EngineFailed
from pool_api.api import DecodeApi, PrefillApi, WorkerApi
from pool_api.messages import (
    DecodeStart,
    IndexUpdate,
    NotServing,
    PrefillResult,
    PrefillTask,
    ReserveResult,
    Role,
    TokenSink,
    WorkerRequest,
    WorkerStats,
)
from router.race import Lost, first_of

log = logging.getLogger(__name__)

T = TypeVar("T")
A = TypeVar("A", bound=WorkerApi)

# Deadlines of the calls to a worker. A heartbeat answers at once on the worker's event loop
# (never behind an engine step), so a short bound tells a frozen worker from a busy one.
# Every other call also ends when the worker is found silent (`went_silent`: its stats timed
# out), which bounds a frozen worker's cost to its requests by the stats refresh (2 s), not
# by how long it stays frozen; `deadline_s` (router.worker_call_timeout_s) caps the rest.
HEARTBEAT_DEADLINE_S = 2.0


class WorkerUnavailable(Exception):
    """The worker's process is gone or restarting, or its engine died or is stuck: the call
    never ran there, or its answer was lost with the process. Another worker of the pool may
    take the request. What a worker's death raises, and the only thing the request path
    takes as one: any other error is a bug, answered INTERNAL (`router.flow`)."""


class WorkerDraining(WorkerUnavailable):
    """The worker refused a new request (`NotServing`: it drains, or serves the other role
    now). It is not down: the request goes to another worker, and what the worker holds
    keeps running, so no caller marks it silent for this."""


class _RayApi:
    """`api.m(*args)` awaits `actor.m.remote(*args)`; typed by the protocol it is cast to."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        remote = getattr(self._actor, method).remote

        async def call(*args: Any) -> Any:
            return await remote(*args)

        return call


def ray_api(actor: Any) -> Any:
    """A Ray actor handle seen as the worker API (cast it to `PrefillApi` / `DecodeApi`)."""
    return _RayApi(actor)


def _ray_lost() -> tuple[type[BaseException], ...]:
    # Ray is imported only where actors exist.
    from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError

    return (RayActorError, WorkerCrashedError, NodeDiedError, ObjectLostError)


class WorkerClient(Generic[A]):
    """Calls one worker. `lost`: the exceptions that mean its process is gone."""

    def __init__(
        self, name: str, role: Role, api: A, lost: tuple[type[BaseException], ...] = ()
    ) -> None:
        self.name = name
        self.role = role
        self._api = api
        self._lost = lost
        self.deadline_s = 60.0  # the Router sets router.worker_call_timeout_s
        self._silent: asyncio.Event | None = None  # set when the worker is found silent
        self.silent_why = "was found silent"  # `went_silent`'s reason, for the callers' errors
        self.gone: str | None = None  # `retire`'s reason: every call fails at once

    def went_silent(self, why: str = "was found silent") -> None:
        """The worker stopped answering (its stats timed out, or a call found it gone), or
        was retired while calls waited (`why` says which): every call waiting on it now
        fails with WorkerUnavailable, not when it wakes up."""
        self.silent_why = why
        if self._silent is not None:
            self._silent.set()
            self._silent = None

    def retire(self, why: str) -> None:
        """This client's worker left the pool (drained and stopped, or switched to the other
        role: `router.membership`): the calls waiting on it fail now, and every later call
        at once, never reaching a worker that no longer serves it."""
        self.gone = why
        self.went_silent(why)

    async def until_silent(self) -> None:
        """Returns once this worker is found silent (`went_silent`) or retired."""
        if self.gone is not None:
            return
        if self._silent is None:
            self._silent = asyncio.Event()
        await self._silent.wait()

    async def _call(self, call: Awaitable[T], deadline_s: float | None = None) -> T:
        """`call`'s answer, or WorkerUnavailable: the worker died, its engine failed, it was
        found silent meanwhile, or it did not answer within the deadline."""
        if self.gone is not None:
            if inspect.iscoroutine(call):
                call.close()  # never sent: no "never awaited" warning
            raise WorkerUnavailable(f"{self.name} {self.gone}")
        limit = self.deadline_s if deadline_s is None else deadline_s
        try:
            got = await first_of(call, self.until_silent(), limit)
        except self._lost as e:  # died, or unavailable while Ray restarts it
            raise WorkerUnavailable(f"{self.name}: {e}") from e
        except NotServing as e:  # Ray re-raises the worker's own error as a subclass
            raise WorkerDraining(f"{self.name}: {_first_line(e)}") from e
        except EngineFailed as e:  # Ray re-raises the worker's own error as a subclass
            raise WorkerUnavailable(f"{self.name}: {e}") from e
        if got is Lost.SIGNAL:
            raise WorkerUnavailable(f"{self.name} {self.silent_why}")
        if got is Lost.TIMEOUT:
            raise WorkerUnavailable(f"{self.name} did not answer in {limit:g} s")
        return got

    async def stats(self) -> WorkerStats:
        return await self._call(self._api.stats())

    async def take_index_update(self, with_held: bool) -> IndexUpdate:
        return await self._call(self._api.take_index_update(with_held))

    async def abort(self, request_id: str) -> bool:
        return await self._call(self._api.abort(request_id))

    async def drain(self, lease_s: float) -> None:
        await self._call(self._api.drain(lease_s))


class PrefillClient(WorkerClient[PrefillApi]):
    def __init__(
        self, name: str, api: PrefillApi, lost: tuple[type[BaseException], ...] = ()
    ) -> None:
        super().__init__(name, Role.PREFILL, api, lost)

    @classmethod
    def of_actor(cls, name: str, actor: Any) -> PrefillClient:
        return cls(name, cast(PrefillApi, ray_api(actor)), _ray_lost())

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self._call(self._api.prefill(task))


class DecodeClient(WorkerClient[DecodeApi]):
    def __init__(
        self,
        name: str,
        api: DecodeApi,
        lost: tuple[type[BaseException], ...] = (),
        role: Role = Role.DECODE,
    ) -> None:
        super().__init__(name, role, api, lost)

    @classmethod
    def of_actor(cls, name: str, actor: Any, role: Role = Role.DECODE) -> DecodeClient:
        return cls(name, cast(DecodeApi, ray_api(actor)), _ray_lost(), role)

    async def reserve(self, request: WorkerRequest) -> ReserveResult:
        return await self._call(self._api.reserve(request))

    async def start(self, start: DecodeStart) -> None:
        await self._call(self._api.start(start))

    async def submit(self, request: WorkerRequest, sink: TokenSink) -> None:
        await self._call(self._api.submit(request, sink))

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        await self._call(self._api.release_reservation(request_id, transfer_id))

    async def heartbeat(self, request_id: str) -> bool:
        return await self._call(self._api.heartbeat(request_id), HEARTBEAT_DEADLINE_S)


def _first_line(e: BaseException) -> str:
    """A worker's error as Ray re-raised it carries its traceback: the message alone."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


async def quietly(call: Callable[[], Awaitable[object]], what: str, worker: str) -> None:
    """Best-effort cleanup call: a failure is logged, never raised. `call` makes the
    awaitable only once this runs: a cleanup task cancelled before its first step (at loop
    shutdown) then leaves no coroutine that was never awaited."""
    try:
        await call()
    except WorkerUnavailable as e:
        log.warning("%s on %s failed: %s", what, worker, e)
    except Exception:
        # Boundary: a cleanup call must not raise into the request it cleans up after.
        log.exception("%s on %s failed", what, worker)
