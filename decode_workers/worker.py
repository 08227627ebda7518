"""The decode worker: reservations, KV landing, and the continuous-batching token loop.

Plain class (tests build it without Ray); `decode_workers.actor` is the Ray adapter.

A disaggregated request arrives twice: `reserve` (blocks first, a ticket back) and, once the
prefill worker returned the first token, `start` (wait for the KV to land, then join the
running batch). A colocated or short request arrives once, through `submit`, and is
prefilled here. Tokens leave on the token stream (`pool_api.token_stream`): the engine thread
writes one frame per step and router. The router's `heartbeat`, about once a second per
request, is how each side learns the other is alive.

Who writes what (one owner per field; other threads hand work to it):

    state                                            owner            others hand work over by
    engine (its blocks too), reserved, _routes,      engine thread    `self.loop.call`
      num_requests_total, num_first_tokens_checked,
      num_grammar_rejections
    streams, _sinks, _stream_reaper, _connecting     the actor loop   `call_soon_threadsafe`
                                                                      (`_forget_stream`,
                                                                      `_abort_sink`)
    the receiver's reservations                      KVReceiver       its lock; block frees go
                                                                      to the engine thread

With `PDSERVE_CHECK_OWNERS=1` (the tests set it) each owner's methods assert their thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from engine.block_manager import NoFreeBlocksError
from engine.engine import LLMEngine
from engine.request import FinishReason, GrammarRejected, Request, RequestOutput
from engine.sampling import InvalidParameterError
from kv_transfer.receiver import KVReceiver
from kv_transfer.wire import TransferError
from pool_api import token_stream
from pool_api.config import WorkerConfig
from pool_api.messages import (
    DecodeStart,
    ReserveResult,
    Role,
    StatKey,
    TokenBatch,
    TokenSink,
    WorkerRequest,
)
from pool_api.token_stream import SinkConnection
from worker_common import WorkerBase, check_owner

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Actor loop: a request whose tokens go to a router, as its heartbeats see it."""

    sink: TokenSink  # which router
    last_heard_s: float = field(default_factory=time.monotonic)  # opened, or last heartbeat


@dataclass
class _Route:
    """Engine thread: where a running request's tokens go."""

    request: Request
    conn: SinkConnection
    last_sent_s: float = field(default_factory=time.monotonic)  # its last frame went out


def _delta(req: Request, out: RequestOutput, error: str = "") -> token_stream.tspb.TokenDelta:
    return token_stream.delta(
        TokenBatch(
            request_id=req.request_id,
            token_ids=out.new_token_ids,
            text=out.text_delta,
            logprobs=out.new_logprobs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            num_cached_tokens=req.num_cached_tokens,
            error=error,
            prompt_logprobs=out.prompt_logprobs,
            index=out.index,
        )
    )


def _ending(request_id: str) -> RequestOutput:
    """An output that ends a request's stream (every choice) with finish reason abort."""
    return RequestOutput(request_id, (), "", True, FinishReason.ABORT, last=True)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class DecodeWorker(WorkerBase):
    default_role = Role.DECODE

    def __init__(
        self,
        cfg: WorkerConfig,
        engine: LLMEngine | None = None,
        previous: WorkerBase | None = None,
    ) -> None:
        super().__init__(cfg, engine, previous)
        t = cfg.transfer
        self.receiver = KVReceiver(
            self.engine.cache,
            self.engine.blocks,
            lease_s=t.lease_s,
            transport=t.transport,
            release=self._release_soon,
        )
        self.endpoint = self.transport.listen(self.receiver, t.host)
        self.receiver.address = self.endpoint.address
        self.receiver.start_reaper()
        self.reserved: dict[str, tuple[Request, str]] = {}  # id -> (request, transfer id)
        # constrained requests whose token #1 (sampled by the prefill worker) this worker's
        # matcher accepted, and refused: it is checked, never recomputed
        self.num_first_tokens_checked = 0
        self.num_grammar_rejections = 0
        self._routes: dict[str, _Route] = {}
        self.streams: dict[str, _Stream] = {}
        self._stream_reaper: asyncio.Task[None] | None = None
        self._sinks: dict[TokenSink, SinkConnection] = {}  # one connection per router
        self._sinks_lock = threading.Lock()  # shutdown closes them from another thread
        self._actor_loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Lock | None = None  # made on the actor's loop
        self._start_loop()

    # ---- API (the actor's loop) ----------------------------------------------------------
    async def reserve(self, r: WorkerRequest) -> ReserveResult:
        """Reserve the prompt's blocks (+1); no room now answers without a ticket.

        Blocks of the prompt's prefix that this worker still caches (an earlier turn decoded
        here) are shared, so the ticket asks the prefill side for the delta only."""
        self.refuse_when_draining(r.request_id)
        grammar = await self.compile_grammar(r.params)

        def do() -> ReserveResult:
            self._on_engine_thread()
            req = self.engine.make_request(
                r.request_id, r.prompt_token_ids, r.params, r.cache_salt, grammar=grammar.grammar
            )
            try:
                ticket = self.receiver.reserve(
                    r.request_id, len(r.prompt_token_ids), prefix_hashes=req.block_hashes
                )
            except NoFreeBlocksError as e:
                return ReserveResult(None, self.engine.blocks.num_free_blocks, str(e))
            ticket.grammar_fingerprint = grammar.fingerprint
            self.reserved[r.request_id] = (req, ticket.transfer_id)
            return ReserveResult(ticket.SerializeToString(), self.engine.blocks.num_free_blocks)

        return await self.loop.run(do)

    async def start(self, s: DecodeStart) -> None:
        """Wait for the transfer to land, then add the request to the running batch. Its
        stream is open (heartbeats answered) from the start; a request that cannot join
        (its transfer failed, its lease ran out, it was aborted or never reserved here)
        ends on it with the reason."""
        conn = await self._connect(s.sink)
        self._open(s.request_id, s.sink)
        error = ""
        try:
            await asyncio.to_thread(self.receiver.wait, s.transfer_id, s.transfer_timeout_s)
        except TransferError as e:
            error = str(e)

        def admit() -> None:
            self._on_engine_thread()
            entry = self.reserved.pop(s.request_id, None)
            why = error
            if not why and entry is None:
                why = f"{s.request_id}: no reservation (aborted or expired)"
            if not why and self.receiver.take_if_complete(s.transfer_id) is None:
                why = f"{s.request_id}: lease expired"
            if why or entry is None:
                self._end_unrouted(s.request_id, conn, why)
                return
            req = entry[0]
            self.num_requests_total += 1
            try:
                outs = self.engine.add_prefilled(req, s.first_token_ids)
            except (GrammarRejected, InvalidParameterError) as e:
                self.num_grammar_rejections += isinstance(e, GrammarRejected)
                self._end_unrouted(s.request_id, conn, str(e))
                return
            if req.params.structured is not None:
                self.num_first_tokens_checked += 1  # the prefill side's, by this matcher
            self._routes[req.request_id] = _Route(req, conn)
            # Choices whose first token was already final end now (the router sent that
            # token from the prefill result, so their endings carry none).
            self._emit([replace(o, new_token_ids=(), text_delta="") for o in outs if o.finished])

        await self.loop.run(admit)

    async def submit(self, r: WorkerRequest, sink: TokenSink) -> None:
        """Prefill here and decode (colocated mode, or a prompt under the local threshold)."""
        self.refuse_when_draining(r.request_id)
        conn = await self._connect(sink)
        self._open(r.request_id, sink)

        grammar = await self.compile_grammar(r.params)

        def add() -> None:
            self._on_engine_thread()
            self.num_requests_total += 1
            req = self.engine.add_request(
                r.request_id, r.prompt_token_ids, r.params, r.cache_salt, grammar=grammar.grammar
            )
            # routed before the engine's next step can produce a token for it
            self._routes[req.request_id] = _Route(req, conn)

        await self.loop.run(add)

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        """The request ended before decoding (finished at its first token, or failed)."""

        def release() -> None:
            self._on_engine_thread()
            self.reserved.pop(request_id, None)
            self.receiver.fail(transfer_id, "released by router")

        await self.loop.run(release)

    async def heartbeat(self, request_id: str) -> bool:
        """The router's liveness check of a request's stream: True while this worker still
        holds it (its tokens keep coming on the stream); False once it ended or was never
        here (its last delta, if any, is on the stream)."""
        self._on_actor_loop()
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        stream.last_heard_s = time.monotonic()
        return True

    async def abort(self, request_id: str) -> bool:
        """The router's abort (its client asked, or left): end the request wherever it is
        here, free its blocks, and end its stream with finish reason abort."""
        return await self._end_here(request_id, "")

    async def _end_here(self, request_id: str, error: str) -> bool:
        """Abort a request; `error`: this worker ended it on its own (its router went
        silent), and its stream ends with that error, never as a normal-looking abort."""

        def do() -> bool:
            self._on_engine_thread()
            found = self.engine.abort(request_id)
            entry = self.reserved.pop(request_id, None)
            if entry is not None:
                self.receiver.fail(entry[1], error or "aborted")
                found = True
            self._emit([_ending(request_id)], error)
            return found

        return await self.loop.run(do)

    def _close_role(self) -> None:
        if self._stream_reaper is not None:
            # Dropped too: a task that ended cancelled keeps its CancelledError, whose
            # traceback holds the reaper's frame and so this worker (and its engine) alive.
            self._stream_reaper.cancel()
            self._stream_reaper = None
        with self._sinks_lock:
            for conn in self._sinks.values():
                conn.close()
        self.receiver.close()
        self.endpoint.close()

    def _end_all(self) -> int:
        """Every request here, running or reserved, ends (its stream with an error)."""
        self._on_engine_thread()
        ids = set(self._routes) | set(self.reserved)
        for rid in ids:
            self.engine.abort(rid)
            entry = self.reserved.pop(rid, None)
            if entry is not None:
                self.receiver.fail(entry[1], f"{self.name} is handing over")
        self._emit([_ending(rid) for rid in ids], f"{self.name} was drained before it ended")
        return len(ids)

    # ---- the actor loop's state ----------------------------------------------------------
    def _on_actor_loop(self) -> None:
        check_owner(self._actor_loop is None or _running_loop() is self._actor_loop, "actor loop")

    def _open(self, request_id: str, sink: TokenSink) -> None:
        self._on_actor_loop()
        self.streams[request_id] = _Stream(sink)
        if self._stream_reaper is None:
            self._stream_reaper = asyncio.get_running_loop().create_task(self._reap_unheard())

    def _forget_stream(self, request_id: str) -> None:
        """Its last delta went out (handed over by the engine thread)."""
        self._on_actor_loop()
        self.streams.pop(request_id, None)

    async def _connect(self, sink: TokenSink) -> SinkConnection:
        """The connection to `sink` (opened on first use, again after it broke). Requests
        arriving together wait for one connection: a second one, closed at once, would
        tell the router this worker's stream ended."""
        self._actor_loop = asyncio.get_running_loop()
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            conn = self._sinks.get(sink)
            if conn is None or conn.closed:
                conn = await asyncio.to_thread(SinkConnection, sink, self.name, self._sink_lost)
                with self._sinks_lock:
                    self._sinks[sink] = conn
            return conn

    def _sink_lost(self, sink: TokenSink, why: str) -> None:
        """Any thread: a router's connection broke (it died, or read nothing for long).
        Nobody will read its streams' tokens: abort them and free their blocks."""
        log.warning("%s: token stream to %s lost (%s)", self.name, sink.address, why)
        if self._actor_loop is not None:
            asyncio.run_coroutine_threadsafe(self._abort_sink(sink), self._actor_loop)

    async def _abort_sink(self, sink: TokenSink) -> None:
        self._on_actor_loop()
        conn = self._sinks.get(sink)
        if conn is not None and conn.closed:
            with self._sinks_lock:
                del self._sinks[sink]
        for rid, stream in list(self.streams.items()):
            if stream.sink == sink:
                await self._end_here(rid, f"{self.name}: the router's token stream was lost")
                self.streams.pop(rid, None)

    async def _reap_unheard(self) -> None:
        """Abort and drop streams whose router neither sent a heartbeat nor took a frame
        for `stream_idle_timeout_s`: it died (or forgot them), and they would otherwise
        decode to `max_tokens` and keep their blocks for ever. A stream whose frames flow
        needs no heartbeat (a router that stops reading loses its connection instead)."""
        idle_s = self.cfg.stream_idle_timeout_s
        period_s = min(idle_s / 4, 1.0)
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(period_s)
            if time.monotonic() - slept_from > period_s + idle_s / 2:
                # This process itself was frozen (SIGSTOP, a stalled host): the router's
                # silence is measured from what it sent, not across our own freeze.
                for stream in self.streams.values():
                    stream.last_heard_s = time.monotonic()
                continue
            sent = await self.loop.run(self._last_sent)
            now = time.monotonic()
            for rid, stream in list(self.streams.items()):
                heard_s = max(stream.last_heard_s, sent.get(rid, 0.0))
                if now - heard_s > idle_s and self.streams.get(rid) is stream:
                    log.warning("%s: %s not heard of for %.0f s: aborted", self.name, rid, idle_s)
                    why = f"{self.name}: its router was not heard of for {idle_s:.0f} s"
                    await self._end_here(rid, why)
                    self.streams.pop(rid, None)

    # ---- the engine thread's state -------------------------------------------------------
    def _on_engine_thread(self) -> None:
        check_owner(self.loop.on_its_thread(), "engine thread")

    def _emit(self, outputs: list[RequestOutput], error: str = "") -> None:
        """Engine thread: the outputs of routed requests go out, one frame per router; a
        finished request's route ends here, and its stream on the actor loop after it."""
        self._on_engine_thread()
        frames: dict[SinkConnection, list[token_stream.tspb.TokenDelta]] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            frames.setdefault(route.conn, []).append(_delta(route.request, out, error))
            route.last_sent_s = time.monotonic()
            if out.last:
                del self._routes[out.request_id]
                self._hand_to_actor_loop(out.request_id)
        for conn, deltas in frames.items():
            conn.send(token_stream.frame(deltas))

    def _end_unrouted(self, request_id: str, conn: SinkConnection, error: str) -> None:
        """Engine thread: end the stream of a request that never joined the batch."""
        self._on_engine_thread()
        ending = TokenBatch(request_id, (), "", finished=True, finish_reason=FinishReason.ABORT)
        conn.send(token_stream.frame([token_stream.delta(replace(ending, error=error))]))
        self._hand_to_actor_loop(request_id)

    def _last_sent(self) -> dict[str, float]:
        """Engine thread: when each routed request's last frame went out."""
        return {rid: route.last_sent_s for rid, route in self._routes.items()}

    def _hand_to_actor_loop(self, request_id: str) -> None:
        if self._actor_loop is not None:
            self._actor_loop.call_soon_threadsafe(self._forget_stream, request_id)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._emit(outputs)

    def _fail_all(self, error: BaseException) -> None:
        """Engine thread, the engine dead: every routed stream ends with the error."""
        ids = list(self._routes)
        self._emit([_ending(rid) for rid in ids], f"{self.name}: engine died: {error!r}")

    def _release_soon(self, request_id: str) -> None:
        """Any thread: the receiver let a reservation go; free its blocks on the engine
        thread, the blocks' one owner."""
        self.loop.call(lambda: self.engine.release(request_id))

    def _forget_lapsed(self) -> None:
        """Drop reservations the receiver no longer knows (its lease ran out and freed the
        blocks) that nobody will `start` or release, e.g. because their router died."""
        for request_id, (_, transfer_id) in list(self.reserved.items()):
            if self.receiver.get(transfer_id) is None:
                self.reserved.pop(request_id, None)

    def _num_reserved(self) -> int:
        self._forget_lapsed()  # the router asks for stats a few times a second
        return self.receiver.pending()

    def _extra_stats(self) -> dict[str, float]:
        return {
            StatKey.KV_BYTES_RECEIVED_TOTAL.value: float(self.receiver.bytes_received_total),
            StatKey.KV_BLOCKS_SHARED_TOTAL.value: float(self.receiver.blocks_shared_total),
            StatKey.GRAMMAR_FIRST_TOKENS_CHECKED_TOTAL.value: float(self.num_first_tokens_checked),
            StatKey.GRAMMAR_REJECTIONS_TOTAL.value: float(self.num_grammar_rejections),
        }
