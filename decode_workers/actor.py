"""Ray adapter over `DecodeWorker`: an async actor whose methods only delegate."""

from __future__ import annotations

from dataclasses import replace

import ray

from decode_workers.worker import DecodeWorker
from pool_api.config import WorkerConfig
from pool_api.messages import DecodeStart, ReserveResult, TokenSink, WorkerRequest
from worker_common import ActorBase


class DecodeActor(ActorBase[DecodeWorker]):
    def __init__(self, cfg: WorkerConfig) -> None:
        if cfg.transfer.host == "auto":  # advertise this node's address, wherever Ray put us
            host = ray.util.get_node_ip_address()
            cfg = replace(cfg, transfer=replace(cfg.transfer, host=host))
        super().__init__(DecodeWorker, cfg)

    async def reserve(self, request: WorkerRequest) -> ReserveResult:
        return await self.worker.reserve(request)

    async def start(self, start: DecodeStart) -> None:
        await self.worker.start(start)

    async def submit(self, request: WorkerRequest, sink: TokenSink) -> None:
        await self.worker.submit(request, sink)

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        await self.worker.release_reservation(request_id, transfer_id)

    async def heartbeat(self, request_id: str) -> bool:
        return await self.worker.heartbeat(request_id)
