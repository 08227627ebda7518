"""Which bytes of a paged cache a frame carries, in wire order. Needs torch only.

Both sides derive the same list of contiguous regions from a header's block ids and layer
range, so a transport moves bytes region by region: out of the sender's pages and into the
receiver's reserved pages, with runs of consecutive blocks coalesced into one region.
(Kept apart from `wire`, which needs protobuf, so a GPU box with only torch can use it.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import PagedKVCache


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
