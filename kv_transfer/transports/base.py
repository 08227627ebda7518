"""The transport interface: a receiving endpoint on the decode side, a send channel per
(prefill worker, decode worker) pair on the prefill side, picked by name from a registry.

A transport moves frames (header + regions) and nothing else; validation, reservations and
leases live in `KVReceiver`, so every transport gets the same safety rules for free.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.receiver import KVReceiver
from kv_transfer.registry import transport_module
from protos.pdserve.v1 import kv_transfer_pb2 as pb

DEFAULT_TIMEOUT_S = 10.0


class SendChannel(ABC):
    """Frames from this process to one receiver endpoint, in order."""

    broken = False  # set when the channel can carry no more frames: the sender drops it

    @abstractmethod
    def send_frame(self, header: pb.KVFrameHeader, regions: Sequence[torch.Tensor]) -> None:
        """Queue one frame; may return before the bytes left. Errors surface in `finish`,
        or here as TransferError when the channel is (found) broken."""

    @abstractmethod
    def finish(self, transfer_id: str, timeout_s: float) -> pb.TransferAck:
        """Wait until every frame of `transfer_id` left and the receiver acknowledged."""

    @abstractmethod
    def abort(self, header: pb.KVFrameHeader) -> None:
        """Tell the receiver the transfer is abandoned (an explicit abort frame)."""

    @abstractmethod
    def close(self) -> None: ...


class Endpoint(ABC):
    """The decode side's listening end; `address` goes into tickets."""

    address: str

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    name: ClassVar[str]

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu", secret: str | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.device = torch.device(device)  # where the caches live: picks NCCL vs gloo
        # The cluster's shared secret (kv_transfer/auth.py): an endpoint with one refuses
        # channels that cannot prove it; a channel with one talks only to endpoints that can.
        self.secret = secret

    def configure(self, cfg: TransferConfig) -> None:  # noqa: B027 - most transports need none
        """Take this transport's own settings from the config (before `listen`)."""

    @abstractmethod
    def listen(self, receiver: KVReceiver, host: str = "127.0.0.1") -> Endpoint: ...

    @abstractmethod
    def connect(self, address: str, sender_id: str) -> SendChannel: ...


TRANSPORTS: dict[str, type[Transport]] = {}  # each transport module registers itself on import


def register(cls: type[Transport]) -> type[Transport]:
    TRANSPORTS[cls.name] = cls
    return cls


def get_transport(
    name: str, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu", secret: str | None = None
) -> Transport:
    """Instantiate a transport by name."""
    importlib.import_module(transport_module(name))
    return TRANSPORTS[name](timeout_s=timeout_s, device=device, secret=secret)
