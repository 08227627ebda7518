"""The prefill side of a transfer: a lane per receiver, layer-by-layer pushes, leases.

`KVSender.start` opens a transfer for a ticket; the prefill worker calls `push_async` from the
engine's per-layer hook, so layer i's pages leave while layer i+1 computes; `finish` sends
what is left and waits for the receiver's acknowledgement. The prefill side keeps the source
blocks only until that acknowledgement or until the lease runs out (`SenderLeases`).

Each receiver has a lane (`_Lane`): its channel, and a thread that opens the channel and runs
that receiver's pushes and aborts, in order. What the engine thread calls (`start`,
`push_async`, `abort`) never touches the network, so a receiver that dies mid-handshake
(c10d's store client then retries its connect until its timeout, 10 s) or stops reading holds
up its own transfers only: not the prompt passes, and not the transfers to other receivers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache import PagedKVCache
from kv_transfer.transports.base import DEFAULT_TIMEOUT_S, SendChannel, Transport
from kv_transfer.wire import (
    BlockRun,
    TransferError,
    TransferRejected,
    abort_header,
    block_runs,
    check_layout,
    frame_regions,
    make_header,
)
from protos.pdserve.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_MAX_CHANNELS = 32

Job = Callable[[], None]


class _Lane:
    """One receiver: its channel, and the thread that opens it and runs its jobs in order.

    Jobs must not raise (a push records its error on its transfer). Once retired, the lane
    runs the jobs queued before, closes its channel and opens no other."""

    def __init__(self, address: str, name: str) -> None:
        self.address = address
        self.channel: SendChannel | None = None
        self._lock = threading.Lock()  # opening, dropping and closing the channel
        self._closed = False
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a bug in a job: the lane serves on
                log.exception("a KV lane job for %s failed", self.address)
        with self._lock:
            self._closed = True
            ch, self.channel = self.channel, None
        if ch is not None:
            ch.close()

    def open(self, connect: Callable[[str], SendChannel]) -> SendChannel:
        """The channel, connected on the calling thread when there is none: threads racing
        to one receiver share one channel, and a connect to one receiver never waits for a
        connect to another."""
        with self._lock:
            if self._closed:
                raise TransferError(f"the channel to {self.address} was closed")
            if self.channel is None:
                self.channel = connect(self.address)
            return self.channel

    def drop(self, channel: SendChannel) -> None:
        """Close `channel` if it is still the lane's (another thread may have rebuilt it
        since): the next use opens a new one."""
        with self._lock:
            if self.channel is not channel:
                return
            self.channel = None
        channel.close()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every job submitted before this call has run; False past `timeout_s`."""
        done = threading.Event()
        self._jobs.put(done.set)
        return done.wait(timeout_s)

    def retire(self) -> None:
        """Stop after the jobs queued so far (returns at once)."""
        self._jobs.put(None)

    def join(self, timeout_s: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(max(timeout_s, 0.0))


@dataclass
class OutboundTransfer:
    ticket: pb.TransferTicket
    src_block_ids: tuple[int, ...]
    lane: _Lane
    channel: SendChannel | None = None  # opened on the lane by the first push
    layers_sent: int = 0
    bytes_sent: int = 0
    started_s: float = field(default_factory=time.perf_counter)
    runs: list[BlockRun] = field(default_factory=list)  # coalesced once per transfer
    error: BaseException | None = None  # a background push failed; `finish` raises it
    aborted: bool = False  # no push runs after the abort frame

    @property
    def address(self) -> str:
        return self.ticket.channel_address


class KVSender:
    def __init__(
        self,
        cache: PagedKVCache,
        sender_id: str,
        transport: Transport,
        max_channels: int = DEFAULT_MAX_CHANNELS,
        layers_per_frame: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        assert max_channels >= 1 and layers_per_frame >= 1, "limits must be positive"
        self.cache = cache
        self.sender_id = sender_id
        self.transport = transport
        self.max_channels = max_channels
        self.layers_per_frame = layers_per_frame
        self.timeout_s = timeout_s
        self._lanes: OrderedDict[str, _Lane] = OrderedDict()
        self._lock = threading.Lock()

    def _lane(self, address: str) -> _Lane:
        """The receiver's lane, created on first use; the least recently used ones past
        `max_channels` retire (after their queued jobs)."""
        with self._lock:
            lane = self._lanes.get(address)
            if lane is not None:
                self._lanes.move_to_end(address)
                return lane
            lane = self._lanes[address] = _Lane(address, f"kv-push-{self.sender_id}")
            evicted = []
            while len(self._lanes) > self.max_channels:
                evicted.append(self._lanes.popitem(last=False)[1])
        for old in evicted:
            old.retire()
        return lane

    def _connect(self, address: str) -> SendChannel:
        return self.transport.connect(address, self.sender_id)

    def channel(self, address: str) -> SendChannel:
        """The receiver's channel, opened on the calling thread on first use."""
        return self._lane(address).open(self._connect)

    def connect(self, out: OutboundTransfer) -> SendChannel:
        """The transfer's channel, opened on the calling thread if no push opened it yet."""
        if out.channel is None:
            out.channel = out.lane.open(self._connect)
        return out.channel

    @property
    def num_channels(self) -> int:
        with self._lock:
            return sum(lane.channel is not None for lane in self._lanes.values())

    def start(self, ticket: pb.TransferTicket, src_block_ids: Sequence[int]) -> OutboundTransfer:
        """Check the ticket against this cache; the channel opens at the first push."""
        check_layout(ticket.layout, self.cache.spec, theirs_is="receiver", mine_is="sender")
        if len(src_block_ids) != len(ticket.dst_block_ids):
            raise TransferRejected(
                f"ticket has {len(ticket.dst_block_ids)} destination blocks "
                f"for {len(src_block_ids)} source blocks"
            )
        return OutboundTransfer(ticket, tuple(src_block_ids), self._lane(ticket.channel_address))

    def push_async(self, out: OutboundTransfer, layer_end: int) -> None:
        """`push` on the receiver's lane: the caller (the engine's layer hook, mid forward)
        only enqueues, so a slow or dead receiver never stalls the prompt pass."""

        def push() -> None:
            if out.error is None and not out.aborted:
                try:
                    self.push(out, layer_end)
                except BaseException as e:  # surfaced by `finish`
                    out.error = e

        out.lane.submit(push)

    def push(self, out: OutboundTransfer, layer_end: int, whole: bool = False) -> None:
        """Send layers [layers_sent, layer_end) in frames of `layers_per_frame` layers;
        `whole`: everything outstanding in one frame (nothing left to overlap with)."""
        if not out.runs:
            out.runs = block_runs(out.src_block_ids, out.ticket.dst_block_ids)
        runs = out.runs
        while out.layers_sent < layer_end:
            start = out.layers_sent
            end = layer_end if whole else min(start + self.layers_per_frame, layer_end)
            if end - start < self.layers_per_frame and layer_end < self.cache.num_layers:
                break  # wait until the group is complete
            header = make_header(
                out.ticket.request_id,
                out.ticket.transfer_id,
                self.cache.spec,
                start,
                end,
                out.src_block_ids,
                out.ticket.dst_block_ids,
                self.sender_id,
            )
            channel = self.connect(out)
            try:
                channel.send_frame(header, frame_regions(self.cache, start, end, runs, "src"))
            except TransferError:
                out.lane.drop(channel)  # rebuilt on next use
                raise
            out.layers_sent = end
            out.bytes_sent += header.payload_bytes

    def flush(self, out: OutboundTransfer, timeout_s: float | None = None) -> bool:
        """Wait until the pushes and aborts queued on the transfer's lane so far have run."""
        return out.lane.flush(self.timeout_s if timeout_s is None else timeout_s)

    def finish(self, out: OutboundTransfer, timeout_s: float | None = None) -> pb.TransferAck:
        """Send the rest and wait for the acknowledgement; raises TransferError on failure."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not self.flush(out, timeout_s):
            raise TransferError(
                f"transfer {out.ticket.transfer_id}: the pushes to {out.address} did not run "
                f"within {timeout_s:.1f} s"
            )
        if out.error is not None:
            if out.channel is not None:
                out.lane.drop(out.channel)
            raise TransferError(
                f"transfer {out.ticket.transfer_id}: push failed: {out.error!r}"
            ) from out.error
        self.push(out, self.cache.num_layers, whole=True)
        channel = self.connect(out)
        try:
            return channel.finish(out.ticket.transfer_id, timeout_s)
        except TransferError:
            # A transfer can fail alone (aborted, rejected, its lease ran out): the pair's
            # other transfers carry on. Only a channel that can carry no more frames is
            # dropped (and rebuilt on next use).
            if channel.broken:
                out.lane.drop(channel)
            raise

    def abort(self, out: OutboundTransfer, reason: str) -> None:
        """Tell the receiver to release its reservation (an explicit abort frame), on the
        transfer's lane after the pushes queued before it (none runs after it); returns at
        once."""
        out.aborted = True
        header = abort_header(out.ticket.request_id, out.ticket.transfer_id, reason, self.sender_id)

        def send_abort() -> None:
            try:
                self.connect(out).abort(header)
            except Exception:
                if out.channel is not None:
                    out.lane.drop(out.channel)

        out.lane.submit(send_abort)

    def send(self, ticket: pb.TransferTicket, src_block_ids: Sequence[int]) -> pb.TransferAck:
        """All layers at once (no overlap): start + finish."""
        return self.finish(self.start(ticket, src_block_ids))

    def close(self) -> None:
        """Retire every lane and wait (up to `timeout_s` in all) for their jobs and channels
        to end: a thread left running would keep this sender, its cache and its last transfer
        alive for as long as the process lives."""
        with self._lock:
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            lane.retire()
        deadline = time.monotonic() + self.timeout_s
        for lane in lanes:
            lane.join(deadline - time.monotonic())


class SenderLeases:
    """Source blocks kept for in-flight transfers, released on ack, abort or lease expiry."""

    def __init__(self, lease_s: float = 30.0) -> None:
        self.lease_s = lease_s
        self._held: dict[str, tuple[float, Callable[[], None]]] = {}
        self._lock = threading.Lock()

    def hold(
        self, request_id: str, release: Callable[[], None], lease_s: float | None = None
    ) -> None:
        deadline = time.monotonic() + (self.lease_s if lease_s is None else lease_s)
        with self._lock:
            assert request_id not in self._held, f"{request_id} already held"
            self._held[request_id] = (deadline, release)

    def release(self, request_id: str) -> bool:
        with self._lock:
            item = self._held.pop(request_id, None)
        if item is None:
            return False
        item[1]()
        return True

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            overdue = [rid for rid, (deadline, _) in self._held.items() if now > deadline]
        return [rid for rid in overdue if self.release(rid)]

    def __len__(self) -> int:
        return len(self._held)
