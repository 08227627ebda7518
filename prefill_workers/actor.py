"""Ray adapter over `PrefillWorker`: an async actor whose methods only delegate."""

from __future__ import annotations

import torch

from engine.engine import EngineConfig
from kv_transfer.config import TransferConfig
from kv_transfer.messages import PrefillResult, PrefillTask, WorkerStats
from prefill_workers.worker import PrefillWorker


class PrefillActor:
    def __init__(
        self, name: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig, num_threads: int
    ) -> None:
        torch.set_num_threads(num_threads)  # Ray starts actors with one thread
        self.worker = PrefillWorker(name, engine_cfg, transfer_cfg)

    async def ready(self) -> str:
        return self.worker.name

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self.worker.prefill(task)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await self.worker.stats()

    async def check_integrity(self) -> int:
        return await self.worker.check_integrity()

    async def shutdown(self) -> None:
        self.worker.shutdown()
