"""The prefill worker: prompt passes, first tokens, and KV pushed layer by layer.

Plain class (tests build it without Ray); `prefill_workers.actor` is the Ray adapter. The
engine runs on its own thread (`EngineLoop`); while a step computes, the per-layer hook pushes
each finished layer of every prompt that completes in this step to its decode worker. After
the step, a finisher thread waits for each transfer's acknowledgement and only then releases
the source blocks (they stay in the prefix cache); the lease bounds how long that may take.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.engine import LLMEngine
from engine.loop import EngineLoop
from engine.request import Request, RequestOutput
from kv_transfer.config import WorkerConfig
from kv_transfer.index_feed import IndexFeed, IndexUpdate
from kv_transfer.messages import PrefillResult, PrefillTask, WorkerStats
from kv_transfer.sender import KVSender, OutboundTransfer, SenderLeases
from kv_transfer.transports.base import get_transport
from kv_transfer.wire import TransferError, TransferRejected
from protos.pdserve.v1 import kv_transfer_pb2 as pb


@dataclass
class _Job:
    task: PrefillTask
    ticket: pb.TransferTicket
    request: Request
    future: concurrent.futures.Future[PrefillResult]
    arrival_s: float
    outbound: OutboundTransfer | None = None
    started_s: float | None = None
    error: str = ""  # the transfer broke while pushing (the request fails, not the engine)
    aborted: bool = False  # _abort told the receiver and answered the router already
    stall_s: float = 0.0  # fault injection: frames held back this long (inject_transfer_stall)


class PrefillWorker:
    role = "prefill"

    def __init__(self, cfg: WorkerConfig, engine: LLMEngine | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.role = cfg.role or self.role
        self.engine = engine or LLMEngine.from_config(cfg.engine)
        transfer_cfg = cfg.transfer
        engine_cfg = cfg.engine
        transport = get_transport(
            transfer_cfg.transport,
            transfer_cfg.timeout_s,
            engine_cfg.device,
            transfer_cfg.resolve_secret(),
        )
        self.sender = KVSender(
            self.engine.cache,
            cfg.name,
            transport,
            transfer_cfg.max_channels,
            transfer_cfg.layers_per_frame,
            transfer_cfg.timeout_s,
        )
        self.leases = SenderLeases(transfer_cfg.lease_s)
        self.jobs: dict[str, _Job] = {}
        self.num_requests_total = 0
        self.num_transfer_failures = 0
        self.num_transfer_bytes = 0  # KV payload bytes pushed (all transfers, /metrics)
        self._finisher = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="kv-finish")
        self.engine.layer_hook = self._on_layer
        self.loop = EngineLoop(self.engine, self._on_outputs, cfg.name, self._on_fatal)
        self.fatal_hook: Callable[[BaseException], None] | None = None  # the actor exits
        self.feed = IndexFeed(cfg.name, cfg.index, cfg.model_name, self.loop)
        self._stalls: list[float] = []  # fault injection, consumed one per new request

    # ---- API (called from the actor's event loop) ----------------------------------------
    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Run the prompt pass, ship its KV per the ticket, return the first token."""
        ticket = pb.TransferTicket.FromString(task.ticket)
        fut: concurrent.futures.Future[PrefillResult] = concurrent.futures.Future()
        arrival = time.perf_counter()
        r = task.request

        def admit() -> None:
            req = self.engine.add_request(
                r.request_id, r.prompt_token_ids, r.params, r.cache_salt, prefill_only=True
            )
            job = _Job(task, ticket, req, fut, arrival)
            if self._stalls:
                job.stall_s = self._stalls.pop()
            self.jobs[r.request_id] = job
            self.num_requests_total += 1

        await self.loop.run(admit)
        return await asyncio.wrap_future(fut)

    async def abort(self, request_id: str) -> bool:
        """Stop a prompt pass (or its transfer) and release its blocks."""
        return await self.loop.run(lambda: self._abort(request_id, "aborted by router"))

    async def start_feed(self) -> None:
        """Start publishing block events (needs the caller's running event loop)."""
        self.feed.start()

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        """Block events since the last call (the router's in-memory index pulls these)."""
        return await self.feed.take(with_held)

    async def stats(self) -> WorkerStats:
        return await self.loop.run(self._stats)

    async def check_integrity(self) -> int:
        """Run the block manager's integrity check; returns the number of held blocks."""

        def check() -> int:
            self.leases.expire()
            self.engine.blocks.check_integrity()
            return self.engine.blocks.num_used_blocks

        return await self.loop.run(check)

    async def inject_transfer_stall(self, stall_s: float, num_transfers: int = 1) -> None:
        """Fault injection (`pdserve chaos`, tests; never called in service): the next
        `num_transfers` prompts push no layer while they compute, and their KV leaves, whole,
        only `stall_s` after the pass ended, as over a stalled link. Replaces what was armed
        before (`num_transfers=0` disarms)."""
        assert stall_s >= 0 and num_transfers >= 0, "stall_s and num_transfers must be >= 0"

        def arm() -> None:
            self._stalls = [stall_s] * num_transfers

        await self.loop.run(arm)

    def shutdown(self) -> None:
        self.feed.cancel()
        self.loop.stop()
        self.sender.close()
        self._finisher.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread -------------------------------------------------------------------
    def _on_layer(self, layer: int) -> None:
        step = self.engine.current_step
        if step is None:
            return
        for chunk in step.prefill:
            job = self.jobs.get(chunk.request.request_id)
            if job is None or not chunk.completes_prompt or job.error:
                continue
            try:
                if job.outbound is None:
                    # Only the blocks the receiver lacks: it already holds the first
                    # `first_block` (a prefix it cached from an earlier turn).
                    t = job.ticket
                    src = self.engine.blocks.block_table(job.request.request_id)
                    job.outbound = self.sender.start(
                        t, src[t.first_block : t.first_block + len(t.dst_block_ids)]
                    )
                if not job.stall_s:
                    self.sender.push_async(job.outbound, layer + 1)
            except Exception as e:  # a broken pair fails its transfers, never the engine step
                job.error = f"KV push to {job.ticket.channel_address} failed: {e!r}"
                if not isinstance(e, TransferRejected):  # the pair is suspect: rebuild it
                    channel = job.outbound.channel if job.outbound is not None else None
                    self.sender.drop_channel(job.ticket.channel_address, channel)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or not out.finished:
                continue
            rid = out.request_id
            self.leases.hold(rid, self._releaser(rid))
            self._finisher.submit(self._complete, job, out)

    def _on_fatal(self, error: BaseException) -> None:
        """The engine died: answer every waiting request, then let the actor be replaced."""
        for job in list(self.jobs.values()):
            if not job.future.done():
                job.future.set_exception(RuntimeError(f"{self.name}: engine died: {error!r}"))
        if self.fatal_hook is not None:
            self.fatal_hook(error)

    def _releaser(self, request_id: str) -> Callable[[], None]:
        """A release callback safe to call from any thread (it runs on the engine thread)."""

        def release() -> None:
            self.loop.call(lambda: self._release(request_id))

        return release

    def _release(self, request_id: str) -> None:
        self.engine.release(request_id)
        self.jobs.pop(request_id, None)

    def _abort(self, request_id: str, reason: str) -> bool:
        job = self.jobs.pop(request_id, None)
        if job is None:
            return False
        job.aborted = True
        if job.outbound is not None:
            self.sender.abort(job.outbound, reason)
        self.engine.abort(request_id)  # still prefilling: frees its blocks
        if not self.leases.release(request_id):
            self.engine.release(request_id)
        if not job.future.done():
            job.future.set_exception(TransferError(f"{request_id}: {reason}"))
        return True

    def _stats(self) -> WorkerStats:
        return WorkerStats.of_engine(
            self.name,
            self.role,
            self.engine,
            len(self.leases),
            self.num_requests_total,
            {
                "transfer_failures_total": float(self.num_transfer_failures),
                "transfer_bytes_total": float(self.num_transfer_bytes),
            },
        )

    # ---- finisher threads ----------------------------------------------------------------
    def _complete(self, job: _Job, out: RequestOutput) -> None:
        """Wait for the decode side's acknowledgement, then release and answer."""
        req = job.request
        if job.stall_s:
            time.sleep(job.stall_s)  # fault injection; an abort meanwhile is seen below
        if job.aborted:
            # Nothing to finish: finishing an aborted transfer fails, and the sender then
            # drops the pair's channel under every other transfer in flight on it.
            self.leases.release(req.request_id)
            return
        done_s = time.perf_counter()
        error = ""
        finished = out.finish_reason is not None
        try:
            if job.error:
                raise TransferError(f"{req.request_id}: {job.error}")
            if job.outbound is None:
                raise TransferError(f"{req.request_id}: no layer was pushed")
            if finished:  # nothing to decode: tell the decode side to let go
                self.sender.abort(job.outbound, "finished at the first token")
            else:
                self.sender.finish(job.outbound)
        except Exception as e:  # whatever broke, the router gets an answer, not a hang
            error = str(e) if isinstance(e, TransferError) else f"{req.request_id}: {e!r}"
            self.num_transfer_failures += 1
        finally:
            self.leases.release(req.request_id)
            if job.outbound is not None:
                self.num_transfer_bytes += job.outbound.bytes_sent
        transfer_ms = (time.perf_counter() - done_s) * 1e3
        queue_s = (req.first_token_s or done_s) - job.arrival_s - req.prefill_s
        result = PrefillResult(
            request_id=req.request_id,
            first_token_id=out.new_token_ids[0],
            text=out.text_delta,
            logprob=out.new_logprobs[0] if out.new_logprobs else None,
            finished=finished,
            finish_reason=out.finish_reason.value if out.finish_reason else None,
            num_cached_tokens=req.num_cached_tokens,
            queue_ms=max(queue_s, 0.0) * 1e3,
            prefill_ms=req.prefill_s * 1e3,
            transfer_ms=transfer_ms,
            error=error,
        )
        if not job.future.done():
            job.future.set_result(result)
