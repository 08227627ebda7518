"""A decode-side contiguous mirror of the running requests' K/V.

Why: a decode step reads every running request's whole context once per layer. Attention
(`F.scaled_dot_product_attention`) wants one dense ``[B, Hkv, S, D]`` tensor, and the paged
cache holds a request's tokens in scattered blocks, so without this every layer of every
step gathers all of them into a fresh tensor: the whole batch's K/V copied (read and
written) once per step, only to be read again by attention. At batch 32 on the `small`
preset that copy was almost a fifth of a decode step on the 2-vCPU box (docs/benchmarks.md,
"Decode workspace"). There is no paged-attention kernel for CPU in PyTorch; a GPU engine
would use one instead (vLLM, FlashInfer).

The workspace keeps, per running request, its context laid out contiguously:

    data: [num_layers, 2 (K, V), rows, num_kv_heads, capacity, head_dim]

A request is copied in from its pages once, when it joins the decode batch. After that each
step appends only the new token (`write`), next to the write into the paged cache, which
stays the source of truth (transfers, prefix reuse, preemption all read pages).

What must hold:

* Rows ``0 .. B-1`` are exactly the step's batch, in the order `prepare` returns; a request
  that leaves gives its row up at the next `prepare` (the last row moves into the hole).
* A row is keyed by ``(request_id, num_preemptions)`` and its valid length must be the
  request's length minus one (the token this step computes); anything else is refilled
  from the pages, so a preempted and recomputed request never reads its old values.
* Memory is bounded: rows and capacity grow on demand (capacity in 256-token steps), and
  a batch that would need more than `max_bytes` makes `prepare` return None: the caller
  gathers pages for that step instead, and the workspace frees its memory. The size is kept
  while requests run (no reallocation as batches come and go) and given back when none is
  left (`LLMEngine.step` calls `reset`).
* Every position of every row below `_clean` holds a finite value. Attention reads rows
  ``0 .. B-1`` up to the longest context, and a shorter row's extra positions meet a zero
  softmax weight, but ``0 * NaN`` is NaN. The buffer is allocated uninitialised and a row's
  tail is zeroed the first time the row is used: zeroing the whole buffer up front (226 MB
  at 8 rows x 2304 positions of the small preset) was paid by the first decode step of
  every request that found the decode worker idle (docs/benchmarks.md, "Decode workspace").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import ceil_div
from engine.kv_cache import BlockRun, PagedKVCache, block_runs

RowKey = tuple[str, int]
"""(request_id, num_preemptions) of the request a row holds."""

_CAPACITY_STEP = 256
_ROWS_STEP = 8
_MAX_FILL_RUNS = 16  # more runs of consecutive blocks than this: gather the pages instead


class DecodeWorkspace:
    """The running batch's K/V, one contiguous row per request (see the module docstring).

    Used by one thread, the engine's: `ModelRunner.decode` calls `prepare`, the model calls
    `write` and `layer` for each layer, `LLMEngine.step` calls `reset` when nothing runs.
    """

    def __init__(self, cache: PagedKVCache, max_bytes: int) -> None:
        self.cache = cache
        self.max_bytes = max_bytes
        self.data: torch.Tensor | None = None  # [L, 2, R, Hkv, S, D]
        self.keys: list[RowKey] = []  # row -> key, for rows 0 .. len-1
        self.lens: list[int] = []  # row -> positions 0 .. len-1 hold valid K/V
        self._write_rows = torch.empty(0, dtype=torch.long)  # see `_flat_rows`
        self._clean = 0  # rows 0 .. _clean-1 are finite at every position
        self.fallbacks = 0  # steps whose batch did not fit `max_bytes` (pages gathered)

    @property
    def bytes_held(self) -> int:
        """Memory the workspace holds now."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    @property
    def rows(self) -> int:
        return 0 if self.data is None else self.data.shape[2]

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[4]

    def nbytes(self, rows: int, capacity: int) -> int:
        c = self.cache
        return (
            c.num_layers * 2 * rows * c.num_kv_heads * capacity * c.head_dim
        ) * c.data.element_size()

    def reset(self) -> None:
        """Forget every row and free the memory (the next `prepare` starts over)."""
        self.data, self.keys, self.lens = None, [], []
        self._write_rows = torch.empty(0, dtype=torch.long)
        self._clean = 0

    def prepare(
        self,
        keys: Sequence[RowKey],
        num_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        final_tokens: Sequence[int] | None = None,
    ) -> list[int] | None:
        """Make rows ``0 .. B-1`` hold the batch; returns ``order`` with ``order[row]`` the
        index (into `keys`) of the request in that row, or None when the batch does not fit
        `max_bytes` (nothing held then; gather pages this step).

        `num_tokens[i]` counts request i's tokens including the one this step feeds, whose
        K/V the step writes (`write`); positions before it must already be in its pages.
        `final_tokens[i]`, if given, is the most tokens request i can reach (prompt plus
        `max_tokens`, capped by the context limit): when the buffer has to be reallocated
        anyway, it is sized for that if it fits `max_bytes`, so the batch does not stall
        again every 256 tokens (growing copies every row, so a step that grows costs several
        ordinary ones: docs/benchmarks.md, "Decode workspace").
        """
        want_cap = ceil_div(max(num_tokens), _CAPACITY_STEP) * _CAPACITY_STEP
        want_rows = ceil_div(len(keys), _ROWS_STEP) * _ROWS_STEP
        if self.nbytes(max(want_rows, self.rows), max(want_cap, self.capacity)) > self.max_bytes:
            self.reset()
            self.fallbacks += 1
            return None
        index = {k: i for i, k in enumerate(keys)}
        kept = self._current_rows(index, num_tokens)
        plan_cap = want_cap
        if final_tokens:
            plan_cap = max(want_cap, ceil_div(max(final_tokens), _CAPACITY_STEP) * _CAPACITY_STEP)
        self._grow(want_rows, want_cap, len(self.keys), plan_cap)
        new_keys = self._compact(kept)
        self._add_missing(new_keys, keys, num_tokens, block_tables)
        order = [index[k] for k in new_keys]
        self.keys = new_keys
        self.lens = [num_tokens[i] for i in order]  # after this step's `write`
        self._write_rows = self._flat_rows([n - 1 for n in self.lens])
        return order

    def _current_rows(self, index: dict[RowKey, int], num_tokens: Sequence[int]) -> list[int]:
        """Rows to keep, ascending: their request is in the batch (`index`: key -> its
        position in the batch) and their K/V is current (valid length = its tokens - 1)."""
        return [
            r
            for r, k in enumerate(self.keys)
            if k in index and self.lens[r] == num_tokens[index[k]] - 1
        ]

    def _compact(self, kept: list[int]) -> list[RowKey]:
        """Move the `kept` rows (ascending, from `_current_rows`) to rows ``0 .. len-1`` by
        moving the last kept row into each hole; the keys those rows hold now. Must run
        after `_grow`, which keeps every row where it was."""
        assert self.data is not None
        new_keys: list[RowKey] = []
        kept_set = set(kept)
        movers = [r for r in kept if r >= len(kept)]
        for r in range(len(kept)):
            src = r if r in kept_set else movers.pop()
            if src != r:
                n = self.lens[src]
                self.data[:, :, r, :, :n] = self.data[:, :, src, :, :n]
            new_keys.append(self.keys[src])
        return new_keys

    def _add_missing(
        self,
        held: list[RowKey],
        keys: Sequence[RowKey],
        num_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> None:
        """Give each request of the batch not in `held` (the keys of rows ``0 ..
        len(held)-1``) the next row, copied in from its pages up to its length minus one;
        appends its key to `held`, so `held` ends as the keys of rows ``0 .. B-1``."""
        have = set(held)
        for i, key in enumerate(keys):
            if key not in have:
                self._fill(len(held), block_tables[i], num_tokens[i] - 1)
                held.append(key)

    def _flat_rows(self, positions: list[int]) -> torch.Tensor:
        """Where `write` puts K/V of each (row, head) at its position, as row numbers of one
        layer's ``[2 * R * Hkv * S, D]`` flattening: ``((kv * R + row) * Hkv + h) * S + pos``,
        K block then V block, so a step's append is one `index_copy_` per layer."""
        rows, heads, cap = self.rows, self.cache.num_kv_heads, self.capacity
        dev = self.cache.device
        b = len(positions)
        kv_row = torch.arange(2, device=dev)[:, None] * rows + torch.arange(b, device=dev)
        head = kv_row[:, :, None] * heads + torch.arange(heads, device=dev)  # [2, B, Hkv]
        pos = torch.tensor(positions, device=dev)[None, :, None]
        return (head * cap + pos).reshape(-1)  # [2 * B * Hkv]

    def _grow(self, rows: int, capacity: int, used_rows: int, plan_capacity: int) -> None:
        """Reallocate if `rows` x `capacity` does not fit, then at `plan_capacity` if that
        is within `max_bytes` (the caller checked that `capacity` is)."""
        if self.data is not None and rows <= self.rows and capacity <= self.capacity:
            return
        c = self.cache
        rows, capacity = max(rows, self.rows), max(capacity, self.capacity)
        if plan_capacity > capacity and self.nbytes(rows, plan_capacity) <= self.max_bytes:
            capacity = plan_capacity
        data = _uninitialized(
            (c.num_layers, 2, rows, c.num_kv_heads, capacity, c.head_dim), c.dtype, c.device
        )
        self._clean = 0
        if self.data is not None and used_rows:
            old = self.capacity
            data[:, :, :used_rows, :, :old] = self.data[:, :, :used_rows]
            data[:, :, :used_rows, :, old:] = 0
            self._clean = used_rows
        self.data = data

    def _fill(self, row: int, block_table: Sequence[int], n: int) -> None:
        """Copy positions ``0 .. n-1`` of every layer from the request's pages into `row`:
        run by run of consecutive block ids (the block manager hands fresh blocks out in
        ascending order, so a prompt is a few runs), else through one gather."""
        assert self.data is not None
        if row >= self._clean:  # first use of this row in this buffer: make it finite
            assert row == self._clean, "rows are taken in order"
            self.data[:, :, row, :, n:] = 0
            self._clean = row + 1
        if n == 0:
            return
        c = self.cache
        ids = block_table[: ceil_div(n, c.block_size)]
        src, runs = c.data, block_runs(ids, range(len(ids)))  # [L, 2, N, Bs, Hkv, D]
        if len(runs) > _MAX_FILL_RUNS:  # scattered: gather the pages into one run first
            src = c.data.index_select(2, torch.tensor(ids, device=c.device))
            runs = [BlockRun(0, 0, len(ids))]
        for r in runs:  # one copy per run of consecutive blocks
            lo = r.dst_start * c.block_size
            hi = min(n, lo + r.num_blocks * c.block_size)
            pages = src[:, :, r.src_start : r.src_start + r.num_blocks]
            ctx = pages.flatten(2, 3)[:, :, : hi - lo]  # [L, 2, hi - lo, Hkv, D]
            self.data[:, :, row, :, lo:hi] = ctx.transpose(2, 3)  # [L, 2, Hkv, hi - lo, D]

    def layer(self, layer: int, batch: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the batch's rows, positions ``0 .. span-1``: ``[B, Hkv, span, D]`` views."""
        assert self.data is not None
        kv = self.data[layer, :, :batch, :, :span]
        return kv[0], kv[1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append this step's K/V ([B, Hkv, D] each, rows in `prepare`'s order) to the rows."""
        assert self.data is not None
        flat = self.data[layer].view(-1, self.cache.head_dim)  # [2 * R * Hkv * S, D]
        flat.index_copy_(0, self._write_rows, torch.stack((k, v)).view(-1, k.shape[-1]))


def _uninitialized(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The workspace's buffer, contents undefined (see the module docstring: `_clean`)."""
    return torch.empty(shape, dtype=dtype, device=device)
