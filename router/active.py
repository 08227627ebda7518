"""A request while the router drives it, and the hooks that observe it.

`ActiveRequest` is the router's only per-request state: which workers hold it, what was sent,
and when. `RequestObserver` is the hook set (`router.metrics.RouterMetrics` implements it);
it lives here, not beside the metrics, so the router core needs nothing from `router.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from engine.request import FinishReason
from pool_api.messages import WorkerRequest

if TYPE_CHECKING:
    from router.clients import DecodeClient, PrefillClient
    from router.pools import WorkerLoad


class RequestFailed(Exception):
    """Ends a request with a gRPC status (HTTP maps it to a status code)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass
class Timings:
    """Where a request's time went before its first token, in milliseconds; None: that
    stage did not happen (no worker took it yet, or it was prefilled on its decode worker)."""

    queue_ms: float | None = None  # arrival until a worker took it
    prefill_ms: float | None = None  # the prompt pass on a prefill worker (all chunks)
    transfer_ms: float | None = None  # end of that pass until the decode side acknowledged


@dataclass
class ActiveRequest:
    request: WorkerRequest
    arrival_s: float  # time.perf_counter() at admission
    prefill: WorkerLoad[PrefillClient] | None = None
    decode: WorkerLoad[DecodeClient] | None = None
    transfer_id: str = ""
    aborted: bool = False
    done: bool = False
    num_sent: int = 0
    cached_tokens: int = 0  # prompt tokens the prefill side did not compute
    timings: Timings = field(default_factory=Timings)
    first_sent_s: float | None = None
    last_sent_s: float | None = None
    queued: bool = True  # counted in Router.num_queued: admitted, no token sent yet

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)


class RequestObserver:
    """The router's per-request hooks; this base does nothing (metrics off).

    `on_tokens` runs before the router updates `act.first_sent_s` / `act.last_sent_s`, so an
    observer sees the previous send time; `now` is `time.perf_counter()` like `act.arrival_s`.
    """

    def on_admit(self, act: ActiveRequest) -> None:
        pass

    def on_reject(self, code: grpc.StatusCode) -> None:
        pass

    def on_tokens(self, act: ActiveRequest, num_tokens: int, now: float) -> None:
        pass

    def on_complete(self, act: ActiveRequest, reason: FinishReason, now: float) -> None:
        pass
