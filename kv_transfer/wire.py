"""The KV wire format: protobuf headers plus raw page bytes, and how bytes map onto pages.

A frame's payload is, for each layer of the frame, for each coalesced run of blocks, the K
pages of the run followed by its V pages (see protos/pdserve/v1/kv_transfer.proto). Both
sides derive the same list of contiguous tensor regions from the header alone
(`frame_regions`), so a transport only moves bytes region by region: straight out of the
sender's cache and straight into the receiver's reserved blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCacheSpec, PagedKVCache
from protos.pdserve.v1 import kv_transfer_pb2 as pb

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


def layout_to_pb(spec: KVCacheSpec) -> pb.KVCacheLayout:
    return pb.KVCacheLayout(
        model_fingerprint=spec.model_fingerprint,
        dtype=_DTYPE_TO_PB[spec.dtype],
        num_layers=spec.num_layers,
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
    )


def check_layout(layout: pb.KVCacheLayout, spec: KVCacheSpec) -> None:
    """Raise TransferRejected naming the first field where `layout` differs from `spec`."""
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
            raise TransferRejected(f"layout.{name} mismatch: sender {value!r}, receiver {mine!r}")


@dataclass(frozen=True)
class BlockRun:
    """`num_blocks` consecutive source blocks landing on consecutive destination blocks."""

    src_start: int
    dst_start: int
    num_blocks: int


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[BlockRun]:
    """Coalesce (src, dst) pairs into runs contiguous on both sides."""
    assert len(src_ids) == len(dst_ids), "src and dst block lists differ in length"
    runs: list[BlockRun] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        last = runs[-1] if runs else None
        if last and s == last.src_start + last.num_blocks and d == last.dst_start + last.num_blocks:
            runs[-1] = BlockRun(last.src_start, last.dst_start, last.num_blocks + 1)
        else:
            runs.append(BlockRun(s, d, 1))
    return runs


def payload_bytes(spec: KVCacheSpec, num_layers: int, num_blocks: int) -> int:
    return num_layers * num_blocks * spec.page_bytes


def frame_regions(
    cache: PagedKVCache, layer_start: int, layer_end: int, runs: Sequence[BlockRun], side: str
) -> list[torch.Tensor]:
    """Contiguous views of `cache` that a frame's payload fills, in wire order.

    `side` is "src" (read from the sender's blocks) or "dst" (write into the receiver's).
    """
    regions = []
    for layer in range(layer_start, layer_end):
        for run in runs:
            start = run.src_start if side == "src" else run.dst_start
            pages = cache.pages(layer, start, run.num_blocks)  # [2, n, Bs, Hkv, D]
            regions.append(pages[0])  # K run: contiguous
            regions.append(pages[1])  # V run: contiguous
    return regions


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor (no copy)."""
    assert t.is_contiguous(), "wire regions must be contiguous"
    return t.view(-1).view(torch.uint8)


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
