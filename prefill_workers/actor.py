"""Ray adapter over `PrefillWorker`: an async actor whose methods only delegate."""

from __future__ import annotations

from pool_api.config import WorkerConfig
from pool_api.messages import PrefillResult, PrefillTask
from prefill_workers.worker import PrefillWorker
from worker_common import ActorBase


class PrefillActor(ActorBase[PrefillWorker]):
    def __init__(self, cfg: WorkerConfig) -> None:
        super().__init__(PrefillWorker, cfg)

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self.worker.prefill(task)
