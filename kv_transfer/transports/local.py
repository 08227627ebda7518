"""In-process transport: copies pages between two caches in one process (colocated mode,
unit tests). It still goes through `KVReceiver.begin_frame`, so the same checks apply, and
connecting compares the two sides' shared secrets as the other transports' handshakes do."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

import torch

from kv_transfer.auth import same_secret
from kv_transfer.receiver import KVReceiver
from kv_transfer.transports.base import Endpoint, SendChannel, Transport, register
from kv_transfer.wire import TransferError, TransferRejected, TransferUnauthenticated
from protos.pdserve.v1 import kv_transfer_pb2 as pb

_ENDPOINTS: dict[str, LocalEndpoint] = {}
_LOCK = threading.Lock()


class LocalEndpoint(Endpoint):
    def __init__(self, receiver: KVReceiver, secret: str | None = None) -> None:
        self.address = f"local/{uuid.uuid4().hex[:12]}"
        self.receiver = receiver
        self.secret = secret
        with _LOCK:
            _ENDPOINTS[self.address] = self

    def close(self) -> None:
        with _LOCK:
            _ENDPOINTS.pop(self.address, None)


class LocalChannel(SendChannel):
    def __init__(self, address: str) -> None:
        self.address = address
        self._errors: dict[str, str] = {}

    def _receiver(self) -> KVReceiver:
        with _LOCK:
            endpoint = _ENDPOINTS.get(self.address)
        if endpoint is None:
            raise TransferError(f"local endpoint {self.address} is closed")
        return endpoint.receiver

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
        return LocalEndpoint(receiver, self.secret)

    def connect(self, address: str, sender_id: str) -> SendChannel:
        with _LOCK:
            endpoint = _ENDPOINTS.get(address)
        if endpoint is not None and not same_secret(endpoint.secret, self.secret):
            raise TransferUnauthenticated(
                f"local endpoint {address} refused {sender_id!r}: "
                "authentication failed (the shared secrets differ)"
            )
        return LocalChannel(address)
