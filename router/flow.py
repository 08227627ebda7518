"""One request's prefill/decode protocol, from placement to its last token.

Disaggregated (docs/architecture.md): reserve KV blocks on a decode worker
(`router.reservation`); run the prompt pass on a prefill worker, which pushes the KV straight
into the reserved blocks; send the first token at once; start the decode worker on it and
relay its tokens until a stop: pushed by the worker to the router's token sink
(`router.token_sink`), with a Ray heartbeat about once a second while none come. Local
(colocated mode, a short uncached prompt, or no healthy prefill worker under the `recompute`
policy): the decode worker runs both phases.

A prefill worker that dies under a request is marked down; under `recompute` the request
is placed again (another pair, or locally), under `fail` it ends UNAVAILABLE.

What ends a request, by type: `RequestFailed` (its status), `RequestAborted` (the client's
abort: finish reason abort), `InvalidParameterError` (a worker refused it: INVALID_ARGUMENT),
`WorkerUnavailable` or `TransferError` (a worker died or a transfer broke: UNAVAILABLE, and
only these mark a worker down). Anything else is a bug: INTERNAL, logged once with its
traceback and the request id, and no worker is blamed for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Protocol

import grpc

from engine.prefix_hash import reusable_prefix_hashes
from engine.request import FinishReason
from engine.sampling import InvalidParameterError, TokenLogprob
from kv_transfer.wire import TransferError
from pool_api.messages import DecodeStart, PrefillResult, PrefillTask, TokenBatch, TokenSink
from pool_api.prefix_index import PrefixIndex
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import kv_transfer_pb2 as kvpb
from router.active import ActiveRequest, RequestAborted, RequestFailed
from router.clients import (
    DecodeClient,
    PrefillClient,
    WorkerDraining,
    WorkerUnavailable,
    quietly,
)
from router.config import RouterConfig
from router.pools import Pool, WorkerLoad, overflow_worker
from router.race import Lost, first_of
from router.reservation import Reserver
from router.token_sink import PushedStream, StreamLost, TokenSinkServer

log = logging.getLogger(__name__)

# Times a request is placed again because the worker chosen refused it (it started to drain
# since the router last heard from it); each refusal marks that worker as draining.
_REFUSALS = 3
# A prefill result may come this long after its ticket's lease ran out (clocks of two nodes,
# the decode side's reaper period) before the router stops waiting for it.
_LEASE_GRACE_S = 2.0


class DecodeWorkerSilent(WorkerUnavailable):
    """The decode worker a prompt pass was sending its KV to was found silent (frozen):
    the request is placed again on another pair; the silent worker's lease frees what it
    reserved once it wakes."""


class PrefillTimedOut(TransferError):
    """The prompt pass and its transfer outlasted the ticket's lease: the prefill side's
    fault (stuck or overloaded), never counted against the decode worker."""


# A pushed request its worker no longer knows may still have its last delta on the wire
# (frames and Ray replies travel apart): wait this long for it before failing the request.
_LAST_DELTA_GRACE_S = 2.0

Responses = AsyncIterator[gen.GenerateResponse]


class Responder(Protocol):
    """Turns what a request sends into responses, keeping the router's books (metrics,
    the queue count)."""

    def chunk(
        self,
        act: ActiveRequest,
        ids: Sequence[int],
        text: str,
        logprobs: Sequence[TokenLogprob],
        prompt_logprobs: Sequence[TokenLogprob | None] = (),
        index: int = 0,
        finish: FinishReason | None = None,
    ) -> gen.GenerateResponse: ...

    def complete(self, act: ActiveRequest, reason: FinishReason) -> gen.GenerateResponse: ...


class RequestFlow:
    def __init__(
        self,
        cfg: RouterConfig,
        prefill: Pool[PrefillClient],
        decode: Pool[DecodeClient],
        index: PrefixIndex,
        model_info: gen.ModelInfo,
        reserver: Reserver,
        responder: Responder,
        colocated: bool,
        sinks: TokenSinkServer,
    ) -> None:
        self.cfg = cfg
        self.prefill = prefill
        self.decode = decode
        self.index = index
        self.model_info = model_info
        self.reserver = reserver
        self.out = responder
        self.colocated = colocated
        self.sinks = sinks

    def block_hashes(self, act: ActiveRequest) -> list[int]:
        """The prompt's chained block hashes that a prefix hit could reuse."""
        r = act.request
        return reusable_prefix_hashes(
            r.prompt_token_ids,
            self.model_info.block_size,
            self.model_info.model_fingerprint,
            r.cache_salt,
        )

    async def run(self, act: ActiveRequest) -> Responses:
        """Drive one admitted request; every failure ends as RequestFailed (or an abort)."""
        try:
            matches = await self.index.lookup(self.block_hashes(act))
            for attempt in range(_REFUSALS):
                local = self._local_worker(act, matches)
                stream = (
                    self._local(act, matches, local)
                    if local is not None
                    else self._disaggregated(act, matches)
                )
                try:
                    async for resp in stream:
                        yield resp
                    return
                except WorkerDraining as e:
                    if act.first_sent_s is not None or attempt == _REFUSALS - 1:
                        raise
                    log.info("%s: placed again: %s", act.request_id, e)
                    self._forget_placement(act)
        except RequestFailed as e:
            act.failure = e.code  # for the books: Router.finish counts it as failed
            raise
        except RequestAborted:
            yield self.out.complete(act, FinishReason.ABORT)
        except InvalidParameterError as e:  # a worker refused it (e.g. its id still runs there)
            act.failure = grpc.StatusCode.INVALID_ARGUMENT
            raise RequestFailed(act.failure, f"{e.field}: {e.message}") from e
        except (WorkerUnavailable, TransferError) as e:
            if act.aborted:
                yield self.out.complete(act, FinishReason.ABORT)
                return
            act.failure = grpc.StatusCode.UNAVAILABLE
            what = "KV transfer failed" if isinstance(e, TransferError) else "worker unavailable"
            raise RequestFailed(act.failure, f"{what}: {e}") from e
        except Exception as e:
            # The request path's one boundary for bugs: whatever else went wrong is ours,
            # not a worker's. Logged here once with its traceback; no worker is marked down.
            act.failure = grpc.StatusCode.INTERNAL
            log.exception("internal error on request %s", act.request_id)
            raise RequestFailed(
                act.failure,
                f"internal error ({type(e).__name__}) on request {act.request_id}; "
                "the server log has its traceback",
            ) from e
        finally:
            act.done = True
            self.sinks.close(act.request_id)

    def _forget_placement(self, act: ActiveRequest) -> None:
        """Its worker refused it before it started there: as if it had not been placed."""
        self.sinks.close(act.request_id)
        for w in (act.prefill, act.decode):
            if w is not None:
                w.untrack(act.request_id)
        if act.decode is not None:
            act.decode.draining = True
        act.prefill = act.decode = None

    def _push_to(self, act: ActiveRequest, decode_worker: WorkerLoad[DecodeClient]) -> TokenSink:
        """Open the request's pushed stream before the worker can send to it."""
        assert self.sinks.sink is not None, "the router's token sink is not started"
        act.pushed = self.sinks.open(act.request_id, decode_worker.name)
        return self.sinks.sink

    def _local_worker(
        self, act: ActiveRequest, matches: dict[str, int]
    ) -> WorkerLoad[DecodeClient] | None:
        """The decode worker to prefill this prompt on itself, or None to disaggregate.

        Locally: colocated mode; few uncached tokens on the decode worker holding the
        longest prefix (conditional disaggregation); a busy prefill pool
        (`pools.overflow_worker`); or the whole prefill pool down with policy `recompute`
        (`fail` ends the request here)."""
        best = self.decode.best_match(matches)
        bs, n = self.model_info.block_size, act.num_prompt_tokens
        cached = best.cached_tokens(matches, bs) if best else 0
        if self.colocated or n - cached <= self.cfg.policy.local_prefill_threshold:
            act.placement = "colocated" if self.colocated else "short_prompt"
            return best or self._pick_decode()
        if prefill := self.prefill.routable():
            limit = self.cfg.policy.prefill_overflow_tokens
            decode_worker = overflow_worker(prefill, self.decode.routable(), matches, n, bs, limit)
            act.placement = "disaggregated" if decode_worker is None else "overflow"
            return decode_worker
        if self.cfg.policy.prefill_failure_policy == "fail":
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        act.placement = "no_prefill_worker"
        return best or self._pick_decode()

    async def _local(
        self, act: ActiveRequest, matches: dict[str, int], decode_worker: WorkerLoad[DecodeClient]
    ) -> Responses:
        """Prefill and decode on `decode_worker`; its prompt tokens count as that worker's
        outstanding prefill work until the first token comes back (what `overflow_worker`
        weighs)."""
        act.decode = decode_worker
        decode_worker.track(act.request_id)
        todo = act.num_prompt_tokens - decode_worker.cached_tokens(
            matches, self.model_info.block_size
        )
        passed = decode_worker.prompt_pass(todo)
        try:
            await decode_worker.client.submit(act.request, self._push_to(act, decode_worker))
            act.timings.queue_ms = (time.perf_counter() - act.arrival_s) * 1e3
            async for resp in self._relay(act, decode_worker):
                passed()
                yield resp
        finally:
            passed()

    async def _disaggregated(self, act: ActiveRequest, matches: dict[str, int]) -> Responses:
        while (got := await self._prefill_on_pair(act, matches)) is None:
            # Its prefill worker died and the policy is `recompute`: place it again.
            if act.aborted:
                yield self.out.complete(act, FinishReason.ABORT)
                return
            if not self.prefill.routable():
                act.placement = "no_prefill_worker"
                async for resp in self._local(act, {}, self._pick_decode()):
                    yield resp
                return
        decode_worker, res = got
        if res.error or res.finished:
            await quietly(
                partial(decode_worker.client.release_reservation, act.request_id, act.transfer_id),
                "release_reservation",
                decode_worker.name,
            )
        if res.error:
            if act.aborted:
                yield self.out.complete(act, FinishReason.ABORT)
                return
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {res.error}")
        multi = act.num_seqs > 1
        for i, c in enumerate(res.choices):
            yield self.out.chunk(
                act,
                (c.token_id,),
                c.text,
                (c.logprob,) if c.logprob else (),
                res.prompt_logprobs if i == 0 else (),
                index=i,
                finish=c.finish_reason if multi else None,  # n = 1: the completion says it
            )
        if res.finished:
            yield self.out.complete(act, res.choices[0].finish_reason or FinishReason.STOP)
            return
        sink = self._push_to(act, decode_worker)
        await decode_worker.client.start(
            DecodeStart(act.request_id, act.transfer_id, res.first_token_ids, sink=sink)
        )
        async for resp in self._relay(act, decode_worker):
            yield resp

    async def _prefill_on_pair(
        self, act: ActiveRequest, matches: dict[str, int]
    ) -> tuple[WorkerLoad[DecodeClient], PrefillResult] | None:
        """Reserve, then prefill into the reservation. None: the prefill worker died and the
        request may be placed again (its reservation is released)."""
        rsv = await self.reserver.reserve(act, matches)
        act.decode, act.transfer_id = rsv.decode, rsv.transfer_id
        act.timings.queue_ms = rsv.queue_ms
        n, bs = act.num_prompt_tokens, self.model_info.block_size
        if not rsv.prefill.routable and not self.prefill.routable():
            # The whole prefill pool went down since the pair was ranked: let the blocks go
            # and place the request again (locally under `recompute`).
            await self._release_pair(act, rsv.decode)
            self._fail_under_policy(act, "no healthy prefill worker")
            return None
        prefill_worker = (
            rsv.prefill if rsv.prefill.routable else self.prefill.pick_prefill(matches, n, bs)
        )
        act.prefill = prefill_worker
        try:
            with prefill_worker.prefilling(act.request_id, n):
                res = await self._prefill(prefill_worker, act, rsv.ticket, rsv.decode)
        except PrefillTimedOut:
            self._transfer_done(act, prefill_worker, None, ok=False)
            raise
        except TransferError:
            self._transfer_done(act, prefill_worker, rsv.decode, ok=False)
            raise
        except WorkerDraining as e:  # it refused the pass (it drains): on another pair
            log.info("%s: placed again: %s", act.request_id, e)
            prefill_worker.draining = True
            await self._release_pair(act, rsv.decode)
            return None
        except DecodeWorkerSilent as e:
            log.warning("%s: placed again: %s", act.request_id, e)
            await quietly(
                partial(prefill_worker.client.abort, act.request_id), "abort", prefill_worker.name
            )
            rsv.decode.untrack(act.request_id)
            act.prefill = act.decode = None
            return None
        except WorkerUnavailable as e:  # the prefill worker died (or its actor is gone)
            await self._prefill_failed(act, prefill_worker, rsv.decode, e)
            return None
        self._transfer_done(act, prefill_worker, rsv.decode, ok=not res.error)
        act.cached_tokens = res.num_cached_tokens
        t = act.timings
        t.queue_ms = (t.queue_ms or 0.0) + res.queue_ms
        t.prefill_ms, t.transfer_ms = res.prefill_ms, res.transfer_ms
        t.transfer_total_ms = res.transfer_total_ms or None
        act.kv_transfer_bytes = res.transfer_bytes
        return rsv.decode, res

    @staticmethod
    def _transfer_done(
        act: ActiveRequest,
        prefill_worker: WorkerLoad[PrefillClient],
        decode_worker: WorkerLoad[DecodeClient] | None,
        ok: bool,
    ) -> None:
        """Both ends of the pair learn how the transfer went (an abort says nothing; None:
        the decode side is not to blame)."""
        if not act.aborted:
            prefill_worker.transfer_done(ok)
            if decode_worker is not None:
                decode_worker.transfer_done(ok)

    async def _prefill(
        self,
        prefill_worker: WorkerLoad[PrefillClient],
        act: ActiveRequest,
        ticket: bytes,
        decode_worker: WorkerLoad[DecodeClient],
    ) -> PrefillResult:
        """The prompt pass and its transfer, waited for no longer than the ticket's lease
        (past it the decode side has let the blocks go, so whatever the prefill worker still
        does cannot land; the caller's cleanup aborts it there), nor past the decode worker
        being found silent (its KV would land in a frozen process)."""
        lease = kvpb.TransferTicket.FromString(ticket).deadline_unix_ms / 1e3 - time.time()
        got = await first_of(
            prefill_worker.client.prefill(PrefillTask(act.request, ticket)),
            decode_worker.client.until_silent(),
            max(lease, 0.0) + _LEASE_GRACE_S,
        )
        if got is Lost.SIGNAL:
            raise DecodeWorkerSilent(f"{decode_worker.name} was found silent during the transfer")
        if got is Lost.TIMEOUT:
            raise PrefillTimedOut(
                f"{prefill_worker.name} did not finish the transfer within its lease"
            )
        return got

    async def _prefill_failed(
        self,
        act: ActiveRequest,
        prefill_worker: WorkerLoad[PrefillClient],
        decode_worker: WorkerLoad[DecodeClient],
        error: WorkerUnavailable,
    ) -> None:
        """A prefill worker died under this request: release its reservation, then fail it
        (policy `fail`, unless it was aborted meanwhile) or let the caller place it again."""
        prefill_worker.mark_silent("its prefill failed")
        log.warning(
            "prefill worker %s failed on %s: %s", prefill_worker.name, act.request_id, error
        )
        await self._release_pair(act, decode_worker)
        self._fail_under_policy(act, f"prefill worker {prefill_worker.name} died: {error}")

    async def _release_pair(
        self, act: ActiveRequest, decode_worker: WorkerLoad[DecodeClient]
    ) -> None:
        """Let the request's reservation go: it will be placed again, or fail."""
        await quietly(
            partial(decode_worker.client.release_reservation, act.request_id, act.transfer_id),
            "release_reservation",
            decode_worker.name,
        )
        decode_worker.untrack(act.request_id)
        act.prefill = act.decode = None

    def _fail_under_policy(self, act: ActiveRequest, why: str) -> None:
        """Policy `fail` ends a request that lost its prefill side (unless it was aborted
        meanwhile); `recompute` lets the caller place it again."""
        if not act.aborted and self.cfg.policy.prefill_failure_policy == "fail":
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, why)

    def _pick_decode(self) -> WorkerLoad[DecodeClient]:
        order = self.decode.decode_order()
        if not order:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        return order[0]

    async def _relay(
        self, act: ActiveRequest, decode_worker: WorkerLoad[DecodeClient]
    ) -> Responses:
        rid = act.request_id
        decode_ended: set[int] = set()  # choices the decode worker itself ended
        try:
            while True:
                try:
                    assert act.pushed is not None, "its stream is opened before the worker is"
                    batch = await self._next_pushed(act, decode_worker, act.pushed)
                except WorkerUnavailable as e:  # the decode worker died: its streams end here
                    if act.aborted:
                        yield self.out.complete(act, FinishReason.ABORT)
                        return
                    decode_worker.mark_silent("its stream failed")
                    raise RequestFailed(
                        grpc.StatusCode.UNAVAILABLE, f"decode worker {decode_worker.name} lost: {e}"
                    ) from e
                if batch.error and not act.aborted:
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, batch.error)
                if batch.num_cached_tokens:
                    act.cached_tokens = batch.num_cached_tokens
                reason = (batch.finish_reason or FinishReason.STOP) if batch.finished else None
                if reason is not None and (act.aborted or reason is FinishReason.ABORT):
                    reason = FinishReason.ABORT  # an abort ends every choice
                elif act.num_seqs > 1:
                    out = await self._choice_step(act, batch, reason, decode_ended, decode_worker)
                    for resp in out:
                        yield resp
                    if act.all_ended:
                        return
                    continue
                if (batch.token_ids or batch.text) and act.num_seqs == 1:
                    yield self.out.chunk(
                        act, batch.token_ids, batch.text, batch.logprobs, batch.prompt_logprobs
                    )
                if reason is not None:
                    yield self.out.complete(act, reason)
                    return
        finally:
            decode_worker.untrack(rid)

    async def _choice_step(
        self,
        act: ActiveRequest,
        batch: TokenBatch,
        reason: FinishReason | None,
        decode_ended: set[int],
        decode_worker: WorkerLoad[DecodeClient],
    ) -> list[gen.GenerateResponse]:
        """n > 1: a choice's tokens, its finish reason on its last chunk, and the completion
        once every choice ended. A choice that already ended (its first token did, as the
        prefill result said) sends nothing more."""
        out = []
        if reason is not None:
            decode_ended.add(batch.index)
        fresh = batch.index not in act.choices_ended
        if fresh and (batch.token_ids or batch.text or reason is not None):
            out.append(
                self.out.chunk(
                    act,
                    batch.token_ids,
                    batch.text,
                    batch.logprobs,
                    batch.prompt_logprobs,
                    index=batch.index,
                    finish=reason,
                )
            )
        if act.all_ended:
            if len(decode_ended) < act.num_seqs:
                # a choice the prefill result ended still runs there (the two sides' limits
                # differ): let it go rather than decode it for nobody
                rid, name = act.request_id, decode_worker.name
                await quietly(partial(decode_worker.client.abort, rid), "abort", name)
            out.append(self.out.complete(act, act.choices_ended[0]))
        return out

    async def _next_pushed(
        self, act: ActiveRequest, decode_worker: WorkerLoad[DecodeClient], stream: PushedStream
    ) -> TokenBatch:
        """The next batch the worker pushed. Every `heartbeat_s` without one, or when its
        connection ended, a heartbeat asks the worker (over Ray) whether the request still
        lives there: a dead worker raises, a forgotten request ends in its error."""
        while True:
            item = await stream.get(self.cfg.heartbeat_s)
            if isinstance(item, TokenBatch):
                return item
            if isinstance(item, StreamLost):
                # Nearly always its process died (Ray may hold calls to it until a restart):
                # out of rotation now; a probe brings it back.
                decode_worker.mark_down(f"its token stream ended ({item.reason})")
            # A heartbeat has a short deadline of its own (clients.HEARTBEAT_DEADLINE_S): a
            # worker that hangs does not get to hold the request.
            alive = await decode_worker.client.heartbeat(act.request_id)
            if alive:
                continue  # nothing new
            item = await stream.get(_LAST_DELTA_GRACE_S)
            if isinstance(item, TokenBatch):
                return item
            lost = f" ({item.reason})" if isinstance(item, StreamLost) else ""
            return TokenBatch(
                act.request_id,
                (),
                "",
                finished=True,
                finish_reason=FinishReason.ABORT,
                error=f"decode worker {decode_worker.name} lost the request's token stream{lost}",
            )
