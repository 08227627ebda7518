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

    async def drain(self, lease_s: float) -> None:
        """Take no new request from any router (`NotServing`) for `lease_s`, renewed while
        the drain lasts; what is here runs on."""
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

    async def submit(self, request: WorkerRequest, sink: TokenSink) -> None:
        """Prefill here and decode (colocated, or a prompt under the local threshold); its
        tokens go to `sink`."""
        ...

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        """The request ended before decoding: let its reserved blocks go."""
        ...

    async def heartbeat(self, request_id: str) -> bool:
        """The router's liveness check of a request's token stream, answered at once: True
        while the worker holds it; False once it ended or was never there."""
        ...
