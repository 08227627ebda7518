"""Reserving KV room on a decode worker, and the line requests wait in while none has room.

A disaggregated request first reserves its prompt's blocks on the decode worker of the
cheapest (prefill, decode) pair (`router.pools.rank_pairs`); the ticket it gets names those
blocks for the prefill worker to push into. While no decode worker has room, requests wait
in a first-come-first-served `WaitingLine`, bounded by `queue_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from pool_api.messages import ReserveResult
from protos.pdserve.v1 import kv_transfer_pb2 as kvpb
from router.active import ActiveRequest, RequestAborted, RequestFailed
from router.clients import DecodeClient, PrefillClient, WorkerDraining, WorkerUnavailable, quietly
from router.config import PolicySettings
from router.pools import PairCost, Pool, WorkerLoad, rank_pairs

log = logging.getLogger(__name__)

_RESERVE_BACKOFF_S = 0.005  # first retry of a reservation; doubles up to the max
_RESERVE_BACKOFF_MAX_S = 0.05
_LINE_CHECK_S = 0.05  # how often a request waiting in line checks for abort and deadline

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class WaitingLine:
    """First come, first served among requests waiting for KV room. Only the request at the
    head retries its reservation, so a full decode pool sees one retry at a time (with
    backoff) rather than one per waiting request every few milliseconds."""

    def __init__(self) -> None:
        self._line: deque[asyncio.Event] = deque()

    def __len__(self) -> int:
        return len(self._line)

    @contextlib.asynccontextmanager
    async def first(self, give_up: Callable[[], None]) -> AsyncIterator[None]:
        """Wait to be first in line. `give_up` runs every `_LINE_CHECK_S` meanwhile and
        leaves the line by raising (abort, deadline)."""
        turn = asyncio.Event()
        self._line.append(turn)
        if self._line[0] is turn:
            turn.set()
        try:
            while not turn.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(turn.wait(), _LINE_CHECK_S)
                give_up()
            yield
        finally:
            was_first = self._line[0] is turn
            self._line.remove(turn)
            if was_first and self._line:
                self._line[0].set()


@dataclass(frozen=True)
class Reservation:
    decode: WorkerLoad[DecodeClient]  # holds the blocks
    prefill: WorkerLoad[PrefillClient]  # the other half of the pair that ranked cheapest
    ticket: bytes  # serialized pdserve.v1.TransferTicket
    transfer_id: str  # the ticket's
    queue_ms: float  # from the request's arrival until the blocks were reserved


class Reserver:
    """Reserves for one request at a time; shared by all requests of a router."""

    def __init__(
        self,
        policy: PolicySettings,
        prefill: Pool[PrefillClient],
        decode: Pool[DecodeClient],
        block_size: int,
        spawn: Spawn,
    ) -> None:
        self.policy = policy
        self.prefill = prefill
        self.decode = decode
        self.block_size = block_size
        self._spawn = spawn  # runs cleanup that must outlive a cancelled request
        self.line = WaitingLine()

    async def reserve(self, act: ActiveRequest, matches: dict[str, int]) -> Reservation:
        """Reserve on the decode worker of the cheapest pair; while none has room, wait in
        line (bounded by `queue_timeout_s`). An abort meanwhile raises RequestAborted."""
        got = await self._reserve_once(act, matches)
        if got is not None:
            return got
        deadline = time.monotonic() + self.policy.queue_timeout_s

        def give_up() -> None:
            if act.aborted:
                raise RequestAborted()
            if time.monotonic() > deadline:
                raise RequestFailed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no decode worker had KV room for {self.policy.queue_timeout_s:.0f} s",
                )

        async with self.line.first(give_up):
            backoff = _RESERVE_BACKOFF_S
            while True:
                give_up()
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _RESERVE_BACKOFF_MAX_S)
                got = await self._reserve_once(act, matches)
                if got is not None:
                    return got

    def pair_order(self, act: ActiveRequest, matches: dict[str, int]) -> list[PairCost]:
        """The cheapest (prefill, decode) pair for each decode worker, cheapest first.

        A pair's cost is the prefill worker's part plus the decode worker's, and its ties
        break on the prefill worker's active requests and last use after the decode
        worker's own terms, so every decode worker's cheapest partner is the same prefill
        worker: the one `Pool.pick_prefill` picks. Ranking that one against each decode
        worker is O(P + D log D) per request, where ranking all P x D pairs took 8 ms at
        100 + 100 workers (docs/benchmarks.md, "The control plane at 200 workers")."""
        prefill = self.prefill.routable()
        n = act.num_prompt_tokens
        partner = [self.prefill.pick_prefill(matches, n, self.block_size)] if prefill else []
        pairs = rank_pairs(
            partner,
            self.decode.routable(),
            matches,
            act.num_prompt_tokens,
            self.block_size,
            self.policy.prefill_tokens_per_s,
            self.policy.transfer_gbps * 1e9,
        )
        best: dict[str, PairCost] = {}
        for pair in pairs:
            best.setdefault(pair.decode.name, pair)
        return list(best.values())

    async def _reserve_once(
        self, act: ActiveRequest, matches: dict[str, int]
    ) -> Reservation | None:
        """One reservation attempt per pair, cheapest first; None when none had room."""
        order = self.pair_order(act, matches)
        if not order:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, "no healthy prefill and decode worker pair"
            )
        for pair in order:
            decode_worker = pair.decode
            try:
                reply = await self._reserve_on(decode_worker, act)
            except WorkerDraining as e:  # well, but taking no new request: the next pair
                decode_worker.draining = True
                log.info("reserve on %s refused: %s", decode_worker.name, e)
                continue
            except WorkerUnavailable as e:  # dead or restarting: try the next pair
                decode_worker.mark_silent("its reservation failed")
                log.warning("reserve on %s failed: %s", decode_worker.name, e)
                continue
            if reply.ticket is None:
                continue
            ticket = kvpb.TransferTicket.FromString(reply.ticket)
            decode_worker.reserved(act.request_id, len(ticket.dst_block_ids) + 1)
            if act.aborted:  # Abort came during the call and saw no reservation
                decode_worker.untrack(act.request_id)
                await quietly(
                    partial(decode_worker.client.abort, act.request_id), "abort", decode_worker.name
                )
                raise RequestAborted()
            queue_ms = (time.perf_counter() - act.arrival_s) * 1e3
            return Reservation(
                decode_worker, pair.prefill, reply.ticket, ticket.transfer_id, queue_ms
            )
        if act.aborted:
            raise RequestAborted()
        return None

    async def _reserve_on(
        self, decode_worker: WorkerLoad[DecodeClient], act: ActiveRequest
    ) -> ReserveResult:
        """One reservation attempt. If the request is cancelled while the call is in flight
        (client gone, deadline), the call still completes on the worker: whatever it reserved
        is released once it answers, instead of waiting out the lease."""
        rid = act.request_id
        call: asyncio.Future[ReserveResult] = asyncio.ensure_future(
            decode_worker.client.reserve(act.request)
        )
        decode_worker.reserving(call, -(-act.num_prompt_tokens // self.block_size) + 1)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:

            def release_late(f: asyncio.Future[ReserveResult]) -> None:
                if not f.cancelled() and f.exception() is None and f.result().ticket is not None:
                    abort = partial(decode_worker.client.abort, rid)
                    self._spawn(quietly(abort, "abort", decode_worker.name))

            call.add_done_callback(release_late)
            raise
