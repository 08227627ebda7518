"""The router's view of the worker pools: handles, load, and the routing policy.

The router never imports a worker module. It holds `WorkerHandle`s: a Ray actor handle
(`RayHandle`) in production, or a plain in-process worker (`LocalHandle`) in tests; both
expose the same async methods taking and returning `kv_transfer.messages` dataclasses.

Load is what the router itself has sent and not yet seen back (exact and instant), plus the
workers' own stats, refreshed in the background (KV headroom, preemptions).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.messages import WorkerStats

log = logging.getLogger(__name__)


class WorkerHandle:
    """Calls a worker's async methods by name."""

    def __init__(self, name: str, role: str) -> None:
        self.name = name
        self.role = role

    async def call(self, method: str, *args: Any) -> Any:
        raise NotImplementedError


class LocalHandle(WorkerHandle):
    def __init__(self, name: str, role: str, worker: Any) -> None:
        super().__init__(name, role)
        self.worker = worker

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.worker, method)(*args)


class RayHandle(WorkerHandle):
    def __init__(self, name: str, role: str, actor: Any) -> None:
        super().__init__(name, role)
        self.actor = actor

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.actor, method).remote(*args)


@dataclass
class WorkerLoad:
    handle: WorkerHandle
    stats: WorkerStats | None = None
    outstanding_tokens: int = 0  # prefill: prompt tokens sent, not yet returned
    pending_blocks: int = 0  # decode: blocks reserved by the router since the last stats
    active: set[str] = field(default_factory=set)
    healthy: bool = True

    @property
    def free_blocks(self) -> int:
        free = self.stats.num_free_blocks if self.stats else 0
        return free - self.pending_blocks


class Pool:
    def __init__(self, role: str, handles: Sequence[WorkerHandle]) -> None:
        self.role = role
        self.workers = [WorkerLoad(h) for h in handles]

    def __len__(self) -> int:
        return len(self.workers)

    def healthy(self) -> list[WorkerLoad]:
        return [w for w in self.workers if w.healthy]

    def pick_prefill(self, matches: dict[str, int], num_tokens: int, block_size: int) -> WorkerLoad:
        """Least prefill work: the prompt tokens it would compute (its cached prefix
        subtracted) plus the prompt tokens already sent to it and not yet returned."""
        candidates = self.healthy()
        if not candidates:
            raise LookupError(f"no healthy {self.role} worker")

        def cost(w: WorkerLoad) -> tuple[int, int]:
            todo = num_tokens - matches.get(w.handle.name, 0) * block_size
            return (todo + w.outstanding_tokens, len(w.active))

        return min(candidates, key=cost)

    def best_match(self, matches: dict[str, int]) -> WorkerLoad | None:
        """The healthy worker holding the longest prefix, if any holds one."""
        held = [w for w in self.healthy() if matches.get(w.handle.name, 0) > 0]
        return max(held, key=lambda w: (matches[w.handle.name], w.free_blocks), default=None)

    def decode_order(self) -> list[WorkerLoad]:
        """Decode workers by KV headroom (free minus pending reservations), then batch size."""
        return sorted(self.healthy(), key=lambda w: (-w.free_blocks, len(w.active)))

    async def refresh(self) -> None:
        async def one(w: WorkerLoad) -> None:
            try:
                w.stats = await w.handle.call("stats")
                w.pending_blocks = 0
                w.healthy = True
            except Exception as e:
                if w.healthy:
                    log.warning("%s worker %s unreachable: %s", self.role, w.handle.name, e)
                w.healthy = False

        await asyncio.gather(*(one(w) for w in self.workers))
