"""In-process transport: copies pages between two caches in one process (colocated mode,
unit tests). It still goes through `KVReceiver.begin_frame`, so the same checks apply."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

import torch

from kv_transfer.receiver import KVReceiver
from kv_transfer.transports.base import Endpoint, SendChannel, Transport, register
from kv_transfer.wire import TransferError, TransferRejected
from protos.pdserve.v1 import kv_transfer_pb2 as pb

_ENDPOINTS: dict[str, KVReceiver] = {}
_LOCK = threading.Lock()


class LocalEndpoint(Endpoint):
    def __init__(self, receiver: KVReceiver) -> None:
        self.address = f"local/{uuid.uuid4().hex[:12]}"
        with _LOCK:
            _ENDPOINTS[self.address] = receiver

    def close(self) -> None:
        with _LOCK:
            _ENDPOINTS.pop(self.address, None)


class LocalChannel(SendChannel):
    def __init__(self, address: str) -> None:
        self.address = address
        self._errors: dict[str, str] = {}

    def _receiver(self) -> KVReceiver:
        with _LOCK:
            receiver = _ENDPOINTS.get(self.address)
        if receiver is None:
            raise TransferError(f"local endpoint {self.address} is closed")
        return receiver

    def send_frame(self, header: pb.KVFrameHeader, regions: Sequence[torch.Tensor]) -> None:
        receiver = self._receiver()
        try:
            res, dst = receiver.begin_frame(header)
        except TransferRejected as e:
            self._errors.setdefault(header.transfer_id, str(e))
            return
        assert len(dst) == len(regions), "sender and receiver disagree on the frame's regions"
        for s, d in zip(regions, dst, strict=True):
            d.copy_(s)
        receiver.end_frame(res, header)

    def finish(self, transfer_id: str, timeout_s: float) -> pb.TransferAck:
        if transfer_id in self._errors:
            raise TransferRejected(self._errors.pop(transfer_id))
        ack = self._receiver().ack(transfer_id)
        if ack.status != pb.TRANSFER_STATUS_COMPLETE:
            raise TransferError(f"transfer {transfer_id}: {ack.error or 'incomplete'}")
        return ack

    def abort(self, header: pb.KVFrameHeader) -> None:
        self._receiver().fail(header.transfer_id, f"aborted by sender: {header.abort_reason}")

    def close(self) -> None:
        pass


@register
class LocalTransport(Transport):
    name = "local"

    def listen(self, receiver: KVReceiver, host: str = "127.0.0.1") -> Endpoint:
        return LocalEndpoint(receiver)

    def connect(self, address: str, sender_id: str) -> SendChannel:
        return LocalChannel(address)
