"""The decode side of a transfer: reservations, header checks, completion, leases.

Rules (docs/lifecycle.md):

* `reserve` allocates the destination blocks first and returns a ticket; nothing can arrive
  for a transfer id that was not reserved.
* `begin_frame` validates a header against this cache and the reservation *before* a byte is
  written and returns the destination regions; a failure raises `TransferRejected`.
* A reservation ends exactly once: taken by the engine once COMPLETE (every layer of every
  prompt block landed; the engine takes the blocks over), or FAILED (abort, peer death, bad
  frame, lease expiry; the blocks are freed). A COMPLETE reservation nobody takes within a
  lease of its completion (its router died before `start`) fails too, so no state holds
  blocks for ever. Blocks are never freed while a frame is being written into them: a
  failure during a frame frees them when that frame ends.
* Frames for an unknown, finished or failed transfer id are rejected, so late bytes never
  reach blocks that a new request owns.

Who writes what:

    state                                         written by
    _by_transfer (every Reservation in it),       any thread, under `lock` (transport
      bytes_received_total, blocks_shared_total     threads, the reaper, the decode worker)
    the block manager                             its owner only: the decode worker's
                                                    engine thread (see below)
    the pages a frame lands in                    the transport thread writing that frame,
                                                    between `begin_frame` and `end_frame`

Blocks belong to one owner: with a `release` callback (the decode worker's), the receiver
never frees a block itself but hands the request id to `release`, which frees it on the
engine thread, as vLLM's connectors report finished transfers through `get_finished`.
Without one (standalone use), blocks are freed at once under `lock`. `reserve` and `take`
run where the blocks' owner runs (the decode worker calls them on its engine thread).
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import ceil_div
from engine.kv_cache import PagedKVCache
from kv_transfer.wire import (
    TransferError,
    TransferRejected,
    block_runs,
    check_layout,
    frame_regions,
    layout_to_pb,
    payload_bytes,
)
from protos.pdserve.v1 import kv_transfer_pb2 as pb

DEFAULT_LEASE_S = 30.0


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass
class Reservation:
    request_id: str
    transfer_id: str
    dst_block_ids: tuple[int, ...]  # prompt blocks first_block.., in prompt order
    num_tokens: int
    deadline_s: float  # time.monotonic() after which the lease expires (RESERVED, then COMPLETE)
    first_block: int = 0  # blocks before it were already cached here (shared, not sent)
    state: ReservationState = ReservationState.RESERVED
    error: str = ""
    in_flight: int = 0  # frames currently writing into the blocks
    received: set[tuple[int, int]] = field(default_factory=set)  # (layer, dst block)
    bytes_received: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class KVReceiver:
    def __init__(
        self,
        cache: PagedKVCache,
        blocks: BlockManager,
        lock: threading.RLock | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        transport: str = "",
        address: str = "",
        release: Callable[[str], None] | None = None,
    ) -> None:
        self.cache = cache
        self.blocks = blocks
        self.lock = lock or threading.RLock()
        # Frees a failed reservation's blocks (by request id) on the blocks' owner thread;
        # callable from any thread. None: free them here, at once.
        self._release = release
        self.lease_s = lease_s
        self.transport = transport
        self.address = address
        self._by_transfer: dict[str, Reservation] = {}
        self._reaper: threading.Thread | None = None
        self._closed = threading.Event()
        # Lifetime counters (worker stats): payload bytes landed, and prompt blocks a
        # reservation shared from this cache instead of receiving them.
        self.bytes_received_total = 0
        self.blocks_shared_total = 0

    # ---- reservations --------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        extra_tokens: int = 1,
        lease_s: float | None = None,
        prefix_hashes: Sequence[int] = (),
    ) -> pb.TransferTicket:
        """Allocate blocks for `num_tokens` (+ `extra_tokens` of decode room) and ticket them.

        `prefix_hashes` are the prompt's full-block hashes: blocks this cache already holds
        under them are shared (by reference), and the ticket asks only for the rest
        (`first_block`), so a follow-up turn moves only its delta. The prompt's last block is
        never matched, so every transfer carries at least one block (the sender's first
        token comes with it). Raises engine.block_manager.NoFreeBlocksError when the pool
        cannot hold them now.
        """
        lease = self.lease_s if lease_s is None else lease_s
        bs = self.cache.block_size
        num_blocks = ceil_div(num_tokens, bs)
        usable = list(prefix_hashes[: max(num_blocks - 1, 0)])
        with self.lock:
            alloc = self.blocks.allocate(request_id, usable, num_tokens + extra_tokens)
            first = alloc.num_cached_tokens // bs
            ids = alloc.block_ids[first:num_blocks]
            self.blocks_shared_total += first
            res = Reservation(
                request_id, uuid.uuid4().hex, ids, num_tokens, time.monotonic() + lease, first
            )
            self._by_transfer[res.transfer_id] = res
        return pb.TransferTicket(
            request_id=request_id,
            transfer_id=res.transfer_id,
            dst_block_ids=list(ids),
            transport=self.transport,
            channel_address=self.address,
            deadline_unix_ms=int((time.time() + lease) * 1000),
            layout=layout_to_pb(self.cache.spec),
            num_tokens=num_tokens,
            first_block=first,
        )

    def get(self, transfer_id: str) -> Reservation | None:
        with self.lock:
            return self._by_transfer.get(transfer_id)

    def pending(self) -> int:
        with self.lock:
            return len(self._by_transfer)

    # ---- frames --------------------------------------------------------------------------
    def begin_frame(self, header: pb.KVFrameHeader) -> tuple[Reservation, list[torch.Tensor]]:
        """Validate `header`; on success the caller writes the payload into the regions."""
        with self.lock:
            res = self._by_transfer.get(header.transfer_id)
            if res is None or res.state is not ReservationState.RESERVED:
                raise TransferRejected(
                    f"transfer {header.transfer_id!r}: unknown, finished or aborted; frame dropped"
                )
            if header.request_id != res.request_id:
                raise TransferRejected(
                    f"transfer {header.transfer_id!r}: request id "
                    f"{header.request_id!r} != {res.request_id!r}"
                )
            try:
                self._check_frame(header, res)
            except TransferRejected as e:
                self._fail(res, str(e))  # a bad frame breaks the transfer: release now
                raise
            res.in_flight += 1
        runs = block_runs(header.src_block_ids, header.dst_block_ids)
        return res, frame_regions(self.cache, header.layer_start, header.layer_end, runs, "dst")

    def _check_frame(self, h: pb.KVFrameHeader, res: Reservation) -> None:
        check_layout(h.layout, self.cache.spec)
        n_layers = self.cache.num_layers
        if not 0 <= h.layer_start < h.layer_end <= n_layers:
            raise TransferRejected(
                f"layer range [{h.layer_start}, {h.layer_end}) outside [0, {n_layers})"
            )
        if not h.dst_block_ids or len(h.src_block_ids) != len(h.dst_block_ids):
            raise TransferRejected(
                "src_block_ids and dst_block_ids must be non-empty and of equal length"
            )
        reserved = set(res.dst_block_ids)
        stray = [b for b in h.dst_block_ids if b not in reserved]
        if stray:
            raise TransferRejected(f"dst blocks {stray[:8]} are not reserved for this transfer")
        if len(set(h.dst_block_ids)) != len(h.dst_block_ids):
            raise TransferRejected("dst_block_ids repeat a block")
        if any(b >= (1 << 31) for b in h.src_block_ids):
            raise TransferRejected("src block id out of range")
        again = [
            (layer, b)
            for layer in range(h.layer_start, h.layer_end)
            for b in h.dst_block_ids
            if (layer, b) in res.received
        ]
        if again:
            raise TransferRejected(f"(layer, block) {again[0]} already received")
        expected = payload_bytes(self.cache.spec, h.layer_end - h.layer_start, len(h.dst_block_ids))
        if h.payload_bytes != expected:
            raise TransferRejected(f"payload_bytes {h.payload_bytes} != expected {expected}")
        if time.monotonic() > res.deadline_s:
            raise TransferRejected(f"transfer {h.transfer_id!r}: lease expired")

    def end_frame(self, res: Reservation, header: pb.KVFrameHeader, error: str = "") -> None:
        """The frame's payload fully landed (`error` empty) or broke off (`error` says why)."""
        with self.lock:
            res.in_flight -= 1
            if error:
                self._fail(res, error)
                return
            for layer in range(header.layer_start, header.layer_end):
                res.received.update((layer, b) for b in header.dst_block_ids)
            res.bytes_received += header.payload_bytes
            self.bytes_received_total += header.payload_bytes
            if res.state is ReservationState.FAILED:
                self._fail(res, res.error)  # failed meanwhile: free now that no frame writes
            elif len(res.received) == self.cache.num_layers * len(res.dst_block_ids):
                res.state = ReservationState.COMPLETE
                res.deadline_s = time.monotonic() + self.lease_s  # a new lease: to be taken
                res.done.set()

    # ---- endings -------------------------------------------------------------------------
    def fail(self, transfer_id: str, error: str) -> bool:
        """Abort a transfer (sender's abort frame, decode-side cancel, broken channel).

        A COMPLETE reservation not yet taken by the engine is released too.
        """
        with self.lock:
            res = self._by_transfer.get(transfer_id)
            if res is None:
                return False
            self._fail(res, error)
            return True

    def _fail(self, res: Reservation, error: str) -> None:
        if res.state is not ReservationState.FAILED:
            res.state = ReservationState.FAILED
            res.error = error
        if res.in_flight == 0 and self._by_transfer.pop(res.transfer_id, None) is not None:
            if self._release is None:
                self.blocks.free(res.request_id)
            else:
                self._release(res.request_id)
        res.done.set()

    def wait(self, transfer_id: str, timeout_s: float) -> Reservation:
        """Block until the transfer completes; raise TransferError if it fails or times out."""
        res = self.get(transfer_id)
        if res is None:
            raise TransferError(f"transfer {transfer_id!r} is not reserved here")
        if not res.done.wait(timeout_s):
            self.fail(transfer_id, f"timed out after {timeout_s:.1f} s")
        if res.state is not ReservationState.COMPLETE:
            raise TransferError(f"transfer {transfer_id!r} failed: {res.error}")
        return res

    def take(self, transfer_id: str) -> Reservation:
        """Hand a COMPLETE reservation's blocks to the engine (they stay allocated)."""
        with self.lock:
            res = self._by_transfer.pop(transfer_id)
            assert res.state is ReservationState.COMPLETE, f"{transfer_id} is {res.state}"
            return res

    def take_if_complete(self, transfer_id: str) -> Reservation | None:
        """`take`, or None when the reservation failed or lapsed since it completed."""
        with self.lock:
            res = self._by_transfer.get(transfer_id)
            if res is None or res.state is not ReservationState.COMPLETE:
                return None
            return self.take(transfer_id)

    def ack(self, transfer_id: str) -> pb.TransferAck:
        res = self.get(transfer_id)
        if res is None:
            return pb.TransferAck(
                transfer_id=transfer_id,
                status=pb.TRANSFER_STATUS_ABORTED,
                error="unknown or already released",
            )
        return ack_of(res)

    def expire(self, now: float | None = None) -> list[str]:
        """Fail every reservation past its lease, waiting for KV or (COMPLETE) for the engine
        to take it; returns their transfer ids."""
        now = time.monotonic() if now is None else now
        with self.lock:
            overdue = [
                r
                for r in self._by_transfer.values()
                if r.state is not ReservationState.FAILED and now > r.deadline_s
            ]
            for r in overdue:
                what = "not started" if r.state is ReservationState.COMPLETE else "no KV"
                self._fail(r, f"lease expired ({what})")
        return [r.transfer_id for r in overdue]

    def start_reaper(self, interval_s: float = 0.5) -> None:
        def loop() -> None:
            while not self._closed.wait(interval_s):
                self.expire()

        self._reaper = threading.Thread(target=loop, name="kv-lease-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stop the reaper and wait for it: until it has returned, its loop holds this
        receiver (and through its callbacks the worker and its engine)."""
        self._closed.set()
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(5.0)


def ack_of(res: Reservation) -> pb.TransferAck:
    """The acknowledgement a reservation's current state warrants."""
    status = {
        ReservationState.COMPLETE: pb.TRANSFER_STATUS_COMPLETE,
        ReservationState.FAILED: pb.TRANSFER_STATUS_ABORTED,
    }.get(res.state, pb.TRANSFER_STATUS_UNSPECIFIED)
    return pb.TransferAck(
        transfer_id=res.transfer_id,
        status=status,
        error=res.error,
        bytes_received=res.bytes_received,
    )
