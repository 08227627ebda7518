"""The prefix index: which worker holds the KV of which token prefix.

Workers feed it the block manager's events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`), tagged with the worker's **epoch** (a fresh id per worker start or cache
reset); the router asks, for a prompt's chained block hashes, how many leading blocks each
worker holds. Entries of an epoch that is not a worker's current one never count, so a
restarted worker's old entries stop attracting requests the moment its new epoch registers.

Two implementations behind one small interface: `MemoryPrefixIndex` (the embedded default,
in the router process) and `RedisPrefixIndex` (redis-py asyncio; `redis://`, `rediss://`,
ACL user/password in the URL). Redis layout, all keys in one cluster hash slot per model:

    pdserve:{<model>}:epochs          HASH  worker -> current epoch
    pdserve:{<model>}:b:<hash>        HASH  worker -> epoch   (TTL, refreshed while cached)
    pdserve:{<model>}:w:<worker>      SET   block hashes the worker holds (TTL, refreshed)

`<hash>` is the block hash as 16 hex digits. A lookup is one round trip (a Lua script over
the prompt's block keys) and stops at the first block no live worker holds. The index is
advisory: every Redis call has a bounded timeout and a failure counts as a miss
(`errors` counts them); workers re-publish what they hold periodically (`refresh`, which
also removes what they no longer hold), so an emptied or restarted Redis fills up again by
itself. docs/prefix_index.md has the details.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from engine.prefix_hash import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 120.0
DEFAULT_TIMEOUT_S = 0.1
_REFRESH_CHUNK = 2048  # blocks re-stored per pipeline by `refresh`


def hash_hex(h: int) -> str:
    return f"{h:016x}"


class PrefixIndex(abc.ABC):
    """Block hash -> holders. Every method is safe to call when the backend is down."""

    backend: str = ""

    def __init__(self) -> None:
        self.errors = 0  # failed or timed-out backend calls (each one served as a miss)

    @abc.abstractmethod
    async def register(self, worker: str, epoch: str) -> None:
        """Make `epoch` the worker's current one and drop its entries of older epochs."""

    @abc.abstractmethod
    async def publish(self, worker: str, epoch: str, events: Sequence[BlockEvent]) -> None:
        """Apply a worker's block events (in order)."""

    @abc.abstractmethod
    async def refresh(self, worker: str, epoch: str, hashes: Iterable[int]) -> None:
        """Re-assert everything the worker holds now (TTL refresh; refills an empty backend)."""

    @abc.abstractmethod
    async def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `hashes` each live worker holds (workers with 0 omitted)."""

    @abc.abstractmethod
    async def drop(self, worker: str) -> None:
        """Forget a worker entirely (it left the pool)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MemoryPrefixIndex(PrefixIndex):
    """In-process index (the embedded default). Same semantics as Redis, minus the TTL."""

    backend = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.epochs: dict[str, str] = {}
        self.blocks: dict[int, dict[str, str]] = {}
        self.held: dict[str, set[int]] = {}

    async def register(self, worker: str, epoch: str) -> None:
        if self.epochs.get(worker) == epoch:
            return
        await self.drop(worker)
        self.epochs[worker] = epoch

    async def publish(self, worker: str, epoch: str, events: Sequence[BlockEvent]) -> None:
        current = self.epochs.get(worker)
        if current is None:
            await self.register(worker, epoch)
        elif current != epoch:
            return  # a superseded epoch: its entries could never count
        held = self.held.setdefault(worker, set())
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.blocks.setdefault(h, {})[worker] = epoch
                    held.add(h)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._unset(h, worker)
                    held.discard(h)
            elif isinstance(ev, AllBlocksCleared):
                for h in held:
                    self._unset(h, worker)
                held.clear()

    async def refresh(self, worker: str, epoch: str, hashes: Iterable[int]) -> None:
        await self.register(worker, epoch)
        keep = set(hashes)
        held = self.held.setdefault(worker, set())
        for h in held - keep:
            self._unset(h, worker)
        held.intersection_update(keep)
        await self.publish(worker, epoch, [BlockStored(tuple(keep - held), None)])

    async def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = {w for w, e in self.blocks.get(h, {}).items() if self.epochs.get(w) == e}
            if alive is not None:
                holders &= alive
            if not holders:
                break
            for w in holders:
                counts[w] = i + 1
            alive = holders
        return counts

    async def drop(self, worker: str) -> None:
        for h in self.held.pop(worker, set()):
            self._unset(h, worker)
        self.epochs.pop(worker, None)

    def _unset(self, h: int, worker: str) -> None:
        holders = self.blocks.get(h)
        if holders is not None:
            holders.pop(worker, None)
            if not holders:
                del self.blocks[h]


# KEYS[1] = epochs hash, KEYS[2..] = block keys in prompt order.
# Returns a flat list: worker, leading block count, ...
_LOOKUP_LUA = """
local epochs = redis.call('HGETALL', KEYS[1])
local current = {}
for i = 1, #epochs, 2 do current[epochs[i]] = epochs[i + 1] end
local counts = {}
local alive = nil
for k = 2, #KEYS do
  local fields = redis.call('HGETALL', KEYS[k])
  local next_alive = {}
  local any = false
  for j = 1, #fields, 2 do
    local w = fields[j]
    if current[w] == fields[j + 1] and (alive == nil or alive[w]) then
      next_alive[w] = true
      counts[w] = k - 1
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for w, n in pairs(counts) do
  table.insert(out, w)
  table.insert(out, n)
end
return out
"""

# KEYS[1] = epochs hash, KEYS[2] = the worker's block set; ARGV = worker, epoch, block prefix.
# Drops every entry of the worker's previous epoch, then records the new one.
_REGISTER_LUA = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old == ARGV[2] then return 0 end
local members = redis.call('SMEMBERS', KEYS[2])
for _, h in ipairs(members) do
  redis.call('HDEL', ARGV[3] .. h, ARGV[1])
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return #members
"""


class RedisPrefixIndex(PrefixIndex):
    backend = "redis"

    def __init__(
        self,
        url: str,
        model: str,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        super().__init__()
        self.url = url
        self.model = model
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.client: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # a miss now beats a hit later
            health_check_interval=0,
        )
        self.prefix = f"pdserve:{{{model}}}:"
        self._lookup = self.client.register_script(_LOOKUP_LUA)
        self._register = self.client.register_script(_REGISTER_LUA)

    # ---- keys ----------------------------------------------------------------------------
    @property
    def epochs_key(self) -> str:
        return self.prefix + "epochs"

    def block_key(self, h: int) -> str:
        return f"{self.prefix}b:{hash_hex(h)}"

    def worker_key(self, worker: str) -> str:
        return f"{self.prefix}w:{worker}"

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    # ---- fail-open wrapper ---------------------------------------------------------------
    async def _guard(self, what: str, coro: Any, default: Any) -> Any:
        try:
            return await asyncio.wait_for(coro, self.timeout_s * 5)
        except Exception as e:
            self.errors += 1
            log.debug("prefix index %s failed: %s", what, e)
            return default

    # ---- interface -----------------------------------------------------------------------
    async def register(self, worker: str, epoch: str) -> None:
        await self._guard(
            "register",
            self._register(
                keys=[self.epochs_key, self.worker_key(worker)],
                args=[worker, epoch, self.prefix + "b:"],
            ),
            None,
        )

    async def publish(self, worker: str, epoch: str, events: Sequence[BlockEvent]) -> None:
        if not events:
            return
        pipe = self.client.pipeline(transaction=False)
        wkey = self.worker_key(worker)
        ttl = self.ttl_ms
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    pipe.hset(self.block_key(h), worker, epoch)
                    pipe.pexpire(self.block_key(h), ttl)
                    pipe.sadd(wkey, hash_hex(h))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    pipe.hdel(self.block_key(h), worker)
                    pipe.srem(wkey, hash_hex(h))
            elif isinstance(ev, AllBlocksCleared):
                await self._guard("execute", pipe.execute(), None)
                await self.drop(worker)
                await self.register(worker, epoch)
                pipe = self.client.pipeline(transaction=False)
        pipe.pexpire(wkey, ttl)
        await self._guard("publish", pipe.execute(), None)

    async def refresh(self, worker: str, epoch: str, hashes: Iterable[int]) -> None:
        """Read the worker's block set; in one pipeline, remove the worker from blocks it no
        longer holds (events lost while Redis was unreachable) and make `epoch` current; then
        re-store what it holds with fresh TTLs, one pipeline per `_REFRESH_CHUNK` blocks (so
        that no single call of a large cache runs into the timeout)."""
        keep = sorted({hash_hex(h) for h in hashes})
        wkey = self.worker_key(worker)
        ttl = self.ttl_ms

        async def reconcile() -> None:
            stale = {_text(m) for m in await self.client.smembers(wkey)} - set(keep)
            pipe = self.client.pipeline(transaction=False)
            for h in stale:
                pipe.hdel(self.prefix + "b:" + h, worker)
            if stale:
                pipe.srem(wkey, *stale)
            pipe.hset(self.epochs_key, worker, epoch)
            await pipe.execute()

        await self._guard("refresh", reconcile(), None)
        for i in range(0, len(keep), _REFRESH_CHUNK):
            chunk = keep[i : i + _REFRESH_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for h in chunk:
                pipe.hset(self.prefix + "b:" + h, worker, epoch)
                pipe.pexpire(self.prefix + "b:" + h, ttl)
            pipe.sadd(wkey, *chunk)
            pipe.pexpire(wkey, ttl)
            await self._guard("refresh", pipe.execute(), None)

    async def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        keys = [self.epochs_key] + [self.block_key(h) for h in hashes]
        flat = await self._guard("lookup", self._lookup(keys=keys, args=[]), [])
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}

    async def drop(self, worker: str) -> None:
        async def go() -> None:
            members = await self.client.smembers(self.worker_key(worker))
            pipe = self.client.pipeline(transaction=False)
            for m in members:
                pipe.hdel(self.prefix + "b:" + _text(m), worker)
            pipe.delete(self.worker_key(worker))
            pipe.hdel(self.epochs_key, worker)
            await pipe.execute()

        await self._guard("drop", go(), None)

    async def close(self) -> None:
        await self._guard("close", self.client.aclose(), None)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def make_index(
    redis_url: str | None,
    model: str,
    ttl_s: float = DEFAULT_TTL_S,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PrefixIndex:
    """Redis when a URL is given, else the in-process index."""
    if redis_url:
        return RedisPrefixIndex(redis_url, model, ttl_s, timeout_s)
    return MemoryPrefixIndex()
