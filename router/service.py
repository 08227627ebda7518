"""The router: `pdserve.v1.Generation` over grpc.aio, in front of the two pools.

One request (docs/lifecycle.md): validate and tokenize here; reserve KV blocks on a decode
worker (waiting in a bounded queue while no decode worker has room); run the prompt pass on a
prefill worker, which pushes the KV straight into the reserved blocks; send the first token
to the client at once; start the decode worker on it and relay its tokens until a stop.
Any exit path (finish, Abort, client cancel, deadline, worker death) releases the request's
blocks on both pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.block_manager import extend_block_hashes, namespace_seed
from engine.sampling import InvalidParameterError, TokenLogprob
from engine.tokenizer import Tokenizer
from kv_transfer.index_feed import IndexUpdate
from kv_transfer.messages import (
    DecodeStart,
    PrefillResult,
    PrefillTask,
    ReserveResult,
    TokenBatch,
    WorkerRequest,
)
from kv_transfer.prefix_index import MemoryPrefixIndex, PrefixIndex
from kv_transfer.wire import TransferError
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc
from protos.pdserve.v1 import kv_transfer_pb2 as kvpb
from router.auth import api_key_interceptors
from router.config import RouterConfig
from router.metrics import RequestObserver
from router.pools import PairCost, Pool, WorkerLoad, WorkerUnavailable, rank_pairs
from router.tls import add_port
from router.validation import ModelLimits, prepare

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"
_RESERVE_BACKOFF_S = 0.005  # first retry of a reservation; doubles up to the max
_RESERVE_BACKOFF_MAX_S = 0.05
_LINE_CHECK_S = 0.05  # how often a request waiting in line checks for abort and deadline
# A prefill result may come this long after its ticket's lease ran out (clocks of two nodes,
# the decode side's reaper period) before the router stops waiting for it.
_LEASE_GRACE_S = 2.0
_HELD_EVERY_N_REFRESHES = 50  # in-memory index: re-assert held blocks every ~10 s
_FINISH = {
    "stop": gen.FINISH_REASON_STOP,
    "length": gen.FINISH_REASON_LENGTH,
    "abort": gen.FINISH_REASON_ABORT,
}


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


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass
class ActiveRequest:
    request: WorkerRequest
    arrival_s: float
    prefill: WorkerLoad | None = None
    decode: WorkerLoad | None = None
    transfer_id: str = ""
    aborted: bool = False
    done: bool = False
    num_sent: int = 0
    cached_tokens: int = 0  # prompt tokens the prefill side did not compute
    timings: dict[str, float] = field(default_factory=dict)
    first_sent_s: float | None = None
    last_sent_s: float | None = None
    queued: bool = True  # counted in Router.num_queued: admitted, no token sent yet


class Router:
    def __init__(
        self,
        cfg: RouterConfig,
        limits: ModelLimits,
        tokenizer: Tokenizer | None,
        model_info: gen.ModelInfo,
        prefill: Pool,
        decode: Pool,
        transport: str,
        index: PrefixIndex | None = None,
        colocated: bool = False,
    ) -> None:
        self.cfg = cfg
        self.limits = limits
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.prefill = prefill
        self.decode = decode
        self.transport = transport
        self.colocated = colocated
        self.index = index or MemoryPrefixIndex()
        self._num_refreshes = 0
        # One pull at a time: two overlapping pulls (the refresh loop and GetServerInfo)
        # could apply a worker's events out of order.
        self._pull_lock = asyncio.Lock()
        self.active: dict[str, ActiveRequest] = {}
        self.num_queued = 0  # admitted, no token sent yet (bounded by max_queue_len)
        self._kv_line = WaitingLine()
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self.metrics = RequestObserver()  # per-request hooks; RouterMetrics.install sets one
        # Health follows `serviceable()`: the gRPC server sets this (pdserve/serve.py).
        self.on_serving_change: Callable[[bool], Awaitable[None]] | None = None
        self._serving = False
        self._last_refresh_s = 0.0

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_loop())

    async def refresh(self) -> None:
        interval = self.cfg.stats_interval_s
        timeout = max(2.0, 10 * interval)
        await asyncio.gather(
            self.prefill.refresh(interval, timeout), self.decode.refresh(interval, timeout)
        )
        self._last_refresh_s = time.monotonic()
        serving = self.serviceable()
        if serving != self._serving and self.on_serving_change is not None:
            log.warning("router %s", "serving again" if serving else "cannot serve: a pool is down")
            await self.on_serving_change(serving)
        self._serving = serving
        if isinstance(self.index, MemoryPrefixIndex):
            async with self._pull_lock:
                self._num_refreshes += 1
                with_held = self._num_refreshes % _HELD_EVERY_N_REFRESHES == 0
                await asyncio.gather(
                    *(
                        self._pull_index(w, with_held)
                        for w in self.prefill.workers + self.decode.workers
                    )
                )

    async def _pull_index(self, w: WorkerLoad, with_held: bool) -> None:
        """In-memory mode: the router applies each worker's block events itself."""
        if not w.healthy:
            return
        try:
            upd: IndexUpdate = await w.handle.call("take_index_update", with_held)
        except Exception as e:
            self.index.errors += 1
            log.debug("index pull from %s failed: %s", w.handle.name, e)
            return
        await self.index.register(upd.worker, upd.epoch)
        await self.index.publish(upd.worker, upd.epoch, upd.events)
        if upd.held is not None:
            await self.index.refresh(upd.worker, upd.epoch, upd.held)

    def block_hashes(self, r: WorkerRequest) -> list[int]:
        """The prompt's chained block hashes that a prefix hit could reuse."""
        bs = self.model_info.block_size
        seed = namespace_seed(self.model_info.model_fingerprint, r.cache_salt)
        ids = r.prompt_token_ids
        return extend_block_hashes([], ids[: (len(ids) - 1) // bs * bs], bs, seed)

    def serviceable(self) -> bool:
        """Requests can succeed: not draining, a decode worker is up, and a prefill worker
        too unless decode workers run both phases."""
        if self.draining or not self.decode.serviceable():
            return False
        return self.colocated or not self.prefill.workers or self.prefill.serviceable()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.stats_interval_s)
            await self.refresh()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; wait up to `grace_s` for in-flight ones to finish."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._refresher:
            self._refresher.cancel()
        await self.index.close()

    # ---- one request ---------------------------------------------------------------------
    def admit(self, request: gen.GenerateRequest) -> ActiveRequest:
        """Validate at the edge; raises RequestFailed with the proper status."""
        try:
            act = self._admit(request)
        except RequestFailed as e:
            self.metrics.on_reject(e.code)
            raise
        self.metrics.on_admit(act)
        return act

    def _admit(self, request: gen.GenerateRequest) -> ActiveRequest:
        if self.draining:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "server is draining")
        try:
            wr = prepare(request, self.tokenizer, self.limits)
        except InvalidParameterError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        except LookupError as e:
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, str(e)) from e
        if wr.request_id in self.active:
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: {wr.request_id!r} is already in flight",
            )
        if self.num_queued >= self.cfg.max_queue_len:
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"queue full ({self.cfg.max_queue_len} requests waiting)",
            )
        act = ActiveRequest(wr, time.perf_counter())
        self.active[wr.request_id] = act
        self.num_queued += 1
        return act

    def _dequeue(self, act: ActiveRequest) -> None:
        """The request left the queue (its first token went out, or it ended)."""
        if act.queued:
            act.queued = False
            self.num_queued -= 1

    async def run(self, act: ActiveRequest) -> AsyncIterator[gen.GenerateResponse]:
        """Drive one admitted request; yields its responses."""
        try:
            matches = await self.index.lookup(self.block_hashes(act.request))
            n = len(act.request.prompt_token_ids)
            bs = self.model_info.block_size
            best = self.decode.best_match(matches)
            uncached_there = n - (matches.get(best.handle.name, 0) * bs if best else 0)
            local = self.colocated or uncached_there <= self.cfg.local_prefill_threshold
            if not local and not self.prefill.healthy():  # the whole prefill pool is down
                if self.cfg.prefill_failure_policy == "fail":
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
                local = True  # recompute: prefill on the decode worker
            stream = (
                self._run_local(act, matches) if local else self._run_disaggregated(act, matches)
            )
            async for resp in stream:
                yield resp
        except (RequestFailed, asyncio.CancelledError, GeneratorExit):
            raise
        except InvalidParameterError as e:  # a worker refused it (e.g. its id still runs there)
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"{e.field}: {e.message}") from e
        except TransferError as e:
            if act.aborted:
                yield self._complete(act, "abort")
                return
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}") from e
        except Exception as e:
            if act.aborted:
                yield self._complete(act, "abort")
                return
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, f"worker failure: {type(e).__name__}: {e}"
            ) from e
        finally:
            act.done = True

    async def _run_local(
        self, act: ActiveRequest, matches: dict[str, int]
    ) -> AsyncIterator[gen.GenerateResponse]:
        d = self.decode.best_match(matches) or self._pick_decode()
        act.decode = d
        d.active.add(act.request.request_id)
        await d.handle.call("submit", act.request)
        act.timings["queue_ms"] = (time.perf_counter() - act.arrival_s) * 1e3
        async for resp in self._relay(act, d):
            yield resp

    async def _run_disaggregated(
        self, act: ActiveRequest, matches: dict[str, int]
    ) -> AsyncIterator[gen.GenerateResponse]:
        r = act.request
        d, planned, ticket = await self._reserve(act, matches)
        p = (
            planned
            if planned.healthy
            else self.prefill.pick_prefill(
                matches, len(r.prompt_token_ids), self.model_info.block_size
            )
        )
        act.prefill = p
        n = len(r.prompt_token_ids)
        p.outstanding_tokens += n
        p.active.add(r.request_id)
        try:
            res = await self._prefill(p, act, ticket)
        except TransferError:
            raise
        except Exception as e:  # the prefill worker died (or its actor is gone)
            async for resp in self._prefill_failed(act, p, d, matches, e):
                yield resp
            return
        finally:
            p.outstanding_tokens -= n
            p.active.discard(r.request_id)
        act.cached_tokens = res.num_cached_tokens
        act.timings.update(
            queue_ms=(act.timings.get("queue_ms", 0.0) + res.queue_ms),
            prefill_ms=res.prefill_ms,
            transfer_ms=res.transfer_ms,
        )
        if res.error:
            await self._quietly(d, "release_reservation", r.request_id, act.transfer_id)
            if act.aborted:
                yield self._complete(act, "abort")
                return
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {res.error}")
        yield self._chunk(
            act, (res.first_token_id,), res.text, (res.logprob,) if res.logprob else ()
        )
        if res.finished:
            await self._quietly(d, "release_reservation", r.request_id, act.transfer_id)
            yield self._complete(act, res.finish_reason or "stop")
            return
        await d.handle.call("start", DecodeStart(r.request_id, act.transfer_id, res.first_token_id))
        async for resp in self._relay(act, d):
            yield resp

    async def _prefill(self, p: WorkerLoad, act: ActiveRequest, ticket: bytes) -> PrefillResult:
        """The prompt pass and its transfer, waited for no longer than the ticket's lease:
        past it the decode side has let the blocks go, so whatever the prefill worker still
        does (a stalled transfer) cannot land. The caller's cleanup aborts it there."""
        lease = kvpb.TransferTicket.FromString(ticket).deadline_unix_ms / 1e3 - time.time()
        try:
            res: PrefillResult = await asyncio.wait_for(
                p.handle.call("prefill", PrefillTask(act.request, ticket)),
                max(lease, 0.0) + _LEASE_GRACE_S,
            )
        except asyncio.TimeoutError as e:
            raise TransferError(
                f"{p.handle.name} did not finish the transfer within its lease"
            ) from e
        return res

    async def _prefill_failed(
        self,
        act: ActiveRequest,
        p: WorkerLoad,
        d: WorkerLoad,
        matches: dict[str, int],
        error: Exception,
    ) -> AsyncIterator[gen.GenerateResponse]:
        """A prefill worker died under this request: release its reservation, then fail it
        (policy `fail`) or prefill it again, elsewhere or on the decode worker (`recompute`)."""
        r = act.request
        p.mark_down("its prefill failed")
        log.warning("prefill worker %s failed on %s: %s", p.handle.name, r.request_id, error)
        await self._quietly(d, "release_reservation", r.request_id, act.transfer_id)
        d.active.discard(r.request_id)
        act.prefill = act.decode = None
        if act.aborted:
            yield self._complete(act, "abort")
            return
        if self.cfg.prefill_failure_policy == "fail":
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, f"prefill worker {p.handle.name} died: {error}"
            )
        again = (
            self._run_disaggregated(act, matches)
            if self.prefill.healthy()
            else self._run_local(act, {})
        )
        async for resp in again:
            yield resp

    def _pair_order(self, act: ActiveRequest, matches: dict[str, int]) -> list[PairCost]:
        """The cheapest (prefill, decode) pair for each decode worker, cheapest first."""
        pairs = rank_pairs(
            self.prefill.healthy(),
            self.decode.healthy(),
            matches,
            len(act.request.prompt_token_ids),
            self.model_info.block_size,
            self.cfg.prefill_tokens_per_s,
            self.cfg.transfer_gbps * 1e9,
        )
        best: dict[str, PairCost] = {}
        for pc in pairs:
            best.setdefault(pc.decode.handle.name, pc)
        return list(best.values())

    async def _reserve(
        self, act: ActiveRequest, matches: dict[str, int]
    ) -> tuple[WorkerLoad, WorkerLoad, bytes]:
        """Reserve on the decode worker of the cheapest pair (`rank_pairs`: prefill work plus
        the KV bytes the pair would move); while none has room, wait in line (bounded by
        `queue_timeout_s`). Returns (decode worker, the pair's prefill worker, ticket)."""
        got = await self._reserve_once(act, matches)
        if got is not None:
            return got
        deadline = time.monotonic() + self.cfg.queue_timeout_s

        def give_up() -> None:
            if act.aborted:
                raise TransferError("aborted while queued")
            if time.monotonic() > deadline:
                raise RequestFailed(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no decode worker had KV room for {self.cfg.queue_timeout_s:.0f} s",
                )

        async with self._kv_line.first(give_up):
            backoff = _RESERVE_BACKOFF_S
            while True:
                give_up()
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _RESERVE_BACKOFF_MAX_S)
                got = await self._reserve_once(act, matches)
                if got is not None:
                    return got

    async def _reserve_once(
        self, act: ActiveRequest, matches: dict[str, int]
    ) -> tuple[WorkerLoad, WorkerLoad, bytes] | None:
        """One reservation attempt per pair, cheapest first; None when none had room."""
        order = self._pair_order(act, matches)
        if not order:
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE, "no healthy prefill and decode worker pair"
            )
        for pc in order:
            d = pc.decode
            try:
                rr = await self._reserve_on(d, act)
            except WorkerUnavailable as e:  # dead or restarting: try the next pair
                d.mark_down("its reservation failed")
                log.warning("reserve on %s failed: %s", d.handle.name, e)
                continue
            if rr.ticket is None:
                continue
            ticket = kvpb.TransferTicket.FromString(rr.ticket)
            act.decode = d
            act.transfer_id = ticket.transfer_id
            d.pending_blocks += len(ticket.dst_block_ids) + 1
            d.active.add(act.request.request_id)
            if act.aborted:  # Abort came during the call and saw no reservation
                await self._release(act)
                raise TransferError("aborted while queued")
            act.timings["queue_ms"] = (time.perf_counter() - act.arrival_s) * 1e3
            return d, pc.prefill, rr.ticket
        if act.aborted:
            raise TransferError("aborted while queued")
        return None

    async def _reserve_on(self, d: WorkerLoad, act: ActiveRequest) -> ReserveResult:
        """One reservation attempt. If the request is cancelled while the call is in flight
        (client gone, deadline), the call still completes on the worker: whatever it reserved
        is released once it answers, instead of waiting out the lease."""
        rid = act.request.request_id
        call: asyncio.Future[ReserveResult] = asyncio.ensure_future(
            d.handle.call("reserve", act.request)
        )
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:

            def release_late(f: asyncio.Future[ReserveResult]) -> None:
                if not f.cancelled() and f.exception() is None and f.result().ticket is not None:
                    self._spawn(self._quietly(d, "abort", rid))

            call.add_done_callback(release_late)
            raise

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` in the background, keeping a reference until it is done."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _pick_decode(self) -> WorkerLoad:
        order = self.decode.decode_order()
        if not order:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        return order[0]

    async def _relay(
        self, act: ActiveRequest, d: WorkerLoad
    ) -> AsyncIterator[gen.GenerateResponse]:
        rid = act.request.request_id
        try:
            while True:
                try:
                    batch: TokenBatch = await d.handle.call("poll", rid, self.cfg.poll_timeout_s)
                except Exception as e:  # the decode worker died: its streams end here
                    if act.aborted:
                        yield self._complete(act, "abort")
                        return
                    d.mark_down("its stream failed")
                    raise RequestFailed(
                        grpc.StatusCode.UNAVAILABLE, f"decode worker {d.handle.name} died: {e}"
                    ) from e
                if batch.error and not act.aborted:
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, batch.error)
                if batch.num_cached_tokens:
                    act.cached_tokens = batch.num_cached_tokens
                if batch.token_ids or batch.text:
                    yield self._chunk(act, batch.token_ids, batch.text, batch.logprobs)
                if batch.finished:
                    yield self._complete(
                        act, "abort" if act.aborted else (batch.finish_reason or "stop")
                    )
                    return
        finally:
            d.active.discard(rid)

    def _chunk(
        self,
        act: ActiveRequest,
        ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprob, ...],
    ) -> gen.GenerateResponse:
        now = time.perf_counter()
        self.metrics.on_tokens(act, len(ids), now)
        if act.first_sent_s is None and ids:
            act.first_sent_s = now
            self._dequeue(act)
        act.last_sent_s = now
        act.num_sent += len(ids)
        return gen.GenerateResponse(
            request_id=act.request.request_id,
            chunk=gen.GenerateChunk(
                token_ids=list(ids), text=text, logprobs=[_logprob_pb(lp) for lp in logprobs]
            ),
        )

    def _complete(self, act: ActiveRequest, reason: str) -> gen.GenerateResponse:
        self.metrics.on_complete(act, reason, time.perf_counter())
        t = act.timings
        first = act.first_sent_s
        ttft = (first - act.arrival_s) * 1e3 if first else 0.0
        decode = (act.last_sent_s - first) * 1e3 if first and act.last_sent_s else 0.0
        return gen.GenerateResponse(
            request_id=act.request.request_id,
            complete=gen.GenerateComplete(
                finish_reason=_FINISH.get(reason, gen.FINISH_REASON_STOP),
                usage=gen.Usage(
                    prompt_tokens=len(act.request.prompt_token_ids),
                    completion_tokens=act.num_sent,
                    cached_tokens=act.cached_tokens,
                ),
                timings=gen.Timings(
                    queue_ms=t.get("queue_ms", 0.0),
                    prefill_ms=t.get("prefill_ms", 0.0),
                    transfer_ms=t.get("transfer_ms", 0.0),
                    ttft_ms=ttft,
                    decode_ms=decode,
                ),
                prefill_worker=act.prefill.handle.name if act.prefill else "",
                decode_worker=act.decode.handle.name if act.decode else "",
            ),
        )

    # ---- abort and cleanup ---------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        act = self.active.get(request_id)
        if act is None:
            return False
        act.aborted = True
        await self._release(act)
        return True

    def finish(self, act: ActiveRequest, completed: bool) -> None:
        """Forget the request; if it did not complete (cancel, deadline, error), free its
        blocks on both pools in the background."""
        rid = act.request.request_id
        self.active.pop(rid, None)
        self._dequeue(act)
        for w in (act.prefill, act.decode):  # whatever path it ended on, no load is left
            if w is not None:
                w.active.discard(rid)
        if not completed:
            self._spawn(self._release(act, forget=True))

    async def _release(self, act: ActiveRequest, forget: bool = False) -> None:
        """Abort the request on both pools. `forget`: nobody relays it any more (client
        gone, deadline, error), so its token stream on the decode worker is dropped too."""
        rid = act.request.request_id
        calls = []
        if act.prefill is not None:
            calls.append(self._quietly(act.prefill, "abort", rid))
        if act.decode is not None:
            calls.append(self._abort_decode(act.decode, rid, forget))
        await asyncio.gather(*calls)

    async def _abort_decode(self, d: WorkerLoad, request_id: str, forget: bool) -> None:
        await self._quietly(d, "abort", request_id)
        if forget:  # a finished stream is dropped by the poll that returns its end
            await self._quietly(d, "poll", request_id, 0.0)

    async def _quietly(self, w: WorkerLoad, method: str, *args: object) -> None:
        try:
            await w.handle.call(method, *args)
        except Exception as e:
            log.warning("%s on %s failed: %s", method, w.handle.name, e)

    # ---- info ----------------------------------------------------------------------------
    async def server_info(self) -> gen.ServerInfo:
        # From the stats the refresh loop keeps, pulling anew at most once per interval, so
        # a client calling this in a loop cannot turn it into a stats storm on the workers.
        if time.monotonic() - self._last_refresh_s > self.cfg.stats_interval_s:
            await self.refresh()
        workers = [
            gen.WorkerInfo(
                name=w.handle.name,
                role=w.stats.role,
                num_free_blocks=w.stats.num_free_blocks,
                num_total_blocks=w.stats.num_total_blocks,
                num_running=w.stats.num_running,
                num_waiting=w.stats.num_waiting,
                num_requests_total=w.stats.num_requests_total,
                num_preemptions_total=w.stats.num_preemptions_total,
            )
            for w in self.prefill.workers + self.decode.workers
            if w.stats is not None
        ]
        return gen.ServerInfo(
            version=_version(),
            mode="colocated" if self.colocated else "disaggregated",
            transport=self.transport,
            index_backend=self.index.backend,
            workers=workers,
        )


def _logprob_pb(lp: TokenLogprob) -> gen.TokenLogprob:
    return gen.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[gen.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "0+unknown"


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(
        self, request: gen.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen.GenerateResponse]:
        try:
            act = self.router.admit(request)
        except RequestFailed as e:
            await context.abort(e.code, e.details)
            return
        completed = False
        try:
            async for resp in self.router.run(act):
                yield resp
                completed = resp.HasField("complete")
        except RequestFailed as e:
            await context.abort(e.code, e.details)  # raises; `finally` releases the request
        finally:
            self.router.finish(act, completed)

    async def Abort(
        self, request: gen.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gen.AbortResponse:
        return gen.AbortResponse(found=await self.router.abort(request.request_id))

    async def GetModelInfo(
        self, request: gen.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen.ModelInfo:
        return self.router.model_info

    async def GetServerInfo(
        self, request: gen.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen.ServerInfo:
        return await self.router.server_info()


def grpc_options(router: Router) -> list[tuple[str, int]]:
    """The largest valid request is its prompt text at the edge limit (4 bytes a character
    at most in UTF-8) plus room for the rest; a larger message is refused by gRPC itself
    before it is parsed (RESOURCE_EXHAUSTED)."""
    receive = 4 * router.limits.edge_limits().max_prompt_chars + (1 << 20)
    return [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", max(receive, 4 << 20)),
    ]


@dataclass
class RouterServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


async def start_server(router: Router, host: str, port: int) -> RouterServer:
    """Bind the Generation service, health and reflection; health starts NOT_SERVING."""
    server = grpc.aio.server(
        options=grpc_options(router), interceptors=api_key_interceptors(router.cfg.api_key)
    )
    gen_grpc.add_GenerationServicer_to_server(GenerationService(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = add_port(server, f"{host}:{port}", router.cfg)  # TLS when configured
    await server.start()
    rs = RouterServer(server, health_servicer, bound)
    await rs.set_serving(False)
    return rs
