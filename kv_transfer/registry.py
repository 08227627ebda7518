"""The one list of transport names. Torch-free, so config and the CLI can name transports
without importing what implements them; `transports.base.get_transport` imports a
transport's module on first use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TransportName = Literal["torch_dist", "grpc", "local"]


@dataclass(frozen=True)
class TransportSpec:
    name: TransportName
    module: str  # imported by `get_transport` on first use
    cross_process: bool  # False: both ends must live in one process (tests, benchmarks)


TRANSPORT_SPECS: tuple[TransportSpec, ...] = (
    TransportSpec("torch_dist", "kv_transfer.transports.torch_dist", cross_process=True),
    TransportSpec("grpc", "kv_transfer.transports.grpc_stream", cross_process=True),
    TransportSpec("local", "kv_transfer.transports.local", cross_process=False),
)
TRANSPORT_NAMES: tuple[str, ...] = tuple(s.name for s in TRANSPORT_SPECS)
# What a deployment of separate worker processes can use (`pdserve serve --transport`).
SERVE_TRANSPORT_NAMES: tuple[str, ...] = tuple(s.name for s in TRANSPORT_SPECS if s.cross_process)


def transport_module(name: str) -> str:
    for spec in TRANSPORT_SPECS:
        if spec.name == name:
            return spec.module
    raise ValueError(f"transport {name!r}: choose from {sorted(TRANSPORT_NAMES)}")
