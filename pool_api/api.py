"""The worker API the router calls: one typed method per actor method.

`PrefillWorker`/`PrefillActor` and `DecodeWorker`/`DecodeActor` implement these structurally
(tests/test_layering.py checks it with mypy's eyes: assignments typed as these protocols).
The router reaches them only through `router.clients`, whose methods name each call once.
"""

from __future__ import annotations

from typing import Protocol

from pool_api.messages import (
    DecodeStart,
    IndexUpdate,
    PrefillResult,
    PrefillTask,
    ReserveResult,
    TokenBatch,
    TokenSink,
    WorkerRequest,
    WorkerStats,
)


class WorkerApi(Protocol):
    async def stats(self) -> WorkerStats:
        """Load and KV headroom, read on the engine thread."""
        ...

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        """Block events since the last call (the router's in-memory index pulls these)."""
        ...

    async def abort(self, request_id: str) -> bool:
        """End the request wherever it is on this worker and free its blocks."""
        ...


class PrefillApi(WorkerApi, Protocol):
    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """The prompt pass; its KV pushed into the ticket's blocks; the first token back."""
        ...


class DecodeApi(WorkerApi, Protocol):
    async def reserve(self, request: WorkerRequest) -> ReserveResult:
        """Blocks for the prompt (+1), or no ticket when there is no room now."""
        ...

    async def start(self, start: DecodeStart) -> None:
        """Wait for the reserved request's KV to land, then decode it."""
        ...

    async def submit(self, request: WorkerRequest, sink: TokenSink | None = None) -> None:
        """Prefill here and decode (colocated, or a prompt under the local threshold); its
        tokens go to `sink` (pushed), or wait for `poll` when None."""
        ...

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        """The request ended before decoding: let its reserved blocks go."""
        ...

    async def poll(self, request_id: str, timeout_s: float) -> TokenBatch:
        """Tokens since the last poll; waits up to `timeout_s` for at least one. A pushed
        request's tokens never come this way: its poll answers at once, empty, while the
        request lives (the router's heartbeat)."""
        ...
