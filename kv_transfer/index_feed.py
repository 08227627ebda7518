"""Carries a worker's block events to the prefix index.

With Redis, the worker publishes straight to it (batched every `publish_interval_s`) and
re-asserts everything it holds every `refresh_interval_s`, which refreshes TTLs and refills an
emptied or restarted Redis. Without Redis, the index lives in the router, which pulls the
buffered updates with `take`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from engine.block_manager import BlockEvent
from engine.loop import EngineLoop
from kv_transfer.config import IndexConfig
from kv_transfer.prefix_index import PrefixIndex, RedisPrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexUpdate:
    """A worker's block events since the last update (router-pulled, in-memory mode)."""

    worker: str
    epoch: str
    events: tuple[BlockEvent, ...]
    held: tuple[int, ...] | None = None  # everything held now, on periodic refreshes


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
        self._buffer: list[BlockEvent] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        if self.index is not None:
            await self.index.register(self.worker, self.epoch)
        since_refresh = 0.0
        while True:
            await asyncio.sleep(self.cfg.publish_interval_s)
            since_refresh += self.cfg.publish_interval_s
            try:
                events = await self._take_events()
                if self.index is None:
                    self._buffer.extend(events)
                    continue
                await self.index.publish(self.worker, self.epoch, events)
                if since_refresh >= self.cfg.refresh_interval_s:
                    since_refresh = 0.0
                    await self.index.refresh(self.worker, self.epoch, await self._held())
            except Exception as e:
                log.warning("index feed of %s: %s", self.worker, e)

    async def take(self, with_held: bool = False) -> IndexUpdate:
        events, self._buffer = tuple(self._buffer), []
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
