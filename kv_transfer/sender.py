"""The prefill side of a transfer: channels per receiver, layer-by-layer pushes, leases.

`KVSender.start` opens a transfer for a ticket; the prefill worker calls `push` from the
engine's per-layer hook, so layer i's pages leave while layer i+1 computes; `finish` sends
what is left and waits for the receiver's acknowledgement. The prefill side keeps the source
blocks only until that acknowledgement or until the lease runs out (`SenderLeases`).
"""

from __future__ import annotations

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

DEFAULT_MAX_CHANNELS = 32


@dataclass
class OutboundTransfer:
    ticket: pb.TransferTicket
    src_block_ids: tuple[int, ...]
    channel: SendChannel
    layers_sent: int = 0
    bytes_sent: int = 0
    started_s: float = field(default_factory=time.perf_counter)
    runs: list[BlockRun] = field(default_factory=list)  # coalesced once per transfer
    error: BaseException | None = None  # a background push failed; `finish` raises it


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
        self._channels: OrderedDict[str, SendChannel] = OrderedDict()
        # None stops the pusher (`close`)
        self._queue: queue.SimpleQueue[
            tuple[OutboundTransfer, int, threading.Event | None] | None
        ] = queue.SimpleQueue()
        self._pusher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()

    def channel(self, address: str) -> SendChannel:
        """The pair's channel, created on first use; least recently used ones are closed.

        Connecting is serialized, so threads racing to the same new address share one
        channel instead of each opening (and leaking) a pair of its own.
        """
        with self._lock:
            if address in self._channels:
                self._channels.move_to_end(address)
                return self._channels[address]
        with self._connect_lock:
            with self._lock:
                if address in self._channels:  # another thread connected meanwhile
                    self._channels.move_to_end(address)
                    return self._channels[address]
            ch = self.transport.connect(address, self.sender_id)
            evicted = []
            with self._lock:
                self._channels[address] = ch
                while len(self._channels) > self.max_channels:
                    evicted.append(self._channels.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return ch

    def drop_channel(self, address: str, channel: SendChannel | None = None) -> None:
        """Close the pair's channel (only if it is still `channel`, when given)."""
        with self._lock:
            ch = self._channels.get(address)
            if ch is None or (channel is not None and ch is not channel):
                return
            del self._channels[address]
        ch.close()

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    def start(self, ticket: pb.TransferTicket, src_block_ids: Sequence[int]) -> OutboundTransfer:
        """Check the ticket against this cache and open (or reuse) the pair's channel."""
        check_layout(ticket.layout, self.cache.spec, theirs_is="receiver", mine_is="sender")
        if len(src_block_ids) != len(ticket.dst_block_ids):
            raise TransferRejected(
                f"ticket has {len(ticket.dst_block_ids)} destination blocks "
                f"for {len(src_block_ids)} source blocks"
            )
        return OutboundTransfer(ticket, tuple(src_block_ids), self.channel(ticket.channel_address))

    def push_async(self, out: OutboundTransfer, layer_end: int) -> None:
        """`push` on the sender's own thread: the caller (the engine's layer hook, mid
        forward) only enqueues, so a slow channel never stalls the prompt pass."""
        if self._pusher is None:
            self._pusher = threading.Thread(
                target=self._push_loop, name=f"kv-push-{self.sender_id}", daemon=True
            )
            self._pusher.start()
        self._queue.put((out, layer_end, None))

    def _push_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            out, layer_end, done = item
            if done is not None:
                done.set()
                continue
            if out.error is None:
                try:
                    self.push(out, layer_end)
                except BaseException as e:  # surfaced by `finish`
                    out.error = e

    def _flush(self, out: OutboundTransfer) -> None:
        """Wait until every queued push of this sender has run."""
        if self._pusher is None:
            return
        done = threading.Event()
        self._queue.put((out, 0, done))
        done.wait()

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
            try:
                out.channel.send_frame(header, frame_regions(self.cache, start, end, runs, "src"))
            except TransferError:
                self.drop_channel(out.ticket.channel_address, out.channel)  # rebuilt on next use
                raise
            out.layers_sent = end
            out.bytes_sent += header.payload_bytes

    def finish(self, out: OutboundTransfer, timeout_s: float | None = None) -> pb.TransferAck:
        """Send the rest and wait for the acknowledgement; raises TransferError on failure."""
        self._flush(out)
        if out.error is not None:
            self.drop_channel(out.ticket.channel_address, out.channel)
            raise TransferError(
                f"transfer {out.ticket.transfer_id}: push failed: {out.error!r}"
            ) from out.error
        self.push(out, self.cache.num_layers, whole=True)
        try:
            return out.channel.finish(
                out.ticket.transfer_id, self.timeout_s if timeout_s is None else timeout_s
            )
        except TransferError:
            # A transfer can fail alone (aborted, rejected, its lease ran out): the pair's
            # other transfers carry on. Only a channel that can carry no more frames is
            # dropped (and rebuilt on next use).
            if out.channel.broken:
                self.drop_channel(out.ticket.channel_address, out.channel)
            raise

    def abort(self, out: OutboundTransfer, reason: str) -> None:
        """Tell the receiver to release its reservation (an explicit abort frame)."""
        self._flush(out)  # queued pushes first, so no frame follows the abort
        try:
            out.channel.abort(
                abort_header(out.ticket.request_id, out.ticket.transfer_id, reason, self.sender_id)
            )
        except Exception:
            self.drop_channel(out.ticket.channel_address, out.channel)

    def send(self, ticket: pb.TransferTicket, src_block_ids: Sequence[int]) -> pb.TransferAck:
        """All layers at once (no overlap): start + finish."""
        return self.finish(self.start(ticket, src_block_ids))

    def close(self) -> None:
        """Close every channel and end the pusher thread (after the pushes queued before):
        a thread left running would keep this sender, its cache and its last transfer alive
        for as long as the process lives."""
        if self._pusher is not None:
            self._queue.put(None)
            self._pusher.join(self.timeout_s)
            self._pusher = None
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for ch in channels:
            ch.close()


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
