"""Which bytes of a paged cache a frame carries, in wire order. Needs torch only.

Both sides derive the same list of contiguous regions from a header's block ids and layer
range, so a transport moves bytes region by region: out of the sender's pages and into the
receiver's reserved pages, with runs of consecutive blocks coalesced into one region.
(Kept apart from `wire`, which needs protobuf, so a GPU box with only torch can use it.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from engine.kv_cache import BlockRun, PagedKVCache, block_runs

__all__ = ["BlockRun", "Side", "as_bytes", "block_runs", "frame_regions"]

Side = Literal["src", "dst"]  # read from the sender's blocks, or write into the receiver's


def frame_regions(
    cache: PagedKVCache, layer_start: int, layer_end: int, runs: Sequence[BlockRun], side: Side
) -> list[torch.Tensor]:
    """Contiguous views of `cache` that a frame's payload fills, in wire order."""
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
