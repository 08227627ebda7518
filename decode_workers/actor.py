"""Ray adapter over `DecodeWorker`: an async actor whose methods only delegate."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import ray
import torch

from decode_workers.worker import DecodeWorker
from kv_transfer.config import WorkerConfig
from kv_transfer.index_feed import IndexUpdate
from kv_transfer.messages import DecodeStart, ReserveResult, TokenBatch, WorkerRequest, WorkerStats


def exit_soon(error: BaseException) -> None:
    """A dead engine must not keep a live actor: exit so Ray restarts it (`max_restarts`).

    The short delay lets the error replies already queued reach their callers.
    """
    threading.Timer(0.5, os._exit, args=(1,)).start()


class DecodeActor:
    def __init__(self, cfg: WorkerConfig) -> None:
        torch.set_num_threads(cfg.num_threads)  # Ray starts actors with one thread
        if cfg.transfer.host == "auto":  # advertise this node's address, wherever Ray put us
            host = ray.util.get_node_ip_address()
            cfg = replace(cfg, transfer=replace(cfg.transfer, host=host))
        self.worker = DecodeWorker(cfg)
        self.worker.fatal_hook = exit_soon

    async def ready(self) -> str:
        await self.worker.start_feed()
        return self.worker.name

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        return await self.worker.take_index_update(with_held)

    async def reserve(self, request: WorkerRequest) -> ReserveResult:
        return await self.worker.reserve(request)

    async def start(self, start: DecodeStart) -> None:
        await self.worker.start(start)

    async def submit(self, request: WorkerRequest) -> None:
        await self.worker.submit(request)

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        await self.worker.release_reservation(request_id, transfer_id)

    async def poll(self, request_id: str, timeout_s: float) -> TokenBatch:
        return await self.worker.poll(request_id, timeout_s)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await self.worker.stats()

    async def check_integrity(self) -> int:
        return await self.worker.check_integrity()

    async def shutdown(self) -> None:
        self.worker.shutdown()
