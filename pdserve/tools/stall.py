"""A stalled KV link, for fault injection: wraps a prefill worker's transport so that the
next transfers' frames are held back and leave, whole, only `stall_s` after the transfer
was finished (`finish`), as over a link that stopped moving. An abort meanwhile drops them.

`install(worker, stall_s, num_transfers)` swaps the wrapper into a live `PrefillWorker`'s
sender (`Rig.stall_transfers` runs it inside the actor); `num_held(worker)` says how many
transfers it has held back since (`Rig.num_stalled`: the chaos row's proof that the fault
ran). The production classes know nothing of it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from kv_transfer.transports.base import Endpoint, SendChannel, Transport
from kv_transfer.wire import TransferError
from protos.pdserve.v1 import kv_transfer_pb2 as pb


class _Stall:
    """Which transfers stall (the next `num_transfers` new ones), shared by all channels."""

    def __init__(self, stall_s: float, num_transfers: int) -> None:
        assert stall_s >= 0 and num_transfers >= 0, "stall_s and num_transfers must be >= 0"
        self.stall_s = stall_s
        self.remaining = num_transfers
        self.held: dict[str, list[tuple[pb.KVFrameHeader, Sequence[torch.Tensor]]]] = {}
        self.aborted: dict[str, threading.Event] = {}
        self.seen: set[str] = set()
        self.num_held = 0  # transfers whose frames were held back: the fault hit them
        self.lock = threading.Lock()

    def holds(self, transfer_id: str) -> bool:
        with self.lock:
            if transfer_id not in self.seen:
                self.seen.add(transfer_id)
                if self.remaining > 0:
                    self.remaining -= 1
                    self.num_held += 1
                    self.held[transfer_id] = []
                    self.aborted[transfer_id] = threading.Event()
            return transfer_id in self.held


class StalledChannel(SendChannel):
    def __init__(self, inner: SendChannel, stall: _Stall) -> None:
        self.inner = inner
        self.stall = stall

    @property
    def broken(self) -> bool:
        return self.inner.broken

    @broken.setter
    def broken(self, value: bool) -> None:
        self.inner.broken = value

    def send_frame(self, header: pb.KVFrameHeader, regions: Sequence[torch.Tensor]) -> None:
        if self.stall.holds(header.transfer_id):
            self.stall.held[header.transfer_id].append((header, regions))
        else:
            self.inner.send_frame(header, regions)

    def finish(self, transfer_id: str, timeout_s: float) -> pb.TransferAck:
        held = self.stall.held.get(transfer_id)
        if held is not None:
            if self.stall.aborted[transfer_id].wait(self.stall.stall_s):
                raise TransferError(f"transfer {transfer_id}: aborted while stalled")
            for header, regions in self.stall.held.pop(transfer_id):
                self.inner.send_frame(header, regions)
        return self.inner.finish(transfer_id, timeout_s)

    def abort(self, header: pb.KVFrameHeader) -> None:
        if header.transfer_id in self.stall.aborted:
            self.stall.aborted[header.transfer_id].set()
            self.stall.held.pop(header.transfer_id, None)
        self.inner.abort(header)

    def close(self) -> None:
        self.inner.close()


class StalledTransport(Transport):
    name = "stalled"

    def __init__(self, inner: Transport, stall: _Stall) -> None:
        super().__init__(inner.timeout_s, str(inner.device), inner.secret)
        self.inner = inner
        self.stall = stall

    def listen(self, receiver: Any, host: str = "127.0.0.1") -> Endpoint:
        return self.inner.listen(receiver, host)

    def connect(self, address: str, sender_id: str) -> SendChannel:
        return StalledChannel(self.inner.connect(address, sender_id), self.stall)


def _unwrap(ch: SendChannel) -> SendChannel:
    return ch.inner if isinstance(ch, StalledChannel) else ch


def install(worker: Any, stall_s: float, num_transfers: int) -> None:
    """Stall the next `num_transfers` transfers of `worker` (a PrefillWorker) by `stall_s`.
    Replaces a stall installed before (`num_transfers=0` removes it). Open channels are
    wrapped in place (transfers already on them keep their frames moving), new ones are
    wrapped as they connect. Reaches into the sender's lanes: this is a fault tool."""
    sender = worker.sender
    stall = _Stall(stall_s, num_transfers)
    t = sender.transport
    sender.transport = StalledTransport(t.inner if isinstance(t, StalledTransport) else t, stall)
    with sender._lock:
        lanes = list(sender._lanes.values())
    for lane in lanes:
        with lane._lock:
            if lane.channel is not None:
                lane.channel = StalledChannel(_unwrap(lane.channel), stall)


def num_held(worker: Any) -> int:
    """Transfers of `worker` held back by the stall installed last (0: none installed, or the
    worker restarted since)."""
    t = worker.sender.transport
    return t.stall.num_held if isinstance(t, StalledTransport) else 0
