"""The paged KV cache: one preallocated tensor that every request's K/V lives in.

Memory layout (why it is this shape):

    data: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

* A *page* is one block of one layer: ``data[layer, :, block]`` = K and V for `block_size`
  tokens. K of a page is one contiguous run of ``block_size * num_kv_heads * head_dim``
  elements, so a transport ships a layer's pages as raw bytes with no packing, and a run of
  consecutive block ids is one contiguous slice (coalesced into one send).
* A token's *slot* is ``block_id * block_size + offset``; flattening ``[num_blocks,
  block_size]`` gives every layer a ``[num_slots, num_kv_heads, head_dim]`` view that
  every step writes with one `index_copy_`. A prefill chunk after a cached prefix reads its
  whole context as whole pages (`gather_blocks`, one `index_select` over the block
  dimension, K and V together). Decode reads the contiguous copy the decode workspace keeps
  (`engine.decode_workspace`, filled from whole pages once per request), or gathers pages
  when the batch is over the workspace's cap; `gather` reads any slot layout at all.

The tensor is allocated once; nothing here allocates per request. Which blocks belong to whom
is the block manager's business (`engine.block_manager`), which imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KVCacheSpec:
    """What two caches must agree on before pages may move between them."""

    model_fingerprint: str
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def page_elems(self) -> int:
        """Elements of K (or of V) in one page (one block of one layer)."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V in one page."""
        return 2 * self.page_elems * DTYPES[self.dtype].itemsize


class PagedKVCache:
    """Preallocated K/V pages for all layers; see the module docstring for the layout."""

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fingerprint: str = "",
    ) -> None:
        self.num_layers = model.num_layers
        self.num_blocks = cache.num_blocks
        self.block_size = cache.block_size
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.spec = KVCacheSpec(
            model_fingerprint=fingerprint or model.fingerprint(),
            dtype=dtype_name(dtype),
            num_layers=model.num_layers,
            block_size=cache.block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
        )
        # [L, 2, N, Bs, Hkv, D]
        self.data = torch.zeros(
            (
                self.num_layers,
                2,
                self.num_blocks,
                self.block_size,
                self.num_kv_heads,
                self.head_dim,
            ),
            dtype=dtype,
            device=self.device,
        )

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_slots, num_kv_heads, head_dim]`` views."""
        kv = self.data[layer]  # [2, N, Bs, Hkv, D]
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        return kv[0].view(shape), kv[1].view(shape)

    def layer_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_blocks, block_size, num_kv_heads, head_dim]`` views
        (what a kernel reading pages in place takes)."""
        kv = self.data[layer]
        return kv[0], kv[1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, Hkv, D] each) at `slots` ([T])."""
        k_slots, v_slots = self.layer_slots(layer)
        k_slots.index_copy_(0, slots, k)
        v_slots.index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S) as ``[*S, Hkv, D]`` copies."""
        k_slots, v_slots = self.layer_slots(layer)
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        return k_slots.index_select(0, flat).view(shape), v_slots.index_select(0, flat).view(shape)

    def gather_blocks(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole pages: `block_tables` ``[B, nb]`` -> ``[B, nb * Bs, Hkv, D]`` copies.

        One `index_select` for K and V together, one 8 KiB-ish row per block (a per-slot
        `gather` moves rows of ``Hkv * D`` elements); positions past a request's length are
        whatever the page holds, for the caller to slice or mask off.
        """
        batch, nb = block_tables.shape
        kv = self.data[layer].index_select(1, block_tables.reshape(-1))  # [2, B * nb, Bs, Hkv, D]
        shape = (batch, nb * self.block_size, self.num_kv_heads, self.head_dim)
        return kv[0].view(shape), kv[1].view(shape)

    def pages(self, layer: int, block_start: int, num_blocks: int) -> torch.Tensor:
        """A contiguous run of pages of one layer: ``[2, n, Bs, Hkv, D]`` view (K and V)."""
        return self.data[layer, :, block_start : block_start + num_blocks]

    def copy_blocks(self, src_ids: list[int], dst: PagedKVCache, dst_ids: list[int]) -> None:
        """Copy pages of all layers between caches of the same spec (the in-process path)."""
        assert self.spec == dst.spec, f"cache spec mismatch: {self.spec} != {dst.spec}"
        src = torch.tensor(src_ids, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
        dst.data.index_copy_(2, dst_t, self.data.index_select(2, src).to(dst.device))


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
