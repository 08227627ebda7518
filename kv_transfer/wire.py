"""The KV wire format: protobuf headers plus raw page bytes, and how bytes map onto pages.

A frame's payload is, for each layer of the frame, for each coalesced run of blocks, the K
pages of the run followed by its V pages (see protos/pdserve/v1/kv_transfer.proto). Both
sides derive the same list of contiguous tensor regions from the header alone
(`frame_regions`), so a transport only moves bytes region by region: straight out of the
sender's cache and straight into the receiver's reserved blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache import KVCacheSpec
from kv_transfer.pages import BlockRun, as_bytes, block_runs, frame_regions
from protos.pdserve.v1 import WIRE_VERSION
from protos.pdserve.v1 import kv_transfer_pb2 as pb

__all__ = ["BlockRun", "as_bytes", "block_runs", "frame_regions"]

_DTYPE_TO_PB = {
    "float32": pb.KV_DTYPE_FLOAT32,
    "bfloat16": pb.KV_DTYPE_BFLOAT16,
    "float16": pb.KV_DTYPE_FLOAT16,
}
_PB_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PB.items()}


class TransferError(RuntimeError):
    """A transfer failed (peer died or stalled, abort, timeout); its blocks were released."""


class TransferRejected(TransferError):
    """A header failed validation; no byte of its payload was written."""


class TransferUnauthenticated(TransferError):
    """The receiver refused this channel for want of the cluster's shared secret (no frame
    of it landed), or the receiver could not prove it holds the secret (kv_transfer/auth.py)."""


def layout_to_pb(spec: KVCacheSpec) -> pb.KVCacheLayout:
    return pb.KVCacheLayout(
        model_fingerprint=spec.model_fingerprint,
        dtype=_DTYPE_TO_PB[spec.dtype],
        num_layers=spec.num_layers,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        wire_version=WIRE_VERSION,
    )


def check_layout(
    layout: pb.KVCacheLayout,
    spec: KVCacheSpec,
    theirs_is: str = "sender",
    mine_is: str = "receiver",
) -> None:
    """Raise TransferRejected naming the first field where `layout` (written by the peer,
    `theirs_is`) differs from `spec` (this side, `mine_is`): the wire version first, since
    a peer of another version may mean something else by every other field."""
    if layout.wire_version != WIRE_VERSION:
        raise TransferRejected(
            f"pdserve wire version mismatch: {theirs_is} {layout.wire_version}, "
            f"{mine_is} {WIRE_VERSION} (workers of different versions never pair)"
        )
    theirs = {
        "model_fingerprint": layout.model_fingerprint,
        "dtype": _PB_TO_DTYPE.get(layout.dtype, f"enum {layout.dtype}"),
        "num_layers": layout.num_layers,
        "block_size": layout.block_size,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
    }
    for name, value in theirs.items():
        mine = getattr(spec, name)
        if value != mine:
            raise TransferRejected(
                f"layout.{name} mismatch: {theirs_is} {value!r}, {mine_is} {mine!r}"
            )


def payload_bytes(spec: KVCacheSpec, num_layers: int, num_blocks: int) -> int:
    return num_layers * num_blocks * spec.page_bytes


def make_header(
    request_id: str,
    transfer_id: str,
    spec: KVCacheSpec,
    layer_start: int,
    layer_end: int,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    sender_id: str = "",
) -> pb.KVFrameHeader:
    return pb.KVFrameHeader(
        request_id=request_id,
        transfer_id=transfer_id,
        layout=layout_to_pb(spec),
        layer_start=layer_start,
        layer_end=layer_end,
        src_block_ids=list(src_ids),
        dst_block_ids=list(dst_ids),
        payload_bytes=payload_bytes(spec, layer_end - layer_start, len(src_ids)),
        sender_id=sender_id,
    )


def abort_header(
    request_id: str, transfer_id: str, reason: str, sender_id: str = ""
) -> pb.KVFrameHeader:
    return pb.KVFrameHeader(
        request_id=request_id,
        transfer_id=transfer_id,
        abort=True,
        abort_reason=reason,
        sender_id=sender_id,
    )
