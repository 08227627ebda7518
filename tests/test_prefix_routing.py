"""Prefix-aware routing end to end: real Ray actors, real gRPC, a real redis-server.

One Ray cluster and one redis-server (started here on a free port) serve the module; two
deployments run on it, one after the other, each with 2 prefill + 1 decode workers (KV over
gRPC, tiny preset):

- `TestRedisIndex` (`index.redis_url` set, 1 s refresh): a request sharing a >= 90 % prefix
  of a 1k-token prompt goes to the prefill worker holding it, reports the prefix as cached and
  returns the same greedy tokens as a cold run (a different cache salt, which reports nothing
  cached); cache salts never share hits; redis-server stopped in the middle of a 100-request
  load costs no request, and a fresh, empty Redis on the same address fills up again and
  brings the hits back without restarting anything; a prefill worker killed and restarted by
  Ray (max_restarts=1) makes its old entries unusable the moment its new epoch registers.
- `TestMemoryIndex`: the same routing check with the default in-router index.

Routing ties go to the first worker, so a prefix that lands on prefill-1 is placed there by
making prefill-0 look busy for that one request (`steer`); a later request that still goes to
prefill-1 with equal loads can only have been sent there by the index.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_prefix_index import REDIS_SERVER, RedisServer

from engine.prefix_hash import extend_block_hashes, namespace_seed
from pdserve.checkpoint import write_checkpoint
from pdserve.client import Client, Completion
from pdserve.config import ServeConfig
from pdserve.launch import Deployment, build_router, engine_config, served_name
from pool_api.config import WorkerConfig
from pool_api.messages import Role
from router.clients import DecodeClient, PrefillClient
from router.core import Router
from router.service import RouterServer, start_server
from tests.in_process import start_local_ray

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)

SERVED_NAME = "tiny-prefix"
P0, P1, D0 = "pdserve-prefill-0", "pdserve-prefill-1", "pdserve-decode-0"
BS = 16
PROMPT_LEN = 1024
SHARED = 58 * BS  # 928 tokens: the shortest block-aligned prefix >= 90 % of the prompt
MAX_TOKENS = 8


# ---- helpers -------------------------------------------------------------------------------
class Served:
    """The router's gRPC server on an asyncio loop in a thread, in front of a Deployment
    (Ray actors), or, `in_process`, of plain worker objects on that same loop (cheap)."""

    def __init__(self, cfg: ServeConfig, in_process: bool = False, num_decode: int = 1) -> None:
        self.num_decode = num_decode
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.deployment: Deployment | None = None
        self.workers: list[Any] = []
        if in_process:
            self.router: Router = self.call(self._in_process(cfg))
        else:
            self.deployment = Deployment(cfg)
            self.router = self.deployment.start()
        self.server: RouterServer = self.call(self._up())
        self.client = Client(f"127.0.0.1:{self.server.port}", timeout_s=120)

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _in_process(self, cfg: ServeConfig) -> Router:
        from decode_workers.worker import DecodeWorker
        from prefill_workers.worker import PrefillWorker

        model_path = Path(cfg.model.model)
        ecfg = engine_config(cfg, model_path)

        def wcfg(name: str, role: Role) -> WorkerConfig:
            return WorkerConfig(name, ecfg, cfg.transfer, cfg.index, served_name(cfg), role=role)

        prefill = [PrefillWorker(wcfg(f"pdserve-prefill-{i}", Role.PREFILL)) for i in range(2)]
        decode = [
            DecodeWorker(wcfg(f"pdserve-decode-{i}", Role.DECODE)) for i in range(self.num_decode)
        ]
        self.workers = [*prefill, *decode]
        return build_router(
            cfg,
            model_path,
            [PrefillClient(w.name, w) for w in prefill],
            [DecodeClient(w.name, w) for w in decode],
        )

    async def _up(self) -> RouterServer:
        server = await start_server(self.router, "127.0.0.1", 0)
        await self.router.start()
        await server.set_serving(True)
        return server

    async def _down(self) -> None:
        await self.router.drain(1.0)
        await self.server.server.stop(grace=0.5)

    def generate(self, ids: list[int], salt: str = "", max_tokens: int = MAX_TOKENS) -> Completion:
        out = self.client.generate(
            ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt
        )
        assert out.complete is not None and len(out.token_ids) == max_tokens
        return out

    def hashes(self, ids: list[int], salt: str = "") -> list[int]:
        seed = namespace_seed(self.router.model_info.model_fingerprint, salt)
        return extend_block_hashes([], ids[: (len(ids) - 1) // BS * BS], BS, seed)

    def lookup(self, ids: list[int], salt: str = "") -> dict[str, int]:
        return dict(self.call(self.router.index.lookup(self.hashes(ids, salt))))

    def wait_lookup(
        self, ids: list[int], ok: Callable[[dict[str, int]], bool], timeout_s: float = 30
    ) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.lookup(ids)
            if ok(got):
                return got
            assert time.monotonic() < deadline, f"index never satisfied the check: {got}"
            time.sleep(0.05)

    def steer(self, busy: str, ids: list[int], salt: str = "") -> Completion:
        """Serve one request while prefill worker `busy` looks loaded (so it goes elsewhere)."""
        [w] = [w for w in self.router.prefill.workers if w.name == busy]

        async def add(n: int) -> None:
            w.outstanding_tokens += n

        self.call(add(10**9))
        try:
            return self.generate(ids, salt)
        finally:
            self.call(add(-(10**9)))

    def close(self) -> None:
        self.client.close()
        try:
            self.call(self._down())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            for w in self.workers:
                w.shutdown()
            if self.deployment is not None:
                self.deployment.stop()


def prompt(seed: int | str, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(n)]


def sharing(base: list[int], seed: int | str, shared: int = SHARED) -> list[int]:
    """Same length as `base`; the first `shared` tokens equal, the rest differ."""
    tail = prompt(seed, len(base) - shared)
    if tail[0] == base[shared]:
        tail[0] = 4 + (tail[0] - 3) % 508
    return base[:shared] + tail


def serve_config(model_dir: Path, redis_url: str | None, transport: str = "grpc") -> ServeConfig:
    index: dict[str, Any] = {"refresh_interval_s": 1.0, "timeout_s": 0.5}
    if redis_url:
        index["redis_url"] = redis_url
    return ServeConfig.load(
        None,
        {
            "model": {"model": str(model_dir), "served_model_name": SERVED_NAME},
            "router": {"grpc": {"port": 0}},
            "prefill": {"num_workers": 2, "max_restarts": 1},
            "decode": {"num_workers": 1},
            "transfer": {"transport": transport},
            "scheduler": {"max_model_len": 2048},
            "index": index,
        },
    )


def check_routes_to_prefix_holder(s: Served, tag: str) -> None:
    """A on prefill-0 (tie), B on prefill-1 (steered); requests sharing >= 90 % of either go
    to its holder with the prefix cached, and match a cold run token for token."""
    a, b = prompt(f"{tag}-a"), prompt(f"{tag}-b")
    a2, b2 = sharing(a, f"{tag}-a2"), sharing(b, f"{tag}-b2")
    assert a2[:SHARED] == a[:SHARED] and a2[SHARED] != a[SHARED]

    first_a = s.generate(a)
    first_b = s.steer(P0, b)
    assert first_a.complete and first_a.complete.prefill_worker == P0
    assert first_b.complete and first_b.complete.prefill_worker == P1
    assert first_a.complete.usage.cached_tokens == first_b.complete.usage.cached_tokens == 0
    got_a = s.wait_lookup(a2, lambda m: m.get(P0, 0) >= SHARED // BS)
    got_b = s.wait_lookup(b2, lambda m: m.get(P1, 0) >= SHARED // BS)
    assert got_a.get(P1, 0) == 0 and got_b.get(P0, 0) == 0

    for ids, holder in ((a2, P0), (b2, P1)):
        warm = s.generate(ids)
        assert warm.complete is not None
        assert warm.complete.prefill_worker == holder
        assert warm.complete.usage.cached_tokens >= 0.9 * len(ids)
        assert warm.complete.usage.cached_tokens == SHARED
        cold = s.generate(ids, salt=f"cold-{tag}")
        assert cold.complete is not None and cold.complete.usage.cached_tokens == 0
        assert warm.token_ids == cold.token_ids


# ---- module fixtures -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("pdserve-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("PDSERVE_HOME", str(home))
    yield write_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")
    mp.undo()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (make redis)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ray_cluster(model_dir: Path) -> Iterator[None]:
    start_local_ray()
    yield
    ray.shutdown()


# ---- Redis ---------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def served_redis(ray_cluster: None, model_dir: Path, redis_server: RedisServer) -> Iterator[Served]:
    s = Served(serve_config(model_dir, redis_server.url))
    yield s
    s.close()


KEY = f"pdserve:{{{SERVED_NAME}}}:"


class TestRedisIndex:
    def test_routes_to_prefix_holder(self, served_redis: Served, redis_server: RedisServer) -> None:
        assert served_redis.router.index.backend == "redis"
        check_routes_to_prefix_holder(served_redis, "redis")
        r = redis_server.client()
        assert set(r.hkeys(KEY + "epochs")) == {P0, P1, D0}
        assert r.exists(KEY + "w:" + P0, KEY + "w:" + P1, KEY + "w:" + D0) == 3
        assert served_redis.router.index.errors == 0

    def test_cache_salts_never_share_hits(self, served_redis: Served) -> None:
        s = served_redis
        c = prompt("salted", 512)
        first = s.generate(c, salt="tenant-1")
        assert first.complete and first.complete.usage.cached_tokens == 0
        deadline = time.monotonic() + 30
        while s.lookup(c, "tenant-1").get(first.complete.prefill_worker, 0) != 31:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for salt in ("tenant-2", "", "tenant-10"):
            assert s.lookup(c, salt) == {}, salt
        for salt in ("tenant-2", "", "tenant-10"):
            other = s.generate(c, salt=salt)
            assert other.complete and other.complete.usage.cached_tokens == 0, salt
        again = s.generate(c, salt="tenant-1")
        assert again.complete and again.complete.usage.cached_tokens == 496
        assert again.token_ids == first.token_ids

    def test_redis_outage_under_load(self, served_redis: Served, redis_server: RedisServer) -> None:
        s = served_redis
        r = redis_server.client()
        # a prefix held by prefill-1 from before the outage
        e = prompt("before-outage", 256)
        assert s.steer(P0, e).complete.prefill_worker == P1  # type: ignore[union-attr]
        s.wait_lookup(e, lambda m: m.get(P1, 0) == 15)

        bases = [prompt(f"load-{i}", 96) for i in range(10)]
        reqs = [bases[i % 10] + prompt(f"load-tail-{i}", 24) for i in range(100)]
        done = 0
        lock = threading.Lock()

        def one(ids: list[int]) -> Completion:
            nonlocal done
            out = s.client.generate(ids, max_tokens=4, temperature=0.0, ignore_eos=True)
            with lock:
                done += 1
            return out

        errors_before = s.router.index.errors
        run_id = r.info("server")["run_id"]
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one, ids) for ids in reqs]
            deadline = time.monotonic() + 60
            while done < 15:
                assert time.monotonic() < deadline, "the load does not progress"
                time.sleep(0.01)
            redis_server.stop()
            stopped_at = done
            results = [f.result(timeout=120) for f in futures]
        assert stopped_at < 100
        for out in results:
            assert out.complete is not None and len(out.token_ids) == 4
            assert out.complete.usage.completion_tokens == 4
        # Redis still down: lookups fail open, requests go on
        assert s.generate(prompt("while-down", 64)).complete is not None
        assert s.router.index.errors > errors_before

        redis_server.start()  # fresh and empty, same address; pdserve is not restarted
        r = redis_server.client()
        assert r.info("server")["run_id"] != run_id
        deadline = time.monotonic() + 30
        while set(r.hkeys(KEY + "epochs")) != {P0, P1, D0}:
            assert time.monotonic() < deadline, "workers never re-registered"
            time.sleep(0.1)
        # the refreshes re-assert what each worker held from before the outage
        got = s.wait_lookup(e, lambda m: m.get(P1, 0) == 15)
        assert got.get(P0, 0) == 0
        e2 = e[:240] + prompt("after-outage", 16)
        warm = s.generate(e2)
        assert warm.complete and warm.complete.prefill_worker == P1
        assert warm.complete.usage.cached_tokens == 240
        # and new prefixes are published again
        f = prompt("after-outage-new", 256)
        assert s.steer(P0, f).complete.prefill_worker == P1  # type: ignore[union-attr]
        s.wait_lookup(f, lambda m: m.get(P1, 0) == 15)
        assert r.exists(KEY + "b:" + f"{s.hashes(f)[0]:016x}") == 1

    def test_worker_restart_supersedes_old_entries(
        self, served_redis: Served, redis_server: RedisServer
    ) -> None:
        s = served_redis
        r = redis_server.client()
        g = prompt("restart", 512)
        assert s.steer(P1, g).complete.prefill_worker == P0  # type: ignore[union-attr]
        s.wait_lookup(g, lambda m: m.get(P0, 0) == 31)
        old_epoch = r.hget(KEY + "epochs", P0)
        g0 = KEY + "b:" + f"{s.hashes(g)[0]:016x}"
        assert r.hget(g0, P0) == old_epoch

        assert s.deployment is not None
        ray.kill(s.deployment.actors[P0], no_restart=False)
        deadline = time.monotonic() + 90
        while r.hget(KEY + "epochs", P0) in (old_epoch, None):
            assert time.monotonic() < deadline, "the restarted worker never registered"
            time.sleep(0.02)

        # at once: the old entries no longer count, and are gone from Redis. (It failed in a
        # fresh clone when the restarted worker, at Ray's niceness 15, was starved by the
        # other pytest worker: the suite's clusters run workers at 0. Each assert says what
        # it saw.)
        def state() -> dict[str, Any]:
            return {"old_epoch": old_epoch, "epochs": r.hgetall(KEY + "epochs"),
                    "g0": r.hgetall(g0), "lookup": s.lookup(g)}  # fmt: skip

        assert P0 not in s.lookup(g), state()
        assert r.hget(g0, P0) is None, state()
        assert not r.sismember(KEY + "w:" + P0, f"{s.hashes(g)[0]:016x}"), state()

        # the restarted worker serves again and, once it has published, is found again
        [p0] = [w for w in s.router.prefill.workers if w.name == P0]
        deadline = time.monotonic() + 60
        while not (p0.healthy and p0.stats is not None):
            assert time.monotonic() < deadline, "the router never saw prefill-0 come back"
            time.sleep(0.1)
        out = s.steer(P1, g)
        assert out.complete and out.complete.prefill_worker == P0, (out.complete, state())
        assert out.complete.usage.cached_tokens == 0, state()  # a fresh cache
        s.wait_lookup(g, lambda m: m.get(P0, 0) == 31)


# ---- in-memory (the default) ---------------------------------------------------------------
@pytest.fixture(scope="class")
def served_memory(model_dir: Path) -> Iterator[Served]:
    s = Served(serve_config(model_dir, None, transport="local"), in_process=True)
    yield s
    s.close()


class TestMemoryIndex:
    def test_routes_to_prefix_holder(self, served_memory: Served) -> None:
        assert served_memory.router.index.backend == "memory"
        check_routes_to_prefix_holder(served_memory, "memory")
        assert served_memory.router.index.errors == 0


# ---- delta transfers: a follow-up turn whose prefix lives on a decode worker --------------
@pytest.fixture(scope="class")
def served_two_decode(model_dir: Path) -> Iterator[Served]:
    s = Served(serve_config(model_dir, None, transport="local"), in_process=True, num_decode=2)
    yield s
    s.close()


class TestDeltaTransfer:
    def test_follow_up_moves_only_the_delta(self, served_two_decode: Served) -> None:
        """Turn 1 decodes on D0, which keeps the prompt's blocks cached. Turn 2 shares 90 %:
        although D1 has more free room (headroom alone would pick it), the pair cost sends it
        to D0, which shares the cached prefix and receives only the remaining blocks; the
        tokens equal a cold run's."""
        s = served_two_decode
        d1 = "pdserve-decode-1"
        a = prompt("delta-a")
        a2 = sharing(a, "delta-a2")
        first = s.generate(a)
        assert first.complete is not None and first.complete.decode_worker == D0
        s.wait_lookup(a2, lambda m: m.get(D0, 0) >= SHARED // BS)
        stats0 = s.call(s.workers[2].stats())
        assert stats0.name == D0

        [w0] = [w for w in s.router.decode.workers if w.name == D0]

        async def shrink(n: int) -> None:  # D0 looks fuller than D1, yet has room
            w0.pending_blocks += n

        s.call(shrink(8))
        try:
            warm = s.generate(a2)
        finally:
            s.call(shrink(-8))
        assert warm.complete is not None and warm.complete.decode_worker == D0
        after0 = s.call(s.workers[2].stats())
        shared = after0.extra["kv_blocks_shared_total"] - stats0.extra["kv_blocks_shared_total"]
        moved = after0.extra["kv_bytes_received_total"] - stats0.extra["kv_bytes_received_total"]
        num_blocks = PROMPT_LEN // BS
        assert shared == SHARED // BS
        assert moved == (num_blocks - SHARED // BS) * after0.kv_bytes_per_block

        cold = s.generate(a2, salt="delta-cold")  # a salt shares nothing: every block moves
        assert cold.complete is not None and warm.token_ids == cold.token_ids
        dc = cold.complete.decode_worker
        [wc] = [w for w in s.workers if w.name == dc]
        assert s.call(wc.check_integrity()) >= 0
        assert d1 in {w.name for w in s.router.decode.workers}
