"""Transfer settings, owned here and composed into the serve config tree by pdserve.config."""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORT_NAMES = ("torch_dist", "grpc", "local")


@dataclass(frozen=True)
class TransferConfig:
    transport: str = "torch_dist"  # torch_dist (gloo on CPU, NCCL on GPU) | grpc | local
    timeout_s: float = 10.0  # a stalled or dead peer fails a transfer after this long
    lease_s: float = 30.0  # blocks held for a transfer are released after this at the latest
    max_channels: int = 32  # open (prefill, decode) pair channels per sender, LRU-closed
    layers_per_frame: int = 1  # layers pushed per frame as the prompt pass proceeds
    host: str = "127.0.0.1"  # address the decode worker's endpoint binds and advertises

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(f"transport={self.transport!r}: choose from {TRANSPORT_NAMES}")
        if self.timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("transfer timeout_s and lease_s must be positive")
