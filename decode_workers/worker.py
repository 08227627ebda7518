"""The decode worker: reservations, KV landing, and the continuous-batching token loop.

Plain class (tests build it without Ray); `decode_workers.actor` is the Ray adapter.

A disaggregated request arrives twice: `reserve` (blocks first, a ticket back) and, once the
prefill worker returned the first token, `start` (wait for the KV to land, then join the
running batch). A colocated or short request arrives once, through `submit`, and is
prefilled here. Tokens leave pushed to the router's sink (`pool_api.token_stream`: the
engine thread writes one frame per step and router), or, for a request placed without a
sink, through `poll`, a long poll per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import NoFreeBlocksError
from engine.engine import LLMEngine
from engine.request import FinishReason, Request, RequestOutput
from engine.sampling import TokenLogprob
from kv_transfer.receiver import KVReceiver
from kv_transfer.wire import TransferError
from pool_api import token_stream
from pool_api.config import WorkerConfig
from pool_api.messages import (
    DecodeStart,
    ReserveResult,
    Role,
    TokenBatch,
    TokenSink,
    WorkerRequest,
)
from pool_api.token_stream import SinkConnection
from pool_api.worker_common import WorkerBase

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Tokens produced for one request. Polled: kept until `take` (touched on the actor's
    loop). Pushed (`sink` set): each output goes straight out as a delta, from whichever
    thread produced it, and `forget` drops the stream once the last one went."""

    request: Request
    loop: asyncio.AbstractEventLoop
    sink: SinkConnection | None = None
    forget: Callable[[], None] | None = None  # pushed: runs on the loop after the last delta
    event: asyncio.Event = field(default_factory=asyncio.Event)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str = ""
    last_poll_s: float = field(default_factory=time.monotonic)  # opened, or last polled

    def delta(self, out: RequestOutput, error: str = "") -> token_stream.tspb.TokenDelta:
        """A pushed output as its wire delta; marks the stream finished with it."""
        if out.finished and not self.finished:
            self.finished = True
            self.loop.call_soon_threadsafe(self.forget or (lambda: None))
        r = self.request
        return token_stream.delta(
            TokenBatch(
                request_id=r.request_id,
                token_ids=out.new_token_ids,
                text=out.text_delta,
                logprobs=out.new_logprobs,
                finished=out.finished,
                finish_reason=out.finish_reason,
                num_cached_tokens=r.num_cached_tokens,
                error=error,
            )
        )

    def push(self, out: RequestOutput) -> None:
        if self.sink is not None:
            if not self.finished:
                self.sink.send(token_stream.frame([self.delta(out)]))
            return
        self.token_ids.extend(out.new_token_ids)
        self.text += out.text_delta
        self.logprobs.extend(out.new_logprobs)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
        self.event.set()

    def fail(self, error: str) -> None:
        if self.sink is not None:
            if not self.finished:
                out = RequestOutput(self.request.request_id, (), "", True, FinishReason.ABORT)
                self.sink.send(token_stream.frame([self.delta(out, error)]))
            return
        self.error = error
        self.finished = True
        self.finish_reason = FinishReason.ABORT
        self.event.set()

    def take(self) -> TokenBatch:
        r = self.request
        if self.sink is not None:  # the router's heartbeat: alive, nothing to hand over
            return TokenBatch(r.request_id, (), "", num_prompt_tokens=len(r.prompt_token_ids))
        batch = TokenBatch(
            request_id=r.request_id,
            token_ids=tuple(self.token_ids),
            text=self.text,
            logprobs=tuple(self.logprobs),
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=len(r.prompt_token_ids),
            num_output_tokens=len(r.output_token_ids),
            num_cached_tokens=r.num_cached_tokens,
            error=self.error,
            first_token_s=r.first_token_s,
        )
        self.token_ids, self.text, self.logprobs = [], "", []
        self.event.clear()
        return batch


class DecodeWorker(WorkerBase):
    default_role = Role.DECODE

    def __init__(self, cfg: WorkerConfig, engine: LLMEngine | None = None) -> None:
        super().__init__(cfg, engine)
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
        # request id -> (request, transfer id) awaiting its KV. Written on the engine thread
        # only; the actor loop only reads it.
        self.reserved: dict[str, tuple[Request, str]] = {}
        self.streams: dict[str, _Stream] = {}
        self._stream_reaper: asyncio.Task[None] | None = None
        self._sinks: dict[TokenSink, SinkConnection] = {}  # one connection per router
        self._sinks_lock = threading.Lock()
        self._actor_loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Lock | None = None  # made on the actor's loop
        self._start_loop()

    # ---- API -----------------------------------------------------------------------------
    async def reserve(self, r: WorkerRequest) -> ReserveResult:
        """Reserve the prompt's blocks (+1); no room now answers without a ticket.

        Blocks of the prompt's prefix that this worker still caches (an earlier turn decoded
        here) are shared, so the ticket asks the prefill side for the delta only."""

        def do() -> ReserveResult:
            req = self.engine.make_request(r.request_id, r.prompt_token_ids, r.params, r.cache_salt)
            try:
                ticket = self.receiver.reserve(
                    r.request_id, len(r.prompt_token_ids), prefix_hashes=req.block_hashes
                )
            except NoFreeBlocksError as e:
                return ReserveResult(None, self.engine.blocks.num_free_blocks, str(e))
            self.reserved[r.request_id] = (req, ticket.transfer_id)
            return ReserveResult(ticket.SerializeToString(), self.engine.blocks.num_free_blocks)

        return await self.loop.run(do)

    async def start(self, s: DecodeStart) -> None:
        """Wait for the transfer to land, then add the request to the running batch."""
        entry = self.reserved.get(s.request_id)
        if entry is None:
            raise TransferError(f"{s.request_id}: no reservation (aborted or expired)")
        req = entry[0]
        conn = await self._connect(s.sink)
        stream = self._open(req, conn)
        try:
            await asyncio.to_thread(self.receiver.wait, s.transfer_id, s.transfer_timeout_s)
        except TransferError as e:
            await self.loop.run(lambda: self.reserved.pop(s.request_id, None))
            stream.fail(str(e))
            return

        def admit() -> None:
            if self.reserved.pop(s.request_id, None) is None:
                return  # aborted while its KV landed: abort() freed it and ends the stream
            if self.receiver.take_if_complete(s.transfer_id) is None:  # its lease ran out
                stream.loop.call_soon_threadsafe(stream.fail, f"{s.request_id}: lease expired")
                return
            self.num_requests_total += 1
            out = self.engine.add_prefilled(req, s.first_token_id)
            if out.finished:  # the first token was already final (the router knows it)
                self._push(RequestOutput(out.request_id, (), "", True, out.finish_reason))

        await self.loop.run(admit)

    async def submit(self, r: WorkerRequest, sink: TokenSink | None = None) -> None:
        """Prefill here and decode (colocated mode, or a prompt under the local threshold)."""
        conn = await self._connect(sink)
        loop = asyncio.get_running_loop()

        def add() -> None:
            self.num_requests_total += 1
            req = self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.cache_salt)
            # its stream exists before the engine's next step can produce a token for it
            self._open(req, conn, loop)

        await self.loop.run(add)
        self._start_reaper()

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        """The request ended before decoding (finished at its first token, or failed)."""

        def release() -> None:
            self.reserved.pop(request_id, None)
            self.receiver.fail(transfer_id, "released by router")

        await self.loop.run(release)

    async def poll(self, request_id: str, timeout_s: float = 1.0) -> TokenBatch:
        """Tokens since the last poll; waits up to `timeout_s` for at least one."""
        stream = self.streams.get(request_id)
        if stream is None:
            return TokenBatch(
                request_id,
                (),
                "",
                finished=True,
                finish_reason=FinishReason.ABORT,
                error="unknown request",
            )
        stream.last_poll_s = time.monotonic()
        if stream.sink is not None:
            return stream.take()
        if not stream.token_ids and not stream.finished:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stream.event.wait(), timeout_s)
        stream.last_poll_s = time.monotonic()
        batch = stream.take()
        if batch.finished:
            self.streams.pop(request_id, None)
        return batch

    async def abort(self, request_id: str) -> bool:
        """End a request wherever it is here and free its blocks."""

        def do() -> bool:
            found = self.engine.abort(request_id)
            entry = self.reserved.pop(request_id, None)
            if entry is not None:
                self.receiver.fail(entry[1], "aborted")
                found = True
            return found

        found = await self.loop.run(do)
        stream = self.streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.push(RequestOutput(request_id, (), "", True, FinishReason.ABORT))
        return found

    def shutdown(self) -> None:
        if self._stream_reaper is not None:
            self._stream_reaper.cancel()
        with self._sinks_lock:
            for conn in self._sinks.values():
                conn.close()
        super().shutdown()
        self.receiver.close()
        self.endpoint.close()

    # ---- internals -----------------------------------------------------------------------
    def _open(
        self,
        req: Request,
        sink: SinkConnection | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> _Stream:
        """Register the request's stream (on the actor's loop, or on the engine thread
        before the request's first step; `loop` is then the actor's)."""
        rid = req.request_id
        stream = _Stream(req, loop or asyncio.get_running_loop(), sink)
        stream.forget = lambda: self._forget_stream(rid, stream)
        self.streams[rid] = stream
        if loop is None:
            self._start_reaper()
        return stream

    def _start_reaper(self) -> None:
        if self._stream_reaper is None:
            self._stream_reaper = asyncio.get_running_loop().create_task(self._reap_unpolled())

    def _forget_stream(self, rid: str, stream: _Stream) -> None:
        if self.streams.get(rid) is stream:
            del self.streams[rid]

    async def _connect(self, sink: TokenSink | None) -> SinkConnection | None:
        """The connection to `sink` (opened on first use, again after it broke). Requests
        arriving together wait for one connection: a second one, closed at once, would
        tell the router this worker's stream ended."""
        if sink is None:
            return None
        self._actor_loop = asyncio.get_running_loop()
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            with self._sinks_lock:
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
        with self._sinks_lock:
            conn = self._sinks.get(sink)
            if conn is not None and conn.closed:
                del self._sinks[sink]
        for rid, stream in list(self.streams.items()):
            if stream.sink is not None and stream.sink.sink == sink:
                await self.abort(rid)
                self.streams.pop(rid, None)

    async def _reap_unpolled(self) -> None:
        """Abort and drop streams nobody polled within `stream_idle_timeout_s`: their router
        died (or forgot them), and they would otherwise decode to `max_tokens` and keep their
        blocks and tokens for ever. Runs on the actor's loop, which owns `streams`."""
        idle_s = self.cfg.stream_idle_timeout_s
        while True:
            await asyncio.sleep(min(idle_s / 4, 1.0))
            now = time.monotonic()
            for rid, stream in list(self.streams.items()):
                if now - stream.last_poll_s > idle_s and self.streams.get(rid) is stream:
                    log.warning("%s: %s not polled for %.0f s: aborted", self.name, rid, idle_s)
                    await self.abort(rid)
                    self.streams.pop(rid, None)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self.streams.values()):
            stream.loop.call_soon_threadsafe(stream.fail, f"{self.name}: engine died: {error!r}")

    def _release_soon(self, request_id: str) -> None:
        """Any thread: the receiver let a reservation go; free its blocks on the engine
        thread, the blocks' one owner."""
        self.loop.call(lambda: self.engine.release(request_id))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: polled streams get theirs on the actor loop; pushed ones go out
        now, one frame per router for the whole step."""
        frames: dict[SinkConnection, list[token_stream.tspb.TokenDelta]] = {}
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if stream.sink is None:
                stream.loop.call_soon_threadsafe(stream.push, out)
            elif not stream.finished:
                frames.setdefault(stream.sink, []).append(stream.delta(out))
        for conn, deltas in frames.items():
            conn.send(token_stream.frame(deltas))

    def _push(self, out: RequestOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.push, out)

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
            "kv_bytes_received_total": float(self.receiver.bytes_received_total),
            "kv_blocks_shared_total": float(self.receiver.blocks_shared_total),
        }
