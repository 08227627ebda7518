"""Keeping the router's in-memory prefix index in step with the workers' block events.

With Redis, workers publish to it themselves and this does nothing. In memory, the index
lives in the router, which pulls each worker's events on every stats refresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from pool_api.prefix_index import MemoryPrefixIndex, PrefixIndex
from router.pools import WorkerLoad

log = logging.getLogger(__name__)

_HELD_EVERY_N_REFRESHES = 50  # in-memory index: re-assert held blocks every ~10 s


class IndexSync:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._num_pulls = 0
        # One pull at a time: two overlapping pulls (the refresh loop and GetServerInfo)
        # could apply a worker's events out of order.
        self._lock = asyncio.Lock()

    async def pull(self, workers: Sequence[WorkerLoad[Any]]) -> None:
        """Apply every healthy worker's block events (in-memory index only)."""
        if not isinstance(self.index, MemoryPrefixIndex):
            return
        async with self._lock:
            self._num_pulls += 1
            with_held = self._num_pulls % _HELD_EVERY_N_REFRESHES == 0
            await asyncio.gather(*(self._pull_one(w, with_held) for w in workers if w.healthy))

    async def _pull_one(self, w: WorkerLoad[Any], with_held: bool) -> None:
        try:
            upd = await w.client.take_index_update(with_held)
        except Exception as e:
            self.index.errors += 1
            log.debug("index pull from %s failed: %s", w.name, e)
            return
        await self.index.register(upd.worker, upd.epoch)
        await self.index.publish(upd.worker, upd.epoch, upd.events)
        if upd.held is not None:
            await self.index.refresh(upd.worker, upd.epoch, upd.held)
