"""The prefill worker: prompt passes, first tokens, and KV pushed layer by layer.

Plain class (tests build it without Ray); `prefill_workers.actor` is the Ray adapter. The
engine runs on its own thread (`EngineLoop`); while a step computes, the per-layer hook pushes
each finished layer of every prompt that completes in this step to its decode worker. After
the step, a finisher thread waits for each transfer's acknowledgement and only then releases
the source blocks (they stay in the prefix cache); the lease bounds how long that may take.

Who writes what (one owner per field; other threads hand work to it):

    state                                            owner            others hand work over by
    engine (its blocks too), jobs, _early_aborts,    engine thread    `self.loop.call` (the
      num_requests_total, num_transfer_failures,                      finisher threads count
      num_transfer_bytes, a job's outbound and error                  their transfers so)
    leases                                           SenderLeases     its lock
    a job's future                                   set once, by whichever ends it first

With `PDSERVE_CHECK_OWNERS=1` (the tests set it) the engine thread's methods assert it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.engine import LLMEngine
from engine.loop import EngineFailed
from engine.request import Request, RequestOutput
from engine.scheduler import SchedulerOutput
from kv_transfer.sender import DEFAULT_MAX_CHANNELS, KVSender, OutboundTransfer, SenderLeases
from kv_transfer.wire import TransferError
from pool_api.config import WorkerConfig
from pool_api.messages import FirstToken, PrefillResult, PrefillTask, Role, StatKey
from protos.pdserve.v1 import kv_transfer_pb2 as pb
from worker_common import WorkerBase, check_owner

log = logging.getLogger(__name__)
EARLY_ABORT_S = 2.0  # how long an abort that found no job refuses its prompt pass


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


class PrefillWorker(WorkerBase):
    default_role = Role.PREFILL

    def __init__(
        self,
        cfg: WorkerConfig,
        engine: LLMEngine | None = None,
        previous: WorkerBase | None = None,
    ) -> None:
        super().__init__(cfg, engine, previous)
        t = cfg.transfer
        self.sender = KVSender(
            self.engine.cache, cfg.name, self.transport, DEFAULT_MAX_CHANNELS, t.layers_per_frame,
            t.timeout_s,
        )  # fmt: skip
        self.leases = SenderLeases(t.lease_s)
        self.jobs: dict[str, _Job] = {}
        # Aborts that found no job: the router's abort can overtake its own prompt-pass call
        # (two Ray calls, one waiting for the engine thread); the pass is refused when it
        # comes within EARLY_ABORT_S. Request id -> monotonic time of the abort.
        self._early_aborts: dict[str, float] = {}
        self.num_transfer_failures = 0
        self.num_transfer_bytes = 0  # KV payload bytes pushed (all transfers, /metrics)
        self._finisher = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="kv-finish")
        self.engine.layer_hook = self._on_layer
        self._start_loop()

    # ---- API (called from the actor's event loop) ----------------------------------------
    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Run the prompt pass, ship its KV per the ticket, return the first token."""
        r = task.request
        self.refuse_when_draining(r.request_id)
        ticket = pb.TransferTicket.FromString(task.ticket)
        fut: concurrent.futures.Future[PrefillResult] = concurrent.futures.Future()
        arrival = time.perf_counter()
        grammar = await self.compile_grammar(r.params)
        if grammar.fingerprint != ticket.grammar_fingerprint:
            # Token #1 is sampled here under the grammar and only checked there: both sides
            # must hold the same one (backend, tokenizer and spec), or none.
            raise TransferError(
                f"{r.request_id}: grammar mismatch: receiver "
                f"{ticket.grammar_fingerprint or 'unconstrained'}, sender "
                f"{grammar.fingerprint or 'unconstrained'}"
            )

        def admit() -> None:
            self._on_engine_thread()
            aborted_at = self._early_aborts.pop(r.request_id, None)
            if aborted_at is not None and time.monotonic() - aborted_at < EARLY_ABORT_S:
                raise TransferError(f"{r.request_id}: aborted by router before its prompt pass")
            req = self.engine.add_request(
                r.request_id,
                r.prompt_token_ids,
                r.params,
                r.cache_salt,
                prefill_only=True,
                grammar=grammar.grammar,
            )
            self.jobs[r.request_id] = _Job(task, ticket, req, fut, arrival)
            self.num_requests_total += 1

        await self.loop.run(admit)
        return await asyncio.wrap_future(fut)

    async def abort(self, request_id: str) -> bool:
        """Stop a prompt pass (or its transfer) and release its blocks."""
        return await self.loop.run(lambda: self._abort(request_id, "aborted by router"))

    def _check_integrity(self) -> int:
        self.leases.expire()
        return super()._check_integrity()

    def _close_role(self) -> None:
        self.engine.layer_hook = None
        self.sender.close()
        # waits for a completion under way (the sender is closed: it ends at once); one left
        # running held this worker's jobs, and so its engine, past shutdown
        self._finisher.shutdown(wait=True, cancel_futures=True)

    def _end_all(self) -> int:
        self._on_engine_thread()
        ids = list(self.jobs)
        for rid in ids:
            self._abort(rid, f"{self.name} is handing over")
        return len(ids)

    # ---- engine thread -------------------------------------------------------------------
    def _on_engine_thread(self) -> None:
        check_owner(self.loop.on_its_thread(), "engine thread")

    def _on_layer(self, step: SchedulerOutput, layer: int) -> None:
        """The engine's layer hook: push `layer` of each prompt that completes in `step`."""
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
                self.sender.push_async(job.outbound, layer + 1)
            except Exception as e:
                # Boundary: a ticket this sender cannot serve (or a bug) fails its transfer,
                # never the engine step. Nothing here touches the network (the receiver's
                # lane connects and sends, and drops a channel that failed), so no channel
                # is dropped here.
                if not isinstance(e, TransferError):
                    log.exception("KV push of %s failed", job.request.request_id)
                job.error = f"KV push to {job.ticket.channel_address} failed: {e!r}"

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """A prompt pass ended: its choices' first tokens (all in this step's outputs, the
        last one marked `last`) go to a finisher thread with the job."""
        self._on_engine_thread()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or not out.last:
                continue
            rid = out.request_id
            firsts = [o for o in outputs if o.request_id == rid]
            self.leases.hold(rid, self._releaser(rid))
            self._finisher.submit(self._complete, job, firsts)

    def _fail_all(self, error: BaseException) -> None:
        for job in list(self.jobs.values()):
            if not job.future.done():
                job.future.set_exception(EngineFailed(f"{self.name}: engine died: {error!r}"))

    def _releaser(self, request_id: str) -> Callable[[], None]:
        """A release callback safe to call from any thread (it runs on the engine thread)."""

        def release() -> None:
            self.loop.call(lambda: self._release(request_id))

        return release

    def _release(self, request_id: str) -> None:
        self._on_engine_thread()
        self.engine.release(request_id)
        self.jobs.pop(request_id, None)

    def _abort(self, request_id: str, reason: str) -> bool:
        self._on_engine_thread()
        job = self.jobs.pop(request_id, None)
        if job is None:
            now = time.monotonic()
            self._early_aborts = {
                rid: t for rid, t in self._early_aborts.items() if now - t < EARLY_ABORT_S
            }
            self._early_aborts[request_id] = now
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

    def _num_reserved(self) -> int:
        return len(self.leases)

    def _extra_stats(self) -> dict[str, float]:
        return {
            StatKey.TRANSFER_FAILURES_TOTAL.value: float(self.num_transfer_failures),
            StatKey.TRANSFER_BYTES_TOTAL.value: float(self.num_transfer_bytes),
        }

    def _count_transfer(self, failed: bool, num_bytes: int) -> None:
        self._on_engine_thread()
        self.num_transfer_failures += failed
        self.num_transfer_bytes += num_bytes

    # ---- finisher threads ----------------------------------------------------------------
    def _complete(self, job: _Job, firsts: list[RequestOutput]) -> None:
        """Wait for the decode side's acknowledgement, then release and answer. `firsts`:
        each choice's first token, by index."""
        req = job.request
        firsts = sorted(firsts, key=lambda o: o.index)
        choices = tuple(
            FirstToken(
                o.new_token_ids[0],
                o.text_delta,
                o.new_logprobs[0] if o.new_logprobs else None,
                o.finish_reason,
            )
            for o in firsts
        )
        if job.aborted:
            # Nothing to finish: finishing an aborted transfer fails, and the sender then
            # drops the pair's channel under every other transfer in flight on it.
            self.leases.release(req.request_id)
            return
        done_s = time.perf_counter()
        error = ""
        failed = False
        finished = all(c.finish_reason is not None for c in choices)
        try:
            if job.error:
                raise TransferError(f"{req.request_id}: {job.error}")
            if job.outbound is None:
                raise TransferError(f"{req.request_id}: no layer was pushed")
            if finished:  # nothing to decode: tell the decode side to let go
                self.sender.abort(job.outbound, "finished at the first token")
            else:
                self.sender.finish(job.outbound)
        except Exception as e:
            # Boundary: whatever broke, the router gets an answer, not a hang.
            if not isinstance(e, TransferError):
                log.exception("finishing the transfer of %s failed", req.request_id)
            error = str(e) if isinstance(e, TransferError) else f"{req.request_id}: {e!r}"
            failed = not job.aborted  # an abort while it finished is no transfer failure
        finally:
            self.leases.release(req.request_id)
            sent = job.outbound.bytes_sent if job.outbound is not None else 0
            self.loop.call(lambda: self._count_transfer(failed, sent))
        end_s = time.perf_counter()
        transfer_ms = (end_s - done_s) * 1e3
        total_ms = (end_s - job.outbound.started_s) * 1e3 if job.outbound is not None else 0.0
        queue_s = (req.first_token_s or done_s) - job.arrival_s - req.prefill_s
        result = PrefillResult(
            request_id=req.request_id,
            choices=choices,
            num_cached_tokens=req.num_cached_tokens,
            queue_ms=max(queue_s, 0.0) * 1e3,
            prefill_ms=req.prefill_s * 1e3,
            transfer_ms=transfer_ms,
            error=error,
            transfer_bytes=sent,
            transfer_total_ms=total_ms,
            prompt_logprobs=firsts[0].prompt_logprobs,  # choice 0 carries them
        )
        if not job.future.done():
            job.future.set_result(result)
