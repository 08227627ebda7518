"""Transfer settings, owned here and composed into the serve config tree by pdserve.config."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kv_transfer.auth import SECRET_ENV, check_secret
from kv_transfer.registry import TRANSPORT_NAMES, TransportName

DEFAULT_MAX_PUSH_STREAMS = 128


@dataclass(frozen=True)
class TransferConfig:
    transport: TransportName = "torch_dist"  # torch_dist: gloo on CPU, NCCL on GPU
    timeout_s: float = 10.0  # a stalled or dead peer fails a transfer after this long
    lease_s: float = 30.0  # blocks held for a transfer are released after this at the latest
    max_channels: int = 32  # open (prefill, decode) pair channels per sender, LRU-closed
    layers_per_frame: int = 1  # layers pushed per frame as the prompt pass proceeds
    host: str = "127.0.0.1"  # address the decode worker's endpoint binds and advertises
    # grpc transport: Push streams one decode worker's endpoint serves at once; one more is
    # refused (RESOURCE_EXHAUSTED), not queued. A stream idle for timeout_s is cancelled.
    max_push_streams: int = DEFAULT_MAX_PUSH_STREAMS
    # Channels must prove this secret before any frame lands (kv_transfer/auth.py). None:
    # env PDSERVE_KV_SECRET in the worker's process, else no authentication. Never logged.
    shared_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(f"transport={self.transport!r}: choose from {TRANSPORT_NAMES}")
        if self.timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("transfer timeout_s and lease_s must be positive")
        if self.max_push_streams < 1:
            raise ValueError("transfer max_push_streams must be at least 1")
        if self.shared_secret is not None:
            check_secret(self.shared_secret, "transfer.shared_secret")

    def resolve_secret(self) -> str | None:
        """The secret this worker's channels use: the config's, else env PDSERVE_KV_SECRET.

        Called once, where a worker builds its transport; the env var lets a Kubernetes
        Secret reach the pods without riding the config (or Ray's actor arguments).
        """
        if self.shared_secret is not None:
            return self.shared_secret
        secret = os.environ.get(SECRET_ENV)
        if secret is not None:
            check_secret(secret, SECRET_ENV)
        return secret
