"""BlockManager: chained hashes, prefix hits, LRU eviction, events, and a stateful model.

The state machine drives random allocate / grow / commit / free / match_prefix /
reset_prefix_cache sequences (with shared prefixes, two hash namespaces and a small pool, so
that prefix hits, evictions and NoFreeBlocksError all happen) and after every step checks

* `check_integrity()`;
* that a mirror of the registered hash set, built only from `take_events()`, equals the
  manager's own set (what an outside prefix index would see);
* that every registered block still holds the K/V its hash names (a model of block contents:
  a block is "written" by the request that got it fresh, and a prefix hit must only ever
  return blocks whose contents match).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.prefix_hash import (
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    extend_block_hashes,
    hash_block,
    namespace_seed,
)

SEED = namespace_seed("fingerprint-a")


def hashes_of(tokens: list[int], block_size: int = 4, seed: bytes = SEED) -> list[int]:
    return extend_block_hashes([], tokens, block_size, seed)


def snapshot(bm: BlockManager) -> tuple[object, ...]:
    """Everything a failed call must leave untouched."""
    return (
        list(bm._ref),
        list(bm._hash),
        dict(bm._by_hash),
        list(bm._free),
        list(bm._lru),
        {k: list(v) for k, v in bm._tables.items()},
        list(bm._events),
    )


# ---- hashing -----------------------------------------------------------------------------


def test_hash_matches_documented_scheme() -> None:
    """docs/prefix_hashing.md: sha256(seed || parent_le_u64 || tokens_le_u32)[:8], LE u64."""
    seed = hashlib.sha256(b"pdserve-kv-v1" + b"\0" + b"fp" + b"\0" + b"salt").digest()
    assert namespace_seed("fp", "salt") == seed
    tokens = [1, 2, 70000, 2**32 - 1]
    root = hashlib.sha256(seed + b"\0" * 8 + struct.pack("<4I", *tokens)).digest()
    h0 = int.from_bytes(root[:8], "little")
    assert hash_block(seed, None, tokens) == h0
    child = hashlib.sha256(seed + h0.to_bytes(8, "little") + struct.pack("<4I", *tokens)).digest()
    assert hash_block(seed, h0, tokens) == int.from_bytes(child[:8], "little")
    assert hashes_of(tokens * 2 + [5], 4, seed) == [h0, int.from_bytes(child[:8], "little")]


def test_chained_hash_covers_parent() -> None:
    block = [7, 8, 9, 10]
    a = hashes_of([1, 2, 3, 4, *block])
    b = hashes_of([1, 2, 3, 5, *block])
    assert a[0] != b[0]
    assert a[1] != b[1], "same block tokens under different parents must hash differently"
    assert hash_block(SEED, None, block) != hash_block(SEED, a[0], block)
    # Same prefix, same hashes; only complete blocks are hashed.
    assert hashes_of([1, 2, 3, 4, *block, 11, 12]) == a
    assert hashes_of([1, 2, 3]) == []


def test_extend_block_hashes_is_incremental() -> None:
    tokens = list(range(100, 123))
    hashes: list[int] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(hashes, tokens[:n], 4, SEED)
        assert hashes == hashes_of(tokens[:n])


def test_salt_and_fingerprint_change_the_hash_space() -> None:
    tokens = list(range(16))
    seeds = [
        namespace_seed("fp-a"),
        namespace_seed("fp-a", "tenant-1"),
        namespace_seed("fp-a", "tenant-2"),
        namespace_seed("fp-b"),
        namespace_seed("fp-b", "tenant-1"),
    ]
    spaces = [set(hashes_of(tokens, 4, s)) for s in seeds]
    for i in range(len(spaces)):
        for j in range(i + 1, len(spaces)):
            assert not spaces[i] & spaces[j]
    # A block committed under one salt is no prefix hit under another.
    bm = BlockManager(8, 4)
    bm.allocate("a", [], 16)
    bm.commit("a", hashes_of(tokens, 4, seeds[1]))
    bm.free("a")
    assert bm.match_prefix(hashes_of(tokens, 4, seeds[1])) == 4
    assert bm.match_prefix(hashes_of(tokens, 4, seeds[2])) == 0
    assert bm.allocate("b", hashes_of(tokens, 4, seeds[2]), 16).num_cached_tokens == 0


# ---- prefix hits and eviction ------------------------------------------------------------


def test_prefix_hit_returns_the_cached_blocks() -> None:
    bm = BlockManager(16, 4)
    tokens = list(range(50, 64))  # 3 full blocks + 2 tokens
    h = hashes_of(tokens)
    a = bm.allocate("a", h, len(tokens))
    assert a.num_cached_tokens == 0 and len(a.block_ids) == 4
    bm.commit("a", h)
    assert [type(e) for e in bm.take_events()] == [BlockStored]
    # Shared while "a" still runs: same block ids, ref count 2, nothing new taken.
    b = bm.allocate("b", h[:2], len(tokens))
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.num_cached_tokens == 8
    assert not set(b.block_ids[2:]) & set(a.block_ids)
    assert bm._ref[a.block_ids[0]] == 2
    bm.free("a")
    bm.free("b")
    bm.check_integrity()
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 3
    # After both are gone the blocks stay cached; a hit revives them.
    assert bm.blocks_needed(h, len(tokens)) == 4  # 3 revived + 1 fresh
    c = bm.allocate("c", h, len(tokens))
    assert c.block_ids[:3] == a.block_ids[:3] and c.num_cached_tokens == 12
    assert bm.num_cached_blocks == 0
    bm.check_integrity()
    # A hit is capped by num_tokens: only full blocks of the request count.
    bm.free("c")
    d = bm.allocate("d", h, 9)
    assert d.num_cached_tokens == 8 and len(d.block_ids) == 3
    bm.check_integrity()


def test_eviction_is_lru_with_tail_blocks_first() -> None:
    bm = BlockManager(6, 4)
    ha = hashes_of(list(range(12)))  # 3 blocks
    hb = hashes_of(list(range(100, 112)))
    a = bm.allocate("a", [], 12).block_ids
    bm.commit("a", ha)
    b = bm.allocate("b", [], 12).block_ids
    bm.commit("b", hb)
    bm.take_events()
    bm.free("a")  # cached first: oldest
    bm.free("b")
    assert list(bm._lru) == [a[2], a[1], a[0], b[2], b[1], b[0]]
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 6
    # Two fresh blocks evict a's tail then its middle; a's head survives. The table holds
    # them in ascending id order (evicted tail first, placed in order).
    got = bm.allocate("c", [], 8).block_ids
    assert got == (a[1], a[2])
    assert bm.take_events() == [BlockRemoved((ha[2],)), BlockRemoved((ha[1],))]
    assert bm.match_prefix(ha) == 1 and bm.match_prefix(hb) == 3
    # A hit refreshes recency: touching b's head moves it behind a's head.
    bm.allocate("d", hb[:1], 4)
    bm.free("d")
    assert list(bm._lru) == [a[0], b[2], b[1], b[0]]
    bm.allocate("e", [], 12)
    assert bm.take_events() == [
        BlockRemoved((ha[0],)),
        BlockRemoved((hb[2],)),
        BlockRemoved((hb[1],)),
    ]
    assert bm.match_prefix(hb) == 1
    bm.check_integrity()


def test_no_free_blocks_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    h = hashes_of(list(range(12)))
    bm.allocate("a", [], 12)
    bm.commit("a", h)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", [], 8)
    assert snapshot(bm) == before and not bm.has("b")
    with pytest.raises(NoFreeBlocksError):
        bm.grow("a", 24)
    assert snapshot(bm) == before
    # Shared blocks cost nothing: a full-prefix hit plus one fresh block fits.
    assert bm.blocks_needed(h, 13) == 1
    assert bm.allocate("b", h, 13).num_cached_tokens == 12
    bm.check_integrity()


def test_commit_events_and_reset() -> None:
    bm = BlockManager(10, 4)
    h = hashes_of(list(range(16)))
    bm.allocate("a", [], 16)
    bm.commit("a", h[:2])
    bm.commit("a", h[:2])  # idempotent
    bm.commit("a", h)
    assert bm.take_events() == [BlockStored((h[0], h[1]), None), BlockStored((h[2], h[3]), h[1])]
    # A duplicate computed elsewhere is not registered twice; later blocks chain after it.
    h2 = hashes_of(list(range(16)) + [99] * 4)
    bm.allocate("b", [], 20)
    bm.commit("b", h2)
    assert bm.take_events() == [BlockStored((h2[4],), h2[3])]
    assert bm._by_hash[h2[0]] == bm.block_table("a")[0]
    bm.free("b")
    bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]
    assert bm.match_prefix(h) == 0 and bm.num_cached_blocks == 0
    assert bm.num_used_blocks == 4  # "a" keeps its blocks, now unhashed
    bm.check_integrity()
    bm.commit("a", h)  # re-registers
    assert bm.take_events() == [BlockStored(tuple(h), None)]
    bm.free("a")
    assert bm.num_cached_blocks == 4
    bm.check_integrity()


# ---- stateful model ----------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 5), min_size=0, max_size=14)


@dataclass
class Req:
    tokens: list[int]  # everything the request will ever hold
    seed: bytes
    num_tokens: int  # tokens the table currently has room for
    matched: int  # leading blocks that came from the prefix cache
    hashes: list[int] = field(default_factory=list)

    def full_hashes(self, block_size: int) -> list[int]:
        """Hashes of complete blocks within the allocated tokens."""
        return extend_block_hashes([], self.tokens[: self.num_tokens], block_size, self.seed)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(1, 1)
        self.reqs: dict[str, Req] = {}
        self.history: list[list[int]] = [[]]  # token lists seen so far, to share prefixes
        self.registered: set[int] = set()  # mirror built from events only
        self.content: dict[int, int | None] = {}  # block id -> hash of the K/V it holds
        self.seeds = [namespace_seed("fp"), namespace_seed("fp", "salt")]
        self.counter = 0

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.content = dict.fromkeys(range(num_blocks))

    # -- helpers
    def _apply(self, events: list[BlockEvent]) -> None:
        for e in events:
            event(type(e).__name__)
            if isinstance(e, BlockStored):
                assert e.block_hashes, "empty BlockStored"
                for h in e.block_hashes:
                    assert h not in self.registered, "stored a hash twice"
                    self.registered.add(h)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.registered, "removed an unknown hash"
                    self.registered.remove(h)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.registered.clear()

    def _sync(self) -> list[BlockEvent]:
        events = self.bm.take_events()
        self._apply(events)
        return events

    def _pick(self, pick: int) -> str | None:
        return sorted(self.reqs)[pick % len(self.reqs)] if self.reqs else None

    def _tokens(self, base: int, extra: list[int]) -> list[int]:
        prev = self.history[base % len(self.history)]
        cut = len(prev) if base % 3 else len(prev) // 2
        return prev[:cut] + extra

    # -- rules
    @rule(
        base=st.integers(0, 1000),
        extra=TOKENS,
        trim=st.integers(0, 8),
        use=st.integers(0, 10),
        salt=st.sampled_from([0, 0, 0, 1]),
        compute=st.booleans(),
    )
    def allocate(
        self, base: int, extra: list[int], trim: int, use: int, salt: int, compute: bool
    ) -> None:
        """Admit a prompt (often sharing a prefix); with `compute`, prefill and commit it."""
        bs = self.bm.block_size
        tokens = self._tokens(base, extra)
        prompt = tokens[: len(tokens) - trim]  # the rest comes later (grow)
        if not prompt:
            return
        self.history.append(tokens)
        seed = self.seeds[salt]
        # Hashes may run past the tokens allocated now (the cap is the manager's job).
        hashes = extend_block_hashes([], tokens, bs, seed)[:use]
        rid = f"r{self.counter}"
        self.counter += 1
        need = self.bm.blocks_needed(hashes, len(prompt))
        expect_hit = min(self.bm.match_prefix(hashes), len(prompt) // bs)
        expected_blocks = [self.bm._by_hash[h] for h in hashes[:expect_hit]]
        if need > self.bm.num_free_blocks:
            before = snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(rid, hashes, len(prompt))
            assert snapshot(self.bm) == before
            event("allocate: NoFreeBlocksError")
            return
        free_before = self.bm.num_free_blocks
        alloc = self.bm.allocate(rid, hashes, len(prompt))
        assert self.bm.num_free_blocks == free_before - need
        assert len(alloc.block_ids) == -(-len(prompt) // bs)
        assert len(set(alloc.block_ids)) == len(alloc.block_ids)
        assert alloc.num_cached_tokens == expect_hit * bs
        assert list(alloc.block_ids[:expect_hit]) == expected_blocks
        if expect_hit:
            event("allocate: prefix hit")
        for j, b in enumerate(alloc.block_ids):
            if j < expect_hit:
                assert self.content[b] == hashes[j], "prefix hit on a block with other K/V"
            else:
                assert self.bm._ref[b] == 1
                self.content[b] = None  # about to be overwritten by this request
        self.reqs[rid] = Req(tokens, seed, len(prompt), expect_hit)
        if compute:
            self._commit(rid, len(prompt))

    @rule(pick=st.integers(0, 100), more=st.integers(0, 14))
    def grow(self, pick: int, more: int) -> None:
        rid = self._pick(pick)
        if rid is None:
            return
        req = self.reqs[rid]
        bs = self.bm.block_size
        n = min(req.num_tokens + more, len(req.tokens)) if more % 7 else req.num_tokens + more
        table_before = list(self.bm.block_table(rid))
        need = max(0, -(-n // bs) - len(table_before))
        if need > self.bm.num_free_blocks:
            before = snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.grow(rid, n)
            assert snapshot(self.bm) == before
            event("grow: NoFreeBlocksError")
            return
        new = self.bm.grow(rid, n)
        assert len(new) == need
        assert self.bm.block_table(rid) == table_before + new
        for b in new:
            self.content[b] = None
        req.num_tokens = max(req.num_tokens, n)

    @rule(pick=st.integers(0, 100), upto=st.integers(0, 20))
    def commit(self, pick: int, upto: int) -> None:
        rid = self._pick(pick)
        if rid is not None:
            self._commit(rid, upto)

    def _commit(self, rid: str, upto: int) -> None:
        """The request computed blocks [0, upto): write their contents, then register them."""
        req = self.reqs[rid]
        self._sync()
        hashes = req.full_hashes(self.bm.block_size)[:upto]
        table = self.bm.block_table(rid)
        for j, h in enumerate(hashes):
            b = table[j]
            if j < req.matched:
                assert self.content[b] == h
            else:
                assert self.content[b] in (None, h), "owner rewrote a block with other K/V"
                self.content[b] = h
        self.bm.commit(rid, hashes)
        for e in self._sync():
            assert isinstance(e, BlockStored)
            start = hashes.index(e.block_hashes[0])
            assert list(e.block_hashes) == hashes[start : start + len(e.block_hashes)]
            assert e.parent_hash == (hashes[start - 1] if start else None)
        for h in hashes:
            assert h in self.bm._by_hash

    @rule(pick=st.integers(0, 100))
    def free(self, pick: int) -> None:
        rid = self._pick(pick)
        if rid is None:
            return
        table = list(self.bm.block_table(rid))
        self.bm.free(rid)
        del self.reqs[rid]
        assert not self.bm.has(rid)
        for b in table:
            if self.bm._ref[b] == 0 and self.bm._hash[b] is None:
                self.content[b] = None  # back on the free list: contents are garbage

    @rule(base=st.integers(0, 1000), extra=TOKENS, salt=st.integers(0, 1))
    def match_prefix(self, base: int, extra: list[int], salt: int) -> None:
        hashes = extend_block_hashes(
            [], self._tokens(base, extra), self.bm.block_size, self.seeds[salt]
        )
        before = snapshot(self.bm)
        n = self.bm.match_prefix(hashes)
        assert snapshot(self.bm) == before
        expected = 0
        for h in hashes:
            if h not in self.registered:
                break
            expected += 1
        assert n == expected

    @rule(go=st.integers(0, 3))
    def reset_prefix_cache(self, go: int) -> None:
        if go:  # rarer than the other rules, so that the cache gets to fill up
            return
        self.bm.reset_prefix_cache()
        assert self._sync()[-1] == AllBlocksCleared()
        assert self.bm.num_cached_blocks == 0
        for b in range(self.bm.num_blocks):
            if self.bm._ref[b] == 0:
                self.content[b] = None

    # -- invariants
    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_integrity()
        self._sync()
        assert self.registered == set(bm._by_hash)
        for h, b in bm._by_hash.items():
            assert self.content[b] == h, f"block {b} registered as {h} holds other K/V"
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        held = {b for r in self.reqs for b in bm.block_table(r)}
        assert len(held) == bm.num_used_blocks
        assert set(self.reqs) == set(bm._tables)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_fresh_blocks_come_in_ascending_order_so_transfers_coalesce() -> None:
    """A cached request's blocks are evicted tail first, i.e. in descending id order; the
    next request must still get them as one ascending run (one transfer message per layer
    rather than one per block)."""
    bm = BlockManager(16, 4)
    first = bm.allocate("a", [], 32).block_ids  # 8 blocks
    bm.commit("a", hashes_of(list(range(32))))
    bm.free("a")
    assert bm.num_cached_blocks == 8
    bm.allocate("fill", [], 32)  # the 8 never-used blocks
    again = bm.allocate("b", [], 32).block_ids  # all 8 evicted from the LRU
    assert sorted(again) == sorted(first)
    assert list(again) == sorted(again)
    assert all(y == x + 1 for x, y in itertools.pairwise(again))
    bm.free("b")
    bm.free("fill")
    bm.allocate("c", [], 4)
    grown = bm.grow("c", 64)  # 15 more blocks, from the free list and the LRU
    assert grown == sorted(grown)
    bm.check_integrity()
