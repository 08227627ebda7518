"""Ray adapter over `PrefillWorker`: an async actor whose methods only delegate."""

from __future__ import annotations

import os
import threading

import torch

from kv_transfer.config import WorkerConfig
from kv_transfer.index_feed import IndexUpdate
from kv_transfer.messages import PrefillResult, PrefillTask, WorkerStats
from prefill_workers.worker import PrefillWorker


def exit_soon(error: BaseException) -> None:
    """A dead engine must not keep a live actor: exit so Ray restarts it (`max_restarts`).

    The short delay lets the error replies already queued reach their callers.
    """
    threading.Timer(0.5, os._exit, args=(1,)).start()


class PrefillActor:
    def __init__(self, cfg: WorkerConfig) -> None:
        torch.set_num_threads(cfg.num_threads)  # Ray starts actors with one thread
        self.worker = PrefillWorker(cfg)
        self.worker.fatal_hook = exit_soon

    async def ready(self) -> str:
        await self.worker.start_feed()
        return self.worker.name

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        return await self.worker.take_index_update(with_held)

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self.worker.prefill(task)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await self.worker.stats()

    async def check_integrity(self) -> int:
        return await self.worker.check_integrity()

    async def inject_transfer_stall(self, stall_s: float, num_transfers: int = 1) -> None:
        await self.worker.inject_transfer_stall(stall_s, num_transfers)

    async def shutdown(self) -> None:
        self.worker.shutdown()
