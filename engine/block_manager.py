"""Block ids, reference counts and the prefix cache. Pure Python: imports no torch.

Why it exists: the KV cache (`engine.kv_cache`) is one big tensor of fixed-size blocks; this
class decides which request owns which block, and remembers, by chained hash, which blocks
hold K/V of which token prefix so that later requests can share them instead of recomputing.

Every block is in exactly one of three states:

* **free**   - ref count 0, no hash; in `_free` (FIFO).
* **used**   - ref count > 0; referenced by one or more request block tables.
* **cached** - ref count 0 but still holding a registered hash; in `_lru` (oldest first) and
  reusable by a prefix hit until it is evicted to make room.

``free + used + cached == total`` always; `check_integrity()` proves it and more.

Hashes and events are `engine.prefix_hash`'s (see there); this class registers a hash on a
block once the block is complete and emits an event for every change to the registered set.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.prefix_hash import (
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
)


class NoFreeBlocksError(RuntimeError):
    """Not enough free or evictable blocks; nothing was changed."""


@dataclass(frozen=True)
class Allocation:
    block_ids: tuple[int, ...]
    num_cached_tokens: int  # leading tokens whose K/V was already in the cache


class BlockManager:
    """Owns block ids; see the module docstring for states, hashes and events."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0, "num_blocks and block_size must be positive"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[str, list[int]] = {}
        # per table, its leading blocks whose hash is registered: `commit` starts past them
        # (they stay registered while the table holds them, until `reset_prefix_cache`), so
        # a decode row's commit each step costs O(1), not O(its blocks)
        self._settled: dict[str, int] = {}
        self._events: list[BlockEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached."""
        return len(self._free) + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are registered (no side effects)."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def blocks_needed(self, hashes: Sequence[int], num_tokens: int) -> int:
        """Blocks an `allocate` of `num_tokens` would take out of the free/evictable pool."""
        matched = self._matched_blocks(hashes, num_tokens)
        fresh = -(-num_tokens // self.block_size) - len(matched)
        revived = sum(1 for b in matched if self._ref[b] == 0)
        return fresh + revived

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, request_id: str, hashes: Sequence[int], num_tokens: int) -> Allocation:
        """Give `request_id` blocks for `num_tokens`, reusing the cached prefix of `hashes`.

        The caller caps `hashes` so that at least one token is left to compute when it needs
        logits. Raises NoFreeBlocksError (changing nothing) when the pool is short.
        """
        assert request_id not in self._tables, f"{request_id} already holds blocks"
        matched = self._matched_blocks(hashes, num_tokens)
        if self.blocks_needed(hashes, num_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"{request_id}: needs {self.blocks_needed(hashes, num_tokens)} blocks, "
                f"{self.num_free_blocks} free"
            )
        for b in matched:
            self._take_ref(b)
        fresh = -(-num_tokens // self.block_size) - len(matched)
        table = matched + self._take_fresh(fresh)
        self._tables[request_id] = table
        return Allocation(tuple(table), len(matched) * self.block_size)

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Extend a table to hold `num_tokens`; returns the new block ids."""
        table = self._tables[request_id]
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return []
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"{request_id}: needs {need} more blocks, {self.num_free_blocks} free"
            )
        new = self._take_fresh(need)
        table.extend(new)
        return new

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Give `child_id` the first `num_tokens` of `parent_id`'s table (n > 1 choices of one
        prompt): its full blocks shared (one more reference each), and a partly filled last
        block copied, since the child writes its next token there. Returns the (source,
        copy) block pairs whose K/V the caller must copy; raises NoFreeBlocksError (changing
        nothing) when there is no block for a copy."""
        assert child_id not in self._tables, f"{child_id} already holds blocks"
        table = self._tables[parent_id]
        full, partial = divmod(num_tokens, self.block_size)
        assert full + bool(partial) <= len(table), f"{parent_id}: fewer blocks than tokens"
        if partial and not self.num_free_blocks:
            raise NoFreeBlocksError(f"{child_id}: needs 1 block for its fork, 0 free")
        shared = table[:full]
        for b in shared:
            self._take_ref(b)
        copies = [(table[full], self._pop_free())] if partial else []
        self._tables[child_id] = shared + [dst for _, dst in copies]
        return copies

    def commit(self, request_id: str, hashes: Sequence[int]) -> None:
        """Register `hashes[j]` for block j of the table: its K/V is now computed and final."""
        table = self._tables[request_id]
        assert len(hashes) <= len(table), f"{request_id}: more hashes than blocks"
        stored: list[int] = []
        parent: int | None = None
        start = self._settled.get(request_id, 0)
        for j in range(start, len(hashes)):
            h, b = hashes[j], table[j]
            if self._hash[b] is None and h not in self._by_hash:
                self._hash[b] = h
                self._by_hash[h] = b
                if not stored:
                    parent = hashes[j - 1] if j else None
                stored.append(h)
            elif stored:
                self._events.append(BlockStored(tuple(stored), parent))
                stored = []
        if stored:
            self._events.append(BlockStored(tuple(stored), parent))
        while start < len(hashes) and self._hash[table[start]] is not None:
            start += 1
        self._settled[request_id] = start

    def free(self, request_id: str) -> None:
        """Drop a request's references.

        Cached blocks are queued for eviction tail first (a prefix's head stays longest);
        unhashed blocks return to the free list in table order, so the next allocation gets
        ascending ids and a transfer coalesces them into few contiguous runs.
        """
        table = self._tables.pop(request_id)
        self._settled.pop(request_id, None)
        freed: list[int] = []
        for b in reversed(table):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} ref count went negative"
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    freed.append(b)
                else:
                    self._lru[b] = None
        self._free.extend(reversed(freed))

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (cached blocks become free; used ones stay used)."""
        for b in self._lru:
            self._free.append(b)
        self._lru.clear()
        self._by_hash.clear()
        self._settled.clear()
        self._hash = [None] * self.num_blocks
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def registered_hashes(self) -> list[int]:
        """Every hash a prefix hit could reuse now (used or cached blocks)."""
        return list(self._by_hash)

    # ---- internals -----------------------------------------------------------------------
    def _matched_blocks(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        n = min(self.match_prefix(hashes), num_tokens // self.block_size)
        return [self._by_hash[h] for h in hashes[:n]]

    def _take_ref(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._lru[b]
        self._ref[b] += 1

    def _take_fresh(self, n: int) -> list[int]:
        """`n` blocks off the free list (then the LRU's oldest), in ascending id order.

        Which blocks are taken is the free list's and the LRU's business; the order they go
        into the table is not, and ascending ids make consecutive ids neighbours. Why: a
        request's cached blocks enter the LRU tail first (its head stays longest), so they
        come back out in descending order; placed as they come, every page would be a run
        of its own and a KV transfer would send one message per block per layer
        (docs/benchmarks.md has the figures).
        """
        return sorted(self._pop_free() for _ in range(n))

    def _pop_free(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._lru.popitem(last=False)
            h = self._hash[b]
            assert h is not None
            del self._by_hash[h]
            self._hash[b] = None
            self._events.append(BlockRemoved((h,)))
        self._ref[b] = 1
        return b

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        free, cached = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "duplicate id in free list"
        assert not free & cached, "block both free and cached"
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        assert not used & (free | cached), "referenced block on a free list"
        assert len(free) + len(used) + len(cached) == self.num_blocks, (
            f"free {len(free)} + used {len(used)} + cached {len(cached)} != {self.num_blocks}"
        )
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                refs[b] += 1
        assert refs == self._ref, "ref counts disagree with block tables"
        for b in free:
            assert self._hash[b] is None, f"free block {b} still hashed"
        for b in cached:
            assert self._hash[b] is not None, f"cached block {b} has no hash"
        for h, b in self._by_hash.items():
            assert self._hash[b] == h, f"hash map points at block {b} with another hash"
        assert sum(h is not None for h in self._hash) == len(self._by_hash), "stray block hash"
