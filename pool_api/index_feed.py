"""Carries a worker's block events to the prefix index.

With Redis, the worker publishes straight to it (batched every `PUBLISH_INTERVAL_S`) and
re-asserts everything it holds every `refresh_interval_s`, which refreshes TTLs and refills an
emptied or restarted Redis. Without Redis, the index lives in the router, which pulls the
block events with `take`.

A feed constructed on a running event loop starts at once (a Ray async actor's `__init__`
runs on the actor's loop), so a worker that Ray restarts registers its new epoch, making its
old entries unusable, without anyone calling its `ready`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from engine.loop import EngineLoop
from pool_api.config import IndexConfig
from pool_api.messages import IndexUpdate
from pool_api.prefix_index import PrefixIndex, RedisPrefixIndex

log = logging.getLogger(__name__)
PUBLISH_INTERVAL_S = 0.05  # how often block events go to Redis (an internal, not a setting)


class IndexFeed:
    def __init__(self, worker: str, cfg: IndexConfig, model: str, loop: EngineLoop) -> None:
        self.worker = worker
        self.epoch = uuid.uuid4().hex[:12]  # new on every worker start
        self.cfg = cfg
        self.index: PrefixIndex | None = (
            RedisPrefixIndex(cfg.redis_url, model, cfg.ttl_s, cfg.timeout_s)
            if cfg.redis_url
            else None
        )
        blocks = loop.engine.blocks  # touched only on the engine thread, through `loop`
        self._take_events = lambda: loop.run(blocks.take_events)
        self._held = lambda: loop.run(blocks.registered_hashes)
        self._task: asyncio.Task[None] | None = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started by `start` from the worker's loop
        else:
            self.start()

    def start(self) -> None:
        """Idempotent. In-memory mode has nothing to run: the router pulls with `take`."""
        if self._task is None and self.index is not None:
            self._task = asyncio.get_running_loop().create_task(self._run(self.index))

    async def _run(self, index: PrefixIndex) -> None:
        await index.register(self.worker, self.epoch)
        next_refresh = time.monotonic() + self.cfg.refresh_interval_s
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            try:
                events = await self._take_events()
                await index.publish(self.worker, self.epoch, events)
                if time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + self.cfg.refresh_interval_s
                    await index.refresh(self.worker, self.epoch, await self._held())
            except Exception as e:
                log.warning("index feed of %s: %s", self.worker, e)

    async def take(self, with_held: bool = False) -> IndexUpdate:
        """In-memory mode: the block events since the last call (and, on request, every
        hash held now), drained straight from the block manager on the engine thread."""
        events = tuple(await self._take_events()) if self.index is None else ()
        held = tuple(await self._held()) if with_held else None
        return IndexUpdate(self.worker, self.epoch, events, held)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.index is not None:
            await self.index.close()
