"""The Ray actor of a pool worker, of either role: its methods only delegate.

One class serves both roles so that a worker can switch between them without a reload
(`flip`): the drained worker of one role hands its engine loop, weights, KV cache and index
feed (`WorkerBase.hand_over`) to a new worker of the other role, built around them in the
same process. A call for the other role's API is refused with `NotServing` (the router
takes it as an unavailable worker and places the request elsewhere), as is any new
request while the worker drains.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import ray

from decode_workers.worker import DecodeWorker
from pool_api.config import WorkerConfig
from pool_api.messages import (
    DecodeStart,
    NotServing,
    PrefillResult,
    PrefillTask,
    ReserveResult,
    Role,
    TokenSink,
    WorkerRequest,
)
from prefill_workers.worker import PrefillWorker
from worker_common import ActorBase, StartupSummary, WorkerBase

log = logging.getLogger(__name__)


def make_worker(cfg: WorkerConfig, previous: WorkerBase | None = None) -> WorkerBase:
    """The worker for `cfg.role` (colocated is a decode worker that prefills too)."""
    if cfg.role is Role.PREFILL:
        return PrefillWorker(cfg, previous=previous)
    return DecodeWorker(cfg, previous=previous)


async def switch_role(old: WorkerBase, cfg: WorkerConfig) -> tuple[WorkerBase, int]:
    """The worker of role `cfg.role` built around `old`'s engine loop, weights, KV cache and
    index feed, and how many requests still on `old` were ended (a drain whose bound ran
    out; none otherwise). `old` takes no request from here on."""
    await old.drain()
    ended = await old.hand_over()
    new = make_worker(cfg, previous=old)
    new.fatal_hook = old.fatal_hook
    await new.start_feed()
    return new, ended


class WorkerActor(ActorBase[WorkerBase]):
    def __init__(self, cfg: WorkerConfig) -> None:
        if cfg.transfer.host == "auto":  # advertise this node's address, wherever Ray put us
            host = ray.util.get_node_ip_address()
            cfg = replace(cfg, transfer=replace(cfg.transfer, host=host))
        self.cfg = cfg
        super().__init__(make_worker, cfg)

    def __repr__(self) -> str:
        """Ray prefixes the actor's log lines with this: its name and role now."""
        worker = getattr(self, "worker", None)
        if worker is None:
            return f"WorkerActor {self.cfg.name}"
        return f"{worker.name} {worker.role.value}"

    def _as(self, cls: type[WorkerBase], request_id: str) -> WorkerBase:
        if not isinstance(self.worker, cls):
            raise NotServing(
                f"{self.worker.name} is a {self.worker.role.value} worker now: {request_id} "
                "goes to another worker"
            )
        return self.worker

    def _prefill(self, request_id: str) -> PrefillWorker:
        w = self._as(PrefillWorker, request_id)
        assert isinstance(w, PrefillWorker)
        return w

    def _decode(self, request_id: str) -> DecodeWorker:
        w = self._as(DecodeWorker, request_id)
        assert isinstance(w, DecodeWorker)
        return w

    # ---- prefill -------------------------------------------------------------------------
    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self._prefill(task.request.request_id).prefill(task)

    # ---- decode --------------------------------------------------------------------------
    async def reserve(self, request: WorkerRequest) -> ReserveResult:
        return await self._decode(request.request_id).reserve(request)

    async def start(self, start: DecodeStart) -> None:
        await self._decode(start.request_id).start(start)

    async def submit(self, request: WorkerRequest, sink: TokenSink) -> None:
        await self._decode(request.request_id).submit(request, sink)

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        await self._decode(request_id).release_reservation(request_id, transfer_id)

    async def heartbeat(self, request_id: str) -> bool:
        w = self.worker
        return isinstance(w, DecodeWorker) and await w.heartbeat(request_id)

    # ---- membership ----------------------------------------------------------------------
    async def flip(self, to: str) -> StartupSummary:
        """Become a worker of role `to`, keeping the weights, the KV cache (its prefix blocks
        stay valid: the index feed and its epoch carry over) and the engine thread. The
        router drains this worker first; whatever is still here is ended (aborted, blocks
        freed). The summary's `load_s` is the whole switch."""
        role = Role(to)
        old = self.worker
        if role is old.role:
            return old.summary
        if Role.COLOCATED in (role, old.role):
            raise ValueError(f"{old.name}: a colocated worker does not change role")
        t0 = time.perf_counter()
        self.cfg = replace(self.cfg, role=role)
        self.worker, ended = await switch_role(old, self.cfg)
        summary = replace(self.worker.summary, load_s=time.perf_counter() - t0)
        log.warning(
            "%s: %s -> %s in %.3f s (%d requests still here were ended)",
            old.name,
            old.role.value,
            role.value,
            summary.load_s,
            ended,
        )
        return summary
