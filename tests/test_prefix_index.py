"""The prefix index contract, run against both implementations.

`MemoryPrefixIndex` and `RedisPrefixIndex` (a real redis-server this module starts on a free
port, in a tmp dir) must answer the same: leading-run lookups over several workers, block
removal, cache clears, epochs (a new one makes the old entries unusable at once, and removes
them), reconciling refreshes, and disjoint cache salts. Redis-only checks: the documented key
layout in one cluster hash slot, TTLs on block and worker keys, a lookup costing one round
trip, and fail-open (a stopped, frozen or absent server is a miss within a bounded time, and
a fresh empty server fills up again from refreshes, with the same index object).

`RedisServer` is shared with tests/test_prefix_routing.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.block_manager import BlockManager
from engine.prefix_hash import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    extend_block_hashes,
    namespace_seed,
)
from pool_api import index_feed
from pool_api.config import IndexConfig
from pool_api.index_feed import IndexFeed
from pool_api.prefix_index import (
    MemoryPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
    hash_hex,
)

redis = pytest.importorskip("redis")

pytestmark = pytest.mark.timeout(120)

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
MODEL = "unit-model"
FP = "0123456789abcdef"  # a model fingerprint
BS = 16


# ---- a redis-server of our own -------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """redis-server on 127.0.0.1:`port` (no persistence), startable again on the same port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> Any:
        return redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        args += ["--loglevel", "warning", "--protected-mode", "no"]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.workdir
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                pass
            assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test froze it
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed (make redis)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


# ---- helpers -------------------------------------------------------------------------------
def hashes_of(tokens: list[int], salt: str = "") -> list[int]:
    return extend_block_hashes([], tokens, BS, namespace_seed(FP, salt))


H = hashes_of(list(range(10 * BS)))  # a 10-block prompt's chain
OTHER = hashes_of(list(range(1000, 1000 + 4 * BS)))  # an unrelated prompt


def stored(hs: list[int]) -> BlockStored:
    return BlockStored(tuple(hs), None)


IndexMaker = Callable[[], PrefixIndex]


def run(make: IndexMaker, body: Callable[[PrefixIndex], Awaitable[None]]) -> None:
    """Build the index on a fresh event loop (redis.asyncio binds connections to one)."""

    async def main() -> None:
        index = make()
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(main())


@pytest.fixture(params=["memory", "redis"])
def make(request: pytest.FixtureRequest) -> IndexMaker:
    if request.param == "memory":
        return MemoryPrefixIndex
    server: RedisServer = request.getfixturevalue("redis_server")
    server.client().flushall()
    return lambda: RedisPrefixIndex(server.url, MODEL, ttl_s=60.0, timeout_s=1.0)


# ---- the contract, both implementations ----------------------------------------------------
def test_lookup_is_the_leading_run_per_worker(make: IndexMaker) -> None:
    async def body(ix: PrefixIndex) -> None:
        assert await ix.lookup(H) == {}
        assert await ix.lookup([]) == {}
        await ix.register("w1", "e1")
        await ix.register("w2", "e2")
        await ix.register("w3", "e3")
        await ix.publish("w1", "e1", [stored(H[:6])])
        await ix.publish("w2", "e2", [stored(H[:3])])
        await ix.publish("w3", "e3", [stored(H[1:8])])  # everything but the first block
        assert await ix.lookup(H) == {"w1": 6, "w2": 3}
        assert await ix.lookup(H[:2]) == {"w1": 2, "w2": 2}
        assert await ix.lookup(H[1:]) == {"w1": 5, "w2": 2, "w3": 7}
        assert await ix.lookup([OTHER[0], *H]) == {}  # the first block misses: nothing
        # a holder that misses a block drops out even if it holds later ones
        await ix.publish("w2", "e2", [stored(H[4:6])])
        assert await ix.lookup(H) == {"w1": 6, "w2": 3}
        # the run stops at the first block no live worker holds
        await ix.publish("w1", "e1", [stored(H[7:10])])
        assert await ix.lookup(H) == {"w1": 6, "w2": 3}
        assert await ix.lookup(OTHER) == {}
        assert ix.errors == 0

    run(make, body)


def test_block_removed_and_all_cleared(make: IndexMaker) -> None:
    async def body(ix: PrefixIndex) -> None:
        await ix.register("w1", "e1")
        await ix.register("w2", "e2")
        await ix.publish("w1", "e1", [stored(H)])
        await ix.publish("w2", "e2", [stored(H[:4]), stored(OTHER)])
        await ix.publish("w1", "e1", [BlockRemoved((H[5], H[9]))])
        assert await ix.lookup(H) == {"w1": 5, "w2": 4}
        await ix.publish("w2", "e2", [AllBlocksCleared()])
        assert await ix.lookup(H) == {"w1": 5}
        assert await ix.lookup(OTHER) == {}
        # the same epoch goes on after a clear (a cache reset, not a restart)
        await ix.publish("w2", "e2", [stored(H[:2])])
        assert await ix.lookup(H) == {"w1": 5, "w2": 2}
        # events apply in order within one publish
        await ix.publish("w1", "e1", [BlockRemoved((H[0],)), stored([H[0]])])
        await ix.publish("w2", "e2", [stored([H[2]]), AllBlocksCleared(), stored([H[0]])])
        assert await ix.lookup(H) == {"w1": 5, "w2": 1}
        await ix.drop("w1")
        assert await ix.lookup(H) == {"w2": 1}
        assert ix.errors == 0

    run(make, body)


def test_new_epoch_makes_old_entries_unusable_and_removes_them(
    make: IndexMaker, request: pytest.FixtureRequest
) -> None:
    async def body(ix: PrefixIndex) -> None:
        await ix.register("w1", "old")
        await ix.register("w2", "e2")
        await ix.publish("w1", "old", [stored(H), stored(OTHER)])
        await ix.publish("w2", "e2", [stored(H[:3])])
        assert await ix.lookup(H) == {"w1": 10, "w2": 3}
        await ix.register("w1", "new")  # the worker restarted
        assert await ix.lookup(H) == {"w2": 3}
        assert await ix.lookup(OTHER) == {}
        # a late publish of the superseded epoch never counts
        await ix.publish("w1", "old", [stored(OTHER)])
        assert await ix.lookup(OTHER) == {}
        # registering the current epoch again changes nothing
        await ix.publish("w1", "new", [stored(H[:7])])
        await ix.register("w1", "new")
        assert await ix.lookup(H) == {"w1": 7, "w2": 3}
        if isinstance(ix, MemoryPrefixIndex):
            assert ix.epochs["w1"] == "new"
            assert ix.held["w1"] == set(H[:7])
            assert all(ix.blocks[h] == {"w1": "new", "w2": "e2"} for h in H[:3])
            assert all(h not in ix.blocks for h in H[7:])
        else:
            assert isinstance(ix, RedisPrefixIndex)
            assert await ix.client.hget(ix.epochs_key, "w1") == b"new"

    run(make, body)
    if make is MemoryPrefixIndex:
        return
    # Redis: right after the re-register, the old entries are gone from the keys themselves.
    server: RedisServer = request.getfixturevalue("redis_server")
    r = server.client()
    r.flushall()

    async def restart(ix: PrefixIndex) -> None:
        assert isinstance(ix, RedisPrefixIndex)
        await ix.register("w1", "old")
        await ix.register("w2", "e2")
        await ix.publish("w1", "old", [stored(H)])
        await ix.publish("w2", "e2", [stored(H[:3])])
        assert r.hget(ix.block_key(H[0]), "w1") == "old"
        assert r.scard(ix.worker_key("w1")) == 10
        await ix.register("w1", "new")
        assert all(r.hget(ix.block_key(h), "w1") is None for h in H)
        assert r.exists(ix.worker_key("w1")) == 0
        assert r.hgetall(ix.block_key(H[0])) == {"w2": "e2"}
        assert r.exists(ix.block_key(H[5])) == 0  # no holder left: the key is gone
        assert r.hget(ix.epochs_key, "w1") == "new"

    run(make, restart)


def test_refresh_reasserts_exactly_what_is_held(make: IndexMaker) -> None:
    async def body(ix: PrefixIndex) -> None:
        await ix.register("w1", "e1")
        await ix.publish("w1", "e1", [stored(H), stored(OTHER)])
        # the worker evicted H[4:] and OTHER while those events were lost
        await ix.refresh("w1", "e1", H[:4])
        assert await ix.lookup(H) == {"w1": 4}
        assert await ix.lookup(OTHER) == {}
        # a refresh alone (an emptied backend, no register) makes a worker live again
        await ix.refresh("w2", "e2", H[:2])
        assert await ix.lookup(H) == {"w1": 4, "w2": 2}
        # a refresh with a new epoch replaces the old one's entries
        await ix.refresh("w1", "e9", H[:1])
        assert await ix.lookup(H) == {"w1": 1, "w2": 2}
        # A late publish of the old epoch never makes its entries count (Redis writes them
        # and may shadow the current epoch's: a miss, which the index may always answer).
        await ix.publish("w1", "e1", [stored(H)])
        got = await ix.lookup(H)
        assert got.get("w1", 0) <= 1 and got["w2"] == 2
        assert ix.errors == 0

    run(make, body)


def test_cache_salts_never_share_hits(make: IndexMaker) -> None:
    tokens = list(range(7, 7 + 8 * BS))
    a, b, plain = hashes_of(tokens, "tenant-a"), hashes_of(tokens, "tenant-b"), hashes_of(tokens)
    assert not set(a) & set(b) and not set(a) & set(plain)

    async def body(ix: PrefixIndex) -> None:
        await ix.register("w1", "e1")
        await ix.publish("w1", "e1", [stored(a)])
        assert await ix.lookup(a) == {"w1": 8}
        assert await ix.lookup(b) == {}
        assert await ix.lookup(plain) == {}

    run(make, body)


# ---- the feed: a restarted worker's new epoch ----------------------------------------------
class FakeLoop:
    """What IndexFeed needs from an EngineLoop: the block manager and `run`."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(blocks=BlockManager(64, BS))

    async def run(self, fn: Callable[[], Any]) -> Any:
        return fn()


def hold(loop: FakeLoop, rid: str, hs: list[int]) -> None:
    blocks: BlockManager = loop.engine.blocks
    blocks.allocate(rid, hs, len(hs) * BS)
    blocks.commit(rid, hs)
    blocks.free(rid)


async def wait_for(cond: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_restarted_worker_feed_supersedes_old_entries(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_feed, "PUBLISH_INTERVAL_S", 0.02)
    url = None
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        server.client().flushall()
        url = server.url
    cfg = IndexConfig(redis_url=url, timeout_s=1.0)

    async def main() -> None:
        router_ix: PrefixIndex = (
            RedisPrefixIndex(url, MODEL, timeout_s=1.0) if url else MemoryPrefixIndex()
        )

        async def pull(feed: IndexFeed) -> None:  # what Router.refresh does in memory mode
            if url is None:
                upd = await feed.take(with_held=True)
                await router_ix.register(upd.worker, upd.epoch)
                await router_ix.publish(upd.worker, upd.epoch, upd.events)
                assert upd.held is not None
                await router_ix.refresh(upd.worker, upd.epoch, upd.held)

        async def holders() -> dict[str, int]:
            return await router_ix.lookup(H)

        first_loop, other_loop = FakeLoop(), FakeLoop()
        first = IndexFeed("w1", cfg, MODEL, first_loop)  # type: ignore[arg-type]
        other = IndexFeed("w2", cfg, MODEL, other_loop)  # type: ignore[arg-type]
        hold(first_loop, "a", H)
        hold(other_loop, "b", H[:2])
        await pull(first)
        await pull(other)
        await wait_for(lambda: _eq(holders(), {"w1": 10, "w2": 2}))

        await first.stop()  # the worker died; Ray starts it again with an empty cache
        restarted_loop = FakeLoop()
        restarted = IndexFeed("w1", cfg, MODEL, restarted_loop)  # type: ignore[arg-type]
        assert restarted.epoch != first.epoch
        await pull(restarted)
        await wait_for(lambda: _eq(holders(), {"w2": 2}))
        hold(restarted_loop, "c", H[:5])
        await pull(restarted)
        await wait_for(lambda: _eq(holders(), {"w1": 5, "w2": 2}))
        for f in (restarted, other):
            await f.stop()
        await router_ix.close()

    asyncio.run(main())


async def _eq(got: Awaitable[dict[str, int]], want: dict[str, int]) -> bool:
    return await got == want


# ---- Redis only ----------------------------------------------------------------------------
def test_redis_key_layout_and_hash_slot(redis_server: RedisServer) -> None:
    from redis.crc import key_slot

    r = redis_server.client()
    r.flushall()

    async def body(ix: PrefixIndex) -> None:
        await ix.register("pdserve-prefill-0", "e1")
        await ix.publish("pdserve-prefill-0", "e1", [stored(H[:3])])

    run(lambda: RedisPrefixIndex(redis_server.url, "my-model"), body)
    keys = set(r.keys("*"))
    assert keys == {
        "pdserve:{my-model}:epochs",
        "pdserve:{my-model}:w:pdserve-prefill-0",
        *(f"pdserve:{{my-model}}:b:{h:016x}" for h in H[:3]),
    }
    assert {key_slot(k.encode()) for k in keys} == {key_slot(b"my-model")}
    assert r.type("pdserve:{my-model}:epochs") == "hash"
    assert r.hgetall("pdserve:{my-model}:epochs") == {"pdserve-prefill-0": "e1"}
    assert r.hgetall(f"pdserve:{{my-model}}:b:{hash_hex(H[0])}") == {"pdserve-prefill-0": "e1"}
    assert r.smembers("pdserve:{my-model}:w:pdserve-prefill-0") == {hash_hex(h) for h in H[:3]}
    assert len(hash_hex(H[0])) == 16


def test_redis_ttls_on_block_and_worker_keys(redis_server: RedisServer) -> None:
    r = redis_server.client()
    r.flushall()

    async def body(ix: PrefixIndex) -> None:
        assert isinstance(ix, RedisPrefixIndex)
        await ix.register("w1", "e1")
        await ix.publish("w1", "e1", [stored(H[:4])])
        for key in [ix.block_key(h) for h in H[:4]] + [ix.worker_key("w1")]:
            assert 0 < r.ttl(key) <= 30, key
        await ix.refresh("w1", "e1", H[:2])
        for key in [ix.block_key(h) for h in H[:2]] + [ix.worker_key("w1")]:
            assert 0 < r.ttl(key) <= 30, key
        assert r.ttl(ix.epochs_key) == -1  # one small hash; entries live as long as workers

    run(lambda: RedisPrefixIndex(redis_server.url, MODEL, ttl_s=30.0), body)

    async def short(ix: PrefixIndex) -> None:  # sub-second TTLs are honoured, not rounded to 0
        assert isinstance(ix, RedisPrefixIndex)
        await ix.register("w1", "e1")
        await ix.publish("w1", "e1", [stored(H[:4])])
        assert 0 < r.pttl(ix.block_key(H[0])) <= 400
        assert 0 < r.pttl(ix.worker_key("w1")) <= 400
        assert await ix.lookup(H) == {"w1": 4}
        await asyncio.sleep(0.6)
        assert await ix.lookup(H) == {}  # not refreshed: expired
        assert r.exists(ix.worker_key("w1"), *(ix.block_key(h) for h in H[:4])) == 0

    run(lambda: RedisPrefixIndex(redis_server.url, MODEL, ttl_s=0.4), short)


def test_redis_refresh_of_a_large_cache(redis_server: RedisServer) -> None:
    r = redis_server.client()
    r.flushall()
    chain = hashes_of(list(range(5000 * BS)))  # more blocks than one refresh pipeline takes

    async def body(ix: PrefixIndex) -> None:
        assert isinstance(ix, RedisPrefixIndex)
        await ix.refresh("w1", "e1", chain)
        assert r.scard(ix.worker_key("w1")) == 5000
        assert await ix.lookup(chain[:128]) == {"w1": 128}
        assert await ix.lookup(chain[4900:]) == {"w1": 100}
        await ix.refresh("w1", "e1", chain[:2500])
        assert r.scard(ix.worker_key("w1")) == 2500
        assert r.exists(ix.block_key(chain[2500]), ix.block_key(chain[4999])) == 0
        assert await ix.lookup(chain[2400:2600]) == {"w1": 100}
        assert ix.errors == 0

    run(lambda: RedisPrefixIndex(redis_server.url, MODEL, timeout_s=2.0), body)


def test_redis_lookup_is_one_round_trip(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis.asyncio.connection import AbstractConnection

    r = redis_server.client()
    r.flushall()
    sends = 0
    original = AbstractConnection.send_packed_command

    async def counting(self: Any, command: Any, check_health: bool = True) -> None:
        nonlocal sends
        sends += 1
        await original(self, command, check_health)

    def cmdstats() -> dict[str, int]:
        return {k: v["calls"] for k, v in r.info("commandstats").items()}

    async def body(ix: PrefixIndex) -> None:
        nonlocal sends
        for w in range(4):
            await ix.register(f"w{w}", "e")
            await ix.publish(f"w{w}", "e", [stored(H[: 3 + w])])
        assert await ix.lookup(H) == {"w0": 3, "w1": 4, "w2": 5, "w3": 6}  # loads the script
        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
        before = cmdstats()
        sends = 0
        assert await ix.lookup(H) == {"w0": 3, "w1": 4, "w2": 5, "w3": 6}
        assert sends == 1
        after = cmdstats()
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        delta.pop("cmdstat_info", None)
        # one EVALSHA from the client; the HGETALLs (epochs + 7 blocks) run inside the script
        assert delta == {"cmdstat_evalsha": 1, "cmdstat_hgetall": 1 + 7}

    run(lambda: RedisPrefixIndex(redis_server.url, MODEL), body)


def test_redis_fail_open_and_recovery(tmp_path: Path) -> None:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path / "redis").start()
    timeout_s = 0.1
    bound_s = 5 * timeout_s + 0.5  # the guard's bound plus scheduling slack on a busy box

    async def timed(coro: Awaitable[Any]) -> tuple[Any, float]:
        t0 = time.monotonic()
        out = await coro
        return out, time.monotonic() - t0

    async def body() -> None:
        ix = RedisPrefixIndex(server.url, MODEL, ttl_s=60.0, timeout_s=timeout_s)
        await ix.register("w1", "e1")
        await ix.publish("w1", "e1", [stored(H)])
        assert await ix.lookup(H) == {"w1": 10}
        assert ix.errors == 0

        server.freeze()  # up but not answering: only the timeout can end a call
        try:
            got, took = await timed(ix.lookup(H))
            assert got == {} and took < bound_s, took
            assert ix.errors == 1
        finally:
            server.thaw()

        server.stop()  # gone: refused at once
        for call in (
            ix.lookup(H),
            ix.register("w1", "e1"),
            ix.publish("w1", "e1", [stored(H), BlockRemoved((H[0],)), AllBlocksCleared()]),
            ix.refresh("w1", "e1", H),
            ix.drop("w1"),
        ):
            got, took = await timed(call)
            assert took < bound_s, took
        assert await ix.lookup(H) == {}
        assert ix.errors >= 7

        server.start()  # a fresh, empty server on the same address
        assert server.client().dbsize() == 0
        assert await ix.lookup(H) == {}
        errors = ix.errors
        await ix.refresh("w1", "e1", H[:6])  # what every worker's feed does periodically
        assert await ix.lookup(H) == {"w1": 6}
        assert ix.errors == errors
        await ix.close()

        absent = RedisPrefixIndex(f"redis://127.0.0.1:{free_port()}", MODEL, timeout_s=timeout_s)
        got, took = await timed(absent.lookup(H))
        assert got == {} and took < bound_s and absent.errors == 1
        await absent.close()

    try:
        asyncio.run(body())
    finally:
        server.stop()


def test_memory_index_leaves_no_empty_entries() -> None:
    async def body(ix: PrefixIndex) -> None:
        assert isinstance(ix, MemoryPrefixIndex)
        await ix.publish("w1", "e1", [stored(H)])  # an unregistered worker: registers
        assert ix.epochs == {"w1": "e1"}
        await ix.publish("w1", "e1", [BlockRemoved(tuple(H[5:]))])
        await ix.refresh("w1", "e1", H[:2])
        assert set(ix.blocks) == set(H[:2])
        await ix.drop("w1")
        assert ix.blocks == {} and ix.held == {} and ix.epochs == {}

    run(MemoryPrefixIndex, body)
