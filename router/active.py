"""A request while the router drives it, and the hooks that observe it.

`ActiveRequest` is the router's only per-request state: which workers hold it, what was sent,
and when. `RequestObserver` is the hook set (`router.metrics.RouterMetrics` and
`router.stats_log.RequestLog` implement it; `Observers` fans the hooks out to several); it
lives here, not beside the metrics, so the router core needs nothing from `router.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

import grpc

from engine.request import FinishReason
from pool_api.messages import WorkerRequest

if TYPE_CHECKING:
    from router.clients import DecodeClient, PrefillClient
    from router.pools import WorkerLoad
    from router.token_sink import PushedStream


class RequestAborted(Exception):
    """`Abort(request_id)` came while the request waited for a worker: it ends with finish
    reason abort (the client asked for it), never as a failure."""


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
    # the whole KV transfer, first push until acknowledged (overlaps the prompt pass)
    transfer_total_ms: float | None = None


# Where a request's prompt pass ran, and why (router.flow.RequestFlow._local_worker; the
# `pdserve:request_prefill_placement` counter): on a prefill worker, or on its decode worker
# because the service is colocated, the prompt had few uncached tokens, the prefill pool was
# busy (overflow), or no prefill worker was up.
Placement = Literal["disaggregated", "colocated", "short_prompt", "overflow", "no_prefill_worker"]


@dataclass
class ActiveRequest:
    """One admitted request as the router tracks it. Each field has one writer:

        request, arrival_s                               set at admission (router.core)
        queued, num_sent, first_sent_s, last_sent_s,     router.core (its responses and
          finish_reason, aborted                           books; `abort`)
        prefill, decode, transfer_id, placement,         router.flow (each from the value
          pushed, cached_tokens, kv_transfer_bytes,        a stage returns: the Reservation,
          timings, failure, done                           the PrefillResult, the relay)

    Other modules (metrics, responses, the reserver) only read it."""

    request: WorkerRequest
    arrival_s: float  # time.perf_counter() at admission
    prefill: WorkerLoad[PrefillClient] | None = None
    decode: WorkerLoad[DecodeClient] | None = None
    transfer_id: str = ""
    aborted: bool = False
    done: bool = False
    num_sent: int = 0
    cached_tokens: int = 0  # prompt tokens the prefill side did not compute
    kv_transfer_bytes: int = 0  # KV payload its prefill worker pushed (disaggregated)
    timings: Timings = field(default_factory=Timings)
    first_sent_s: float | None = None
    last_sent_s: float | None = None
    queued: bool = True  # counted in Router.num_queued: admitted, no token sent yet
    # How it ended, for the books (each request is counted once): the reason its completion
    # carried (ABORT too when the client left without one), or the status it failed with.
    finish_reason: FinishReason | None = None
    failure: grpc.StatusCode | None = None
    pushed: PushedStream | None = None  # its token stream (opened before its worker starts)
    placement: Placement | None = None  # None: not placed yet
    # n > 1 or best_of > 1: the choices returned (`n`; the workers run `request.params.n`
    # sequences, which is best_of when given), and each sequence's finish reason once it
    # ended (router.flow, by index)
    n: int = 1
    asked_logprobs: bool = False  # the client asked for logprobs (best_of asks on its own)
    choices_ended: dict[int, FinishReason] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences its workers run (choices, or best_of's candidates)."""
        return self.request.params.n

    @property
    def all_ended(self) -> bool:
        return len(self.choices_ended) == self.num_seqs


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
        """The request ended with `reason`: its completion went out, or (ABORT) its client
        left first (disconnect, deadline, cancel). Called once per request."""

    def on_fail(self, act: ActiveRequest, code: grpc.StatusCode, now: float) -> None:
        """The request failed after admission with `code` (no completion went out)."""


_O = TypeVar("_O", bound=RequestObserver)


class Observers(RequestObserver):
    """Several observers, each seeing every hook, in order (`Router.metrics`)."""

    def __init__(self, *observers: RequestObserver) -> None:
        self.observers = list(observers)

    def add(self, observer: RequestObserver, first: bool = False) -> None:
        self.observers.insert(0 if first else len(self.observers), observer)

    def find(self, kind: type[_O]) -> _O | None:
        """The first observer of type `kind`, if any."""
        return next((o for o in self.observers if isinstance(o, kind)), None)

    def on_admit(self, act: ActiveRequest) -> None:
        for o in self.observers:
            o.on_admit(act)

    def on_reject(self, code: grpc.StatusCode) -> None:
        for o in self.observers:
            o.on_reject(code)

    def on_tokens(self, act: ActiveRequest, num_tokens: int, now: float) -> None:
        for o in self.observers:
            o.on_tokens(act, num_tokens, now)

    def on_complete(self, act: ActiveRequest, reason: FinishReason, now: float) -> None:
        for o in self.observers:
            o.on_complete(act, reason, now)

    def on_fail(self, act: ActiveRequest, code: grpc.StatusCode, now: float) -> None:
        for o in self.observers:
            o.on_fail(act, code, now)
