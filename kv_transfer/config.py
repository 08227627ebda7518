"""Transfer settings, owned here and composed into the serve config tree by pdserve.config."""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.settings import check_settings, setting
from kv_transfer.auth import SECRET_ENV, check_secret
from kv_transfer.registry import TRANSPORT_NAMES, TransportName

DEFAULT_MAX_PUSH_STREAMS = 128


@dataclass(frozen=True)
class TransferConfig:
    transport: TransportName = setting(
        "torch_dist",
        "how KV moves between the pools (torch_dist: gloo on CPU, NCCL on GPU)",
        choices=TRANSPORT_NAMES,
    )
    timeout_s: float = setting(
        10.0, "a stalled or dead peer fails a transfer after this long", gt=0
    )
    lease_s: float = setting(
        30.0, "blocks held for a transfer are released after this at the latest", gt=0
    )
    layers_per_frame: int = setting(1, "layers pushed per frame as the prompt pass proceeds", ge=1)
    host: str = setting(
        "127.0.0.1", "address the decode worker's endpoint binds and advertises (auto: its node's)"
    )
    max_push_streams: int = setting(
        DEFAULT_MAX_PUSH_STREAMS,
        "grpc transport: Push streams one decode worker serves at once; one more is refused "
        "(RESOURCE_EXHAUSTED), not queued",
        ge=1,
    )
    shared_secret: str | None = setting(
        None,
        "channels must prove this secret before any frame lands (at least 16 characters); "
        "unset: env PDSERVE_KV_SECRET of each worker, else none",
        secret=True,
    )

    def __post_init__(self) -> None:
        check_settings(self, "transfer.")
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
