"""Keeping the router's in-memory prefix index in step with the workers' block events.

With Redis, workers publish to it themselves and this does nothing. In memory, the index
lives in the router, which pulls each worker's events on every stats refresh.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any

from pool_api.prefix_index import MemoryPrefixIndex, PrefixIndex
from router.clients import WorkerUnavailable
from router.pools import WorkerLoad

log = logging.getLogger(__name__)

_HELD_EVERY_N_REFRESHES = 50  # in-memory index: re-assert held blocks every ~10 s


# How long a pull waits for workers' events before leaving the slow ones to finish later.
_PULL_WAIT_S = 0.25


class IndexSync:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._num_pulls = 0
        self._with_held = False
        # At most one pull per worker in flight, so its events apply in order (the refresh
        # loop and GetServerInfo both pull).
        self._inflight: dict[str, asyncio.Task[None]] = {}

    async def pull(self, workers: Sequence[WorkerLoad[Any]]) -> None:
        """Apply every healthy worker's block events (in-memory index only).

        A worker answers from its engine thread, so one on a long step (a prompt pass of
        seconds) answers late: its pull finishes in the background, is not asked again
        until then, and holds up neither this call past `_PULL_WAIT_S` nor the stats
        refresh that calls it (which must keep seeing the other workers' load)."""
        self.begin()
        started = [t for w in workers if (t := self.pull_from(w)) is not None]
        if started:
            await asyncio.wait(started, timeout=_PULL_WAIT_S)

    def begin(self) -> None:
        """A new round of pulls (every `_HELD_EVERY_N_REFRESHES`th also re-asserts the
        blocks each worker holds)."""
        self._num_pulls += 1
        self._with_held = self._num_pulls % _HELD_EVERY_N_REFRESHES == 0

    def pull_from(self, w: WorkerLoad[Any]) -> asyncio.Task[None] | None:
        """Start pulling `w`'s events in the background, unless it is down, the index is
        not in memory, or its last pull still runs (its events apply in order)."""
        if not isinstance(self.index, MemoryPrefixIndex):
            return None
        if not w.healthy or w.name in self._inflight:
            return None
        task = asyncio.create_task(self._pull_one(w, self._with_held))
        self._inflight[w.name] = task
        task.add_done_callback(functools.partial(self._pulled, w.name))
        return task

    def _pulled(self, name: str, _: asyncio.Task[None]) -> None:
        self._inflight.pop(name, None)

    def cancel(self) -> None:
        """Stop pulls still in flight (the router is stopping)."""
        for task in list(self._inflight.values()):
            task.cancel()

    async def _pull_one(self, w: WorkerLoad[Any], with_held: bool) -> None:
        try:
            upd = await w.client.take_index_update(with_held)
        except (WorkerUnavailable, asyncio.TimeoutError) as e:
            self.index.errors += 1
            log.debug("index pull from %s failed: %s", w.name, e)
            return
        except Exception:
            # Boundary of one background pull: a bug must not stop the sync loop.
            self.index.errors += 1
            log.exception("index pull from %s failed", w.name)
            return
        await self.index.register(upd.worker, upd.epoch)
        await self.index.publish(upd.worker, upd.epoch, upd.events)
        if upd.held is not None:
            await self.index.refresh(upd.worker, upd.epoch, upd.held)
