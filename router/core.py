"""The router: admission, the request table, health and cleanup, in front of the two pools.

One request (docs/architecture.md): `admit` validates and tokenizes it at the edge; `run`
drives it (`router.flow`); `finish` forgets it. Any exit path (finish, Abort, client cancel,
deadline, worker death) releases the request's blocks on both pools. The gRPC service
(`router.service`) and the HTTP app (`router.http`) are thin layers over this class.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import grpc

from engine.request import FinishReason
from engine.sampling import InvalidParameterError, TokenLogprob
from engine.tokenizer import Tokenizer
from pool_api.messages import WorkerRequest
from pool_api.prefix_index import MemoryPrefixIndex, PrefixIndex
from pool_api.version import package_version
from protos.pdserve.v1 import generation_pb2 as gen
from router import responses
from router.active import ActiveRequest, Observers, RequestFailed
from router.choices import best_of
from router.clients import DecodeClient, PrefillClient, quietly
from router.config import PlannerSettings, RouterConfig
from router.flow import RequestFlow
from router.forecast import ForecastFloor
from router.grammar_check import COMPILE_TIMEOUT_S, GrammarChecker, TokenizerSpec
from router.index_sync import IndexSync
from router.membership import PoolAdmin
from router.planner import Planner
from router.pools import Pool
from router.race import Lost, first_of
from router.reservation import Reserver
from router.stats_log import RequestLog, StatsLog
from router.token_sink import TokenSinkServer
from router.validation import ModelLimits, prepare

log = logging.getLogger(__name__)
# How often worker load is pulled for routing (an internal, not a setting).
STATS_REFRESH_S = 0.2
# The most calls a second the refresh makes (each worker's stats, and its index pull with
# the in-memory index): past STATS_REFRESH_S x this many calls the interval grows with the
# pools. Each call costs the router's process about 0.3 ms of CPU in Ray; every 0.2 s at
# 200 workers the idle router spent 44 % of a core on them (benchmarks/pool_mock.py).
REFRESH_CALLS_PER_S = 250.0
# After a drain ends what is in flight, how long their last responses get to go out.
_STOP_ANSWER_S = 2.0


class Router:
    def __init__(
        self,
        cfg: RouterConfig,
        limits: ModelLimits,
        tokenizer: Tokenizer | None,
        model_info: gen.ModelInfo,
        prefill: Pool[PrefillClient],
        decode: Pool[DecodeClient],
        transport: str,
        index: PrefixIndex | None = None,
        colocated: bool = False,
    ) -> None:
        self.cfg = cfg
        self.limits = limits
        self.tokenizer = tokenizer
        # structured outputs: each grammar compiles at the edge, within a bound, first
        self.grammar_check = (
            GrammarChecker(
                TokenizerSpec(tokenizer.to_str(), limits.vocab_size, tokenizer.eos_token_ids),
                COMPILE_TIMEOUT_S,
            )
            if tokenizer is not None
            else None
        )
        self.model_info = model_info
        self.prefill = prefill
        self.decode = decode
        self.transport = transport
        self.colocated = colocated
        self.index = index or MemoryPrefixIndex()
        self.active: dict[str, ActiveRequest] = {}
        self.num_queued = 0  # admitted, no token sent yet (bounded by max_queue_len)
        self.draining = False
        self.stopping = asyncio.Event()  # the drain's grace ran out: end what is in flight
        # Per-request hooks: RouterMetrics.install adds the metrics, log_requests the log.
        self.metrics = Observers(*([RequestLog()] if cfg.log_requests else []))
        self.stats_log: StatsLog | None = None  # RouterMetrics.install sets it; start runs it
        # Health follows `serviceable()`: the gRPC server sets this (pdserve/serve.py).
        self.on_serving_change: Callable[[bool], Awaitable[None]] | None = None
        self._serving = False
        self._last_refresh_s = 0.0
        self.stats_refresh_s = STATS_REFRESH_S
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._stats_logger: asyncio.Task[None] | None = None
        self._index_sync = IndexSync(self.index)
        for worker in prefill.workers + decode.workers:
            worker.client.deadline_s = cfg.worker_call_timeout_s
        self.reserver = Reserver(cfg.policy, prefill, decode, model_info.block_size, self._spawn)
        # workers added, drained and flipped at run time (/v1/admin/pool; router.membership)
        admin = (prefill, decode, self.index, self.in_flight_on, colocated)
        self.admin = PoolAdmin(*admin, cfg.worker_call_timeout_s)
        self.planner: Planner | None = None  # `start_planner` (planner.enabled)
        # Decode workers push tokens here (router.token_sink).
        host = "127.0.0.1" if cfg.token_stream_host == "auto" else cfg.token_stream_host
        self.sinks = TokenSinkServer(host)
        self.flow = RequestFlow(
            cfg, prefill, decode, self.index, model_info, self.reserver, self, colocated,
            self.sinks,
        )  # fmt: skip

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        if self.grammar_check is not None:
            self.grammar_check.start()  # warms in the background; readiness does not wait
        await self.sinks.start()
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_loop())
        if self.stats_log is not None:
            self._stats_logger = asyncio.create_task(self.stats_log.run())

    def start_planner(
        self, settings: PlannerSettings, forecast: ForecastFloor | None = None
    ) -> Planner:
        """Pool sizes that follow the load (router.planner; `forecast`: its floor loop's
        model, from `planner.profile`); in the running loop."""
        self.planner = Planner(
            settings, self.admin, self.prefill, self.decode, self.colocated, forecast
        )
        self.metrics.add(self.planner.window)
        self.planner.start()
        log.warning(
            "planner on (%s): SLO TTFT %g ms, TPOT %g ms at %g%%, every %g s",
            settings.mode,
            settings.ttft_ms,
            settings.tpot_ms,
            settings.target_attainment * 100,
            settings.interval_s,
        )
        return self.planner

    def refresh_interval_s(self) -> float:
        """`stats_refresh_s`, or longer for large pools (`REFRESH_CALLS_PER_S`)."""
        workers = len(self.prefill.workers) + len(self.decode.workers)
        calls = workers * (2 if isinstance(self.index, MemoryPrefixIndex) else 1)
        return max(self.stats_refresh_s, calls / REFRESH_CALLS_PER_S)

    async def refresh(self, spread: bool = False) -> None:
        """Worker stats (load, health), serving state, and the in-memory index. `spread`
        (the refresh loop): each worker's calls start evenly over the interval, each
        worker's index pull once its stats arrived, rather than all at once (a burst of
        them delays the requests' own calls: `Pool.refresh`)."""
        interval = self.refresh_interval_s()
        # a stats call's bound stays the base interval's (2 s) at any pool size: a silent
        # worker is still found after two missed calls, later only by the longer interval
        timeout = max(2.0, 10 * self.stats_refresh_s)
        if spread:
            self._index_sync.begin()
            pull = self._index_sync.pull_from
            await asyncio.gather(
                self.prefill.refresh(interval, timeout, interval, pull),
                self.decode.refresh(interval, timeout, interval, pull),
            )
        else:
            await asyncio.gather(
                self.prefill.refresh(interval, timeout), self.decode.refresh(interval, timeout)
            )
        self._last_refresh_s = time.monotonic()
        self.admin.reconcile()
        serving = self.serviceable()
        if serving != self._serving and self.on_serving_change is not None:
            why = "draining" if self.draining else "a pool is down"
            log.warning("router %s", "serving again" if serving else f"cannot serve: {why}")
            await self.on_serving_change(serving)
        self._serving = serving
        if not spread:
            await self._index_sync.pull(self.prefill.workers + self.decode.workers)

    def serviceable(self) -> bool:
        """Requests can succeed: not draining, a decode worker is up, and a prefill worker
        too, unless decode workers prefill themselves (colocated, or the `recompute` policy
        with the prefill pool down: degraded, see `degraded`)."""
        if self.draining or not self.decode.serviceable():
            return False
        if self.colocated or not self.prefill.workers or self.prefill.serviceable():
            return True
        return self.cfg.policy.prefill_failure_policy == "recompute"

    def in_flight_on(self, worker: str) -> int:
        """Requests of this router's that are on worker `worker` now (a drain waits them out)."""
        return sum(
            1
            for act in self.active.values()
            if any(w is not None and w.name == worker for w in (act.prefill, act.decode))
        )

    def degraded(self) -> list[str]:
        """Why a serving router serves less than its whole deployment (empty: it does not):
        what a load balancer's health check and an operator see."""
        out = []
        for pool, what in ((self.prefill, "prefill"), (self.decode, "decode")):
            down = [w.name for w in pool.workers if not w.healthy]
            if down:
                out.append(f"{len(down)} of {len(pool.workers)} {what} workers down")
            draining = [w.name for w in pool.workers if w.healthy and not w.routable]
            if draining:
                out.append(f"{len(draining)} of {len(pool.workers)} {what} workers draining")
        if self.prefill.workers and not self.colocated and not self.prefill.serviceable():
            out.append("no prefill worker: decode workers prefill the prompts")
        return out

    async def _refresh_loop(self) -> None:
        """A spread refresh every interval: it spends most of the interval on its calls,
        so the loop sleeps what is left (a round that ran long is followed at once)."""
        began = time.monotonic()  # `start` ran the first round
        while True:
            await asyncio.sleep(max(0.0, self.refresh_interval_s() - (time.monotonic() - began)))
            began = time.monotonic()
            await self.refresh(spread=True)

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; wait up to `grace_s` for in-flight ones to finish; then end
        each one still in flight with UNAVAILABLE "server shutting down" (an SSE error event
        on HTTP), and give their responses a moment to go out before the servers stop."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("drain: grace over, ending %d requests in flight", len(self.active))
            self.stopping.set()
            deadline = time.monotonic() + _STOP_ANSWER_S
            while self.active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        for task in (self._refresher, self._stats_logger):
            if task is not None:
                task.cancel()
        if self.planner is not None:
            self.planner.stop()
        self._index_sync.cancel()
        if self.grammar_check is not None:
            self.grammar_check.close()
        await self.sinks.stop()
        await self.index.close()

    # ---- one request ---------------------------------------------------------------------
    async def admit(self, request: gen.GenerateRequest) -> ActiveRequest:
        """Validate at the edge; raises RequestFailed with the proper status."""
        try:
            act = await self._admit(request)
        except RequestFailed as e:
            self.metrics.on_reject(e.code)
            raise
        self.metrics.on_admit(act)
        return act

    async def _prepare(self, request: gen.GenerateRequest) -> WorkerRequest:
        """Validate and tokenize. Text is tokenized on a worker thread (after the edge
        limits, which run first either way): the event loop keeps serving meanwhile."""
        if request.WhichOneof("prompt") in ("text", "chat"):
            wr = await asyncio.to_thread(prepare, request, self.tokenizer, self.limits)
        else:
            wr = prepare(request, self.tokenizer, self.limits)
        so = wr.params.structured
        if so is not None:
            if self.grammar_check is None:
                raise InvalidParameterError(so.field, "this model has no tokenizer")
            await self.grammar_check.check(so)
        return wr

    async def _admit(self, request: gen.GenerateRequest) -> ActiveRequest:
        if self.draining:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "server is draining")
        try:
            # A full queue refuses at once, before the tokenizer's thread (under overload a
            # refusal would otherwise wait its turn there); sizes are checked first, so an
            # oversized request still hears which field, and `prepare` checks them again.
            self.limits.edge_limits().check(request)
            self._refuse_when_full()
            wr = await self._prepare(request)
        except InvalidParameterError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        except LookupError as e:
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, str(e)) from e
        if wr.request_id in self.active:
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: {wr.request_id!r} is already in flight",
            )
        self._refuse_when_full()  # again: it may have filled while this one was tokenized
        act = ActiveRequest(
            wr,
            time.perf_counter(),
            n=request.sampling.n or 1,
            asked_logprobs=request.sampling.HasField("logprobs"),
        )
        self.active[wr.request_id] = act
        self.num_queued += 1
        return act

    def _refuse_when_full(self) -> None:
        if self.num_queued >= self.cfg.policy.max_queue_len:
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"queue full ({self.cfg.policy.max_queue_len} requests waiting)",
            )

    def run(self, act: ActiveRequest) -> AsyncIterator[gen.GenerateResponse]:
        """Drive one admitted request; yields its responses (`router.flow`), or ends with
        UNAVAILABLE "server shutting down" once a drain's grace ran out."""
        stream = self.flow.run(act)
        if act.num_seqs > act.n:
            stream = best_of(act, stream)
        return self._until_stopped(act, stream)

    async def _until_stopped(
        self, act: ActiveRequest, stream: AsyncIterator[gen.GenerateResponse]
    ) -> AsyncIterator[gen.GenerateResponse]:
        stop = asyncio.ensure_future(self.stopping.wait())  # one for the whole stream
        try:
            while True:
                try:
                    # a lost step is cancelled, and the flow's own cleanup (its `finally`)
                    # has run as it unwound, before first_of returns
                    resp = await first_of(stream.__anext__(), stop)
                except StopAsyncIteration:
                    return
                if resp is Lost.SIGNAL:
                    act.failure = grpc.StatusCode.UNAVAILABLE
                    raise RequestFailed(act.failure, "server shutting down")
                assert not isinstance(resp, Lost), "no timeout was given"
                yield resp
        finally:
            stop.cancel()
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator

    def _dequeue(self, act: ActiveRequest) -> None:
        """The request left the queue (its first token went out, or it ended)."""
        if act.queued:
            act.queued = False
            self.num_queued -= 1

    # ---- responses (router.flow's Responder) ---------------------------------------------
    def chunk(
        self,
        act: ActiveRequest,
        ids: Sequence[int],
        text: str,
        logprobs: Sequence[TokenLogprob],
        prompt_logprobs: Sequence[TokenLogprob | None] = (),
        index: int = 0,
        finish: FinishReason | None = None,
    ) -> gen.GenerateResponse:
        if finish is not None:
            act.choices_ended[index] = finish
        now = time.perf_counter()
        self.metrics.on_tokens(act, len(ids), now)
        if act.first_sent_s is None and ids:
            act.first_sent_s = now
            self._dequeue(act)
        act.last_sent_s = now
        act.num_sent += len(ids)
        return responses.chunk(act.request_id, ids, text, logprobs, prompt_logprobs, index, finish)

    def complete(self, act: ActiveRequest, reason: FinishReason) -> gen.GenerateResponse:
        if act.finish_reason is None:
            act.finish_reason = reason
            self.metrics.on_complete(act, reason, time.perf_counter())
        return responses.complete(act, reason)

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
        self.active.pop(act.request_id, None)
        self._dequeue(act)
        for w in (act.prefill, act.decode):  # whatever path it ended on, no load is left
            if w is not None:
                w.untrack(act.request_id)
        if act.finish_reason is None:
            self._count_unfinished(act)
        if not completed:
            self._spawn(self._release(act))

    def _count_unfinished(self, act: ActiveRequest) -> None:
        """No completion went out. Unless it failed, its client left (disconnect, deadline,
        cancel): counted once as an ABORT completion, as vLLM counts an aborted request."""
        now = time.perf_counter()
        if act.failure is not None:
            self.metrics.on_fail(act, act.failure, now)
            return
        act.finish_reason = FinishReason.ABORT
        self.metrics.on_complete(act, FinishReason.ABORT, now)

    async def _release(self, act: ActiveRequest) -> None:
        """Abort the request on both pools (client gone, deadline, error, Abort): they free
        its blocks and end its token stream."""
        rid = act.request_id
        calls = []
        if act.prefill is not None:
            calls.append(quietly(partial(act.prefill.client.abort, rid), "abort", act.prefill.name))
        if act.decode is not None:
            calls.append(quietly(partial(act.decode.client.abort, rid), "abort", act.decode.name))
        await asyncio.gather(*calls)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` in the background, keeping a reference until it is done."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- info ----------------------------------------------------------------------------
    async def server_info(self) -> gen.ServerInfo:
        """At once, from the stats the refresh loop keeps (never a call to a worker: one
        that is down would hold the answer), with each worker's health and stats age."""
        now = time.monotonic()
        workers = []
        for w in self.prefill.workers + self.decode.workers:
            info = gen.WorkerInfo(name=w.name, role=w.client.role.value, healthy=w.healthy)
            if w.stats is not None:  # none yet: it never answered
                s = w.stats
                info.num_free_blocks, info.num_total_blocks = s.num_free_blocks, s.num_total_blocks
                info.num_running, info.num_waiting = s.num_running, s.num_waiting
                info.num_requests_total = s.num_requests_total
                info.num_preemptions_total = s.num_preemptions_total
                info.stats_age_s = now - w.stats_at_s
            workers.append(info)
        return gen.ServerInfo(
            version=package_version(),
            mode="colocated" if self.colocated else "disaggregated",
            transport=self.transport,
            index_backend=self.index.backend,
            workers=workers,
            status=self.status(),
            degraded=self.degraded() if self.serviceable() else [],
        )

    def status(self) -> str:
        """What GET /health says: ok, degraded, not ready or draining."""
        if self.draining:
            return "draining"
        if not self.serviceable():
            return "not ready"
        return "degraded" if self.degraded() else "ok"
