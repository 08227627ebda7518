"""The decode worker: reservations, KV landing, and the continuous-batching token loop.

Plain class (tests build it without Ray); `decode_workers.actor` is the Ray adapter.

A disaggregated request arrives twice: `reserve` (blocks first, a ticket back) and, once the
prefill worker returned the first token, `start` (wait for the KV to land, then join the
running batch). A colocated or short request arrives once, through `submit`, and is
prefilled here. Tokens leave through `poll`, a long poll per request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import NoFreeBlocksError
from engine.engine import LLMEngine
from engine.loop import EngineLoop
from engine.request import Request, RequestOutput
from engine.sampling import TokenLogprob
from kv_transfer.config import WorkerConfig
from kv_transfer.index_feed import IndexFeed, IndexUpdate
from kv_transfer.messages import DecodeStart, ReserveResult, TokenBatch, WorkerRequest, WorkerStats
from kv_transfer.receiver import KVReceiver
from kv_transfer.transports.base import get_transport
from kv_transfer.wire import TransferError


@dataclass
class _Stream:
    """Tokens produced for one request and not yet polled (touched on the actor's loop)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str = ""

    def push(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text += out.text_delta
        self.logprobs.extend(out.new_logprobs)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason.value if out.finish_reason else None
        self.event.set()

    def fail(self, error: str) -> None:
        self.error = error
        self.finished = True
        self.finish_reason = "abort"
        self.event.set()

    def take(self) -> TokenBatch:
        r = self.request
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


class DecodeWorker:
    role = "decode"

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
        self.receiver = KVReceiver(
            self.engine.cache,
            self.engine.blocks,
            self.engine.lock,
            transfer_cfg.lease_s,
            transfer_cfg.transport,
        )
        self.endpoint = transport.listen(self.receiver, transfer_cfg.host)
        self.receiver.address = self.endpoint.address
        self.receiver.start_reaper()
        # request id -> (request, transfer id) awaiting its KV
        self.reserved: dict[str, tuple[Request, str]] = {}
        self.streams: dict[str, _Stream] = {}
        self.num_requests_total = 0
        self.loop = EngineLoop(self.engine, self._on_outputs, cfg.name, self._on_fatal)
        self.fatal_hook: Callable[[BaseException], None] | None = None  # the actor exits
        self.feed = IndexFeed(cfg.name, cfg.index, cfg.model_name, self.loop)

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
        stream = self._open(req)
        try:
            await asyncio.to_thread(self.receiver.wait, s.transfer_id, s.transfer_timeout_s)
        except TransferError as e:
            self.reserved.pop(s.request_id, None)
            stream.fail(str(e))
            return

        def admit() -> None:
            if self.reserved.pop(s.request_id, None) is None:
                return  # aborted while its KV landed: abort() freed it and ends the stream
            self.receiver.take(s.transfer_id)
            self.num_requests_total += 1
            out = self.engine.add_prefilled(req, s.first_token_id)
            if out.finished:  # the first token was already final (the router knows it)
                self._push(RequestOutput(out.request_id, (), "", True, out.finish_reason))

        await self.loop.run(admit)

    async def submit(self, r: WorkerRequest) -> None:
        """Prefill here and decode (colocated mode, or a prompt under the local threshold)."""

        def add() -> Request:
            self.num_requests_total += 1
            return self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, r.cache_salt)

        req = await self.loop.run(add)
        self._open(req)

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        """The request ended before decoding (finished at its first token, or failed)."""
        self.reserved.pop(request_id, None)
        self.receiver.fail(transfer_id, "released by router")

    async def poll(self, request_id: str, timeout_s: float = 1.0) -> TokenBatch:
        """Tokens since the last poll; waits up to `timeout_s` for at least one."""
        stream = self.streams.get(request_id)
        if stream is None:
            return TokenBatch(
                request_id, (), "", finished=True, finish_reason="abort", error="unknown request"
            )
        if not stream.token_ids and not stream.finished:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stream.event.wait(), timeout_s)
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
            stream.push(RequestOutput(request_id, (), "", True, None))
            stream.finish_reason = "abort"
        return found

    async def start_feed(self) -> None:
        """Start publishing block events (needs the caller's running event loop)."""
        self.feed.start()

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        """Block events since the last call (the router's in-memory index pulls these)."""
        return await self.feed.take(with_held)

    async def stats(self) -> WorkerStats:
        return await self.loop.run(self._stats)

    async def check_integrity(self) -> int:
        def check() -> int:
            with self.engine.lock:
                self.engine.blocks.check_integrity()
                return self.engine.blocks.num_used_blocks

        return await self.loop.run(check)

    def shutdown(self) -> None:
        self.feed.cancel()
        self.loop.stop()
        self.receiver.close()
        self.endpoint.close()

    # ---- internals -----------------------------------------------------------------------
    def _open(self, req: Request) -> _Stream:
        stream = _Stream(req, asyncio.get_running_loop())
        self.streams[req.request_id] = stream
        return stream

    def _on_fatal(self, error: BaseException) -> None:
        """The engine died: end every stream with the error, then let the actor be replaced."""
        for stream in list(self.streams.values()):
            stream.loop.call_soon_threadsafe(stream.fail, f"{self.name}: engine died: {error!r}")
        if self.fatal_hook is not None:
            self.fatal_hook(error)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._push(out)

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

    def _stats(self) -> WorkerStats:
        self._forget_lapsed()  # the router asks for stats a few times a second
        return WorkerStats.of_engine(
            self.name,
            self.role,
            self.engine,
            self.receiver.pending(),
            self.num_requests_total,
            extra={
                "kv_bytes_received_total": float(self.receiver.bytes_received_total),
                "kv_blocks_shared_total": float(self.receiver.blocks_shared_total),
            },
        )
