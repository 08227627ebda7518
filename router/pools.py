"""The router's view of the worker pools: load, health and the routing policy.

A `WorkerLoad` wraps one worker's typed client (`router.clients`) with what the router knows
of it: what it has sent and not yet seen back (exact and instant), and the worker's own
stats, refreshed in the background (KV headroom, preemptions). Load counters change only
through `WorkerLoad`'s methods. The router never imports a worker module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pool_api.messages import Role, WorkerStats
from router.clients import DecodeClient, PrefillClient, WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)

C = TypeVar("C", bound=WorkerClient)


# Probes of a worker that stopped answering back off from the refresh interval to this, so
# a crash-looping or dead worker is asked a few times a minute, not five times a second.
MAX_PROBE_INTERVAL_S = 5.0
# A worker in this many failed KV transfers in a row is taken out of rotation for
# MAX_PROBE_INTERVAL_S, then probed back: a broken link stops eating every request sent to it.
TRANSFER_FAILURES_DOWN = 3


SILENT_AFTER = 2
"""Stats calls in a row that time out before an up worker counts as silent."""
SPREAD_SLOTS = 8
"""A spread refresh (`Pool.refresh`) starts its calls in this many groups over the interval."""
_TRACKED = itertools.count(1)  # `WorkerLoad.last_track`'s sequence


@dataclass
class WorkerLoad(Generic[C]):
    client: C
    stats: WorkerStats | None = None
    outstanding_tokens: int = 0  # prefill: prompt tokens sent, not yet returned
    pending_blocks: int = 0  # decode: blocks reserved by the router since the last stats
    reserving_blocks: int = 0  # decode: blocks asked for by reservations still in flight
    active: set[str] = field(default_factory=set)
    healthy: bool = True
    down_since: float | None = None  # monotonic time it was marked down; None while up
    next_probe_s: float = 0.0  # monotonic time of the next stats probe while down
    probe_interval_s: float = 0.0  # current backoff between probes while down
    transfer_failures_in_a_row: int = 0
    stats_at_s: float = 0.0  # monotonic time the last stats arrived
    # when a request last went to it (a sequence number, so never a tie): the last
    # tie-breaker, so that among equally loaded workers the least recently used gets the
    # next request (a restarted or idle worker is never starved by a fixed order)
    last_track: int = 0
    missed_refreshes: int = 0  # stats calls in a row that timed out while it was up
    # takes no new request: this router's pool admin is draining it (`router.membership`)
    retiring: bool = False
    # takes no new request: its stats say it drains (another router's admin), or it
    # refused one (`WorkerDraining`) since its last stats
    draining: bool = False

    @property
    def routable(self) -> bool:
        """Up, taking new requests, and serving the role of its pool (a worker another
        router flipped, or one Ray restarted in the role it started with, is moved to its
        pool first: `PoolAdmin.reconcile`)."""
        return self.healthy and not self.retiring and not self.draining and not self.misplaced

    @property
    def misplaced(self) -> bool:
        """Its stats say it serves the other side of the split than its pool's (prefill, or
        decode; a colocated worker is a decode worker that prefills too)."""
        if self.stats is None:
            return False
        return (self.stats.role is Role.PREFILL) != (self.client.role is Role.PREFILL)

    def mark_down(self, reason: object) -> None:
        """Out of rotation until a stats probe answers again (Ray restarts the actor)."""
        if self.down_since is None:
            log.warning(
                "%s worker %s is down (%s); probing until it answers again",
                self.client.role.value,
                self.client.name,
                reason,
            )
            self.down_since = time.monotonic()
            self.probe_interval_s = 0.0
        self.healthy = False

    def mark_silent(self, reason: object) -> None:
        """Down, and found not answering (its stats timed out, a call found it gone): the
        calls waiting on it fail now (`WorkerClient.went_silent`), so a frozen worker holds
        its requests for the time it took to notice, not for as long as it stays frozen."""
        self.mark_down(reason)
        self.client.went_silent()

    def probe_failed(self, reason: object, min_interval_s: float, silent: bool = True) -> None:
        """A stats probe failed: down (silent unless the failure was a bug of ours), and the
        next probe later (doubling, from `min_interval_s` up to `MAX_PROBE_INTERVAL_S`)."""
        if silent:
            self.mark_silent(reason)
        else:
            self.mark_down(reason)
        self.probe_interval_s = min(
            max(2 * self.probe_interval_s, min_interval_s), MAX_PROBE_INTERVAL_S
        )
        self.next_probe_s = time.monotonic() + self.probe_interval_s

    def transfer_done(self, ok: bool) -> None:
        """A KV transfer this worker took part in ended; see `TRANSFER_FAILURES_DOWN`."""
        if ok:
            self.transfer_failures_in_a_row = 0
            return
        self.transfer_failures_in_a_row += 1
        if self.transfer_failures_in_a_row >= TRANSFER_FAILURES_DOWN:
            self.transfer_failures_in_a_row = 0
            self.mark_down(f"{TRANSFER_FAILURES_DOWN} KV transfers in a row failed")
            self.probe_interval_s = MAX_PROBE_INTERVAL_S
            self.next_probe_s = time.monotonic() + MAX_PROBE_INTERVAL_S

    def mark_up(self) -> None:
        if self.down_since is not None:
            log.warning(
                "%s worker %s is back after %.1f s",
                self.client.role.value,
                self.client.name,
                time.monotonic() - self.down_since,
            )
        self.down_since = None
        self.healthy = True

    @property
    def name(self) -> str:
        return self.client.name

    def track(self, request_id: str) -> None:
        """The request is on this worker (counts toward its active load)."""
        self.active.add(request_id)
        self.last_track = next(_TRACKED)

    def untrack(self, request_id: str) -> None:
        self.active.discard(request_id)

    def reserved(self, request_id: str, num_blocks: int) -> None:
        """A reservation of `num_blocks` succeeded here; counted until the next stats."""
        self.pending_blocks += num_blocks
        self.track(request_id)

    def reserving(self, call: asyncio.Future[Any], num_blocks: int) -> None:
        """A reservation of about `num_blocks` is in flight until `call` is done: count it
        now, so requests placed meanwhile see this worker fuller, not only once it answers
        (else a burst of requests all lands on the first of equally free workers)."""
        self.reserving_blocks += num_blocks

        def done(_: asyncio.Future[Any]) -> None:
            self.reserving_blocks -= num_blocks

        call.add_done_callback(done)

    @contextlib.contextmanager
    def prefilling(self, request_id: str, num_tokens: int) -> Iterator[None]:
        """The prompt pass of `num_tokens` is out on this prefill worker."""
        done = self.prompt_pass(num_tokens)
        self.track(request_id)
        try:
            yield
        finally:
            done()
            self.untrack(request_id)

    def prompt_pass(self, num_tokens: int) -> Callable[[], None]:
        """A prompt pass of `num_tokens` is out on this worker (`outstanding_tokens`) until
        the returned function is called; calling it again does nothing."""
        self.outstanding_tokens += num_tokens
        left = [num_tokens]

        def done() -> None:
            self.outstanding_tokens -= left.pop() if left else 0

        return done

    def cached_tokens(self, matches: dict[str, int], block_size: int) -> int:
        """Leading prompt tokens this worker holds (`matches`: name -> blocks)."""
        return matches.get(self.client.name, 0) * block_size

    def stats_arrived(self, stats: WorkerStats) -> None:
        """Fresh stats already count every reservation made before them."""
        self.stats = stats
        self.stats_at_s = time.monotonic()
        self.pending_blocks = 0
        self.missed_refreshes = 0
        self.draining = stats.draining
        self.mark_up()

    @property
    def free_blocks(self) -> int:
        free = self.stats.num_free_blocks if self.stats else 0
        return free - self.pending_blocks - self.reserving_blocks

    def prefill_work(self, matches: dict[str, int], num_tokens: int, block_size: int) -> int:
        """Prompt tokens this worker would compute for a request (its cached prefix
        subtracted) plus the prompt tokens already sent to it and not yet returned (a decode
        worker: those of prompts prefilled on it that have no first token yet)."""
        return num_tokens - self.cached_tokens(matches, block_size) + self.outstanding_tokens


@dataclass(frozen=True)
class PairCost:
    """What one (prefill, decode) pair would cost a request, in estimated seconds.

    prefill: the prompt tokens the prefill worker must compute (its cached prefix
    subtracted) plus the prompt tokens already queued on it, at `prefill_tokens_per_s`;
    transfer: the KV bytes the pair would move (the decode worker's cached prefix is shared,
    so only the delta moves), at `transfer_bytes_per_s`. A decode worker without KV room for
    the delta ranks after every one with room (its reservation would be refused).
    """

    prefill: WorkerLoad[PrefillClient]
    decode: WorkerLoad[DecodeClient]
    prefill_s: float
    transfer_s: float
    has_room: bool

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.transfer_s

    def sort_key(self) -> tuple[bool, float, int, int, int]:
        return (
            not self.has_room,
            self.total_s,
            -self.decode.free_blocks,
            len(self.decode.active) + len(self.prefill.active),
            self.prefill.last_track,  # ties: the least recently used prefill worker
        )


def rank_pairs(
    prefill: Sequence[WorkerLoad[PrefillClient]],
    decode: Sequence[WorkerLoad[DecodeClient]],
    matches: dict[str, int],
    num_tokens: int,
    block_size: int,
    prefill_tokens_per_s: float,
    transfer_bytes_per_s: float,
) -> list[PairCost]:
    """Every healthy (prefill, decode) pair, cheapest first (see `PairCost`).

    `matches` maps a worker name to the number of leading prompt blocks it holds."""
    num_blocks = -(-num_tokens // block_size)
    prefill_s = {
        p.client.name: p.prefill_work(matches, num_tokens, block_size) / prefill_tokens_per_s
        for p in prefill
    }
    pairs = []
    for d in decode:
        # The prompt's last block always moves (the receiver never shares it).
        held_d = min(matches.get(d.client.name, 0), max(num_blocks - 1, 0))
        delta_blocks = num_blocks - held_d
        per_block = d.stats.kv_bytes_per_block if d.stats else 0
        transfer_s = delta_blocks * per_block / transfer_bytes_per_s
        has_room = d.free_blocks >= delta_blocks + 1
        for p in prefill:
            pairs.append(PairCost(p, d, prefill_s[p.client.name], transfer_s, has_room))
    return sorted(pairs, key=PairCost.sort_key)


def overflow_worker(
    prefill: Sequence[WorkerLoad[PrefillClient]],
    decode: Sequence[WorkerLoad[DecodeClient]],
    matches: dict[str, int],
    num_tokens: int,
    block_size: int,
    threshold: int,
) -> WorkerLoad[DecodeClient] | None:
    """The decode worker to prefill a prompt on because the prefill pool is busy, or None
    (`RouterConfig.prefill_overflow_tokens`): every healthy prefill worker has at least
    `threshold` prompt tokens outstanding, and some healthy decode worker would finish this
    prompt's pass with less work ahead of it (`WorkerLoad.prefill_work`) than the least
    busy prefill worker. Of those, the one with the least such work, then the most room."""
    if threshold <= 0 or not prefill or min(p.outstanding_tokens for p in prefill) < threshold:
        return None
    remote = min(p.prefill_work(matches, num_tokens, block_size) for p in prefill)
    work = {d.client.name: d.prefill_work(matches, num_tokens, block_size) for d in decode}
    lighter = [d for d in decode if work[d.client.name] < remote]
    return min(lighter, key=lambda d: (work[d.client.name], -d.free_blocks), default=None)


class Pool(Generic[C]):
    def __init__(self, role: Role, clients: Sequence[C]) -> None:
        self.role = role
        self.workers: list[WorkerLoad[C]] = [WorkerLoad(c) for c in clients]

    def __len__(self) -> int:
        return len(self.workers)

    def routable(self) -> list[WorkerLoad[C]]:
        """The workers a new request may go to: up, and not draining."""
        return [w for w in self.workers if w.routable]

    def get(self, name: str) -> WorkerLoad[C] | None:
        return next((w for w in self.workers if w.name == name), None)

    def add(self, client: C) -> WorkerLoad[C]:
        """A worker joins (`router.membership`): routable once its first stats arrive."""
        if self.get(client.name) is not None:
            raise ValueError(f"{client.name} is already in the {self.role.value} pool")
        w = WorkerLoad(client, healthy=False)
        self.workers.append(w)
        return w

    def remove(self, name: str) -> WorkerLoad[C]:
        w = self.get(name)
        if w is None:
            raise KeyError(name)
        self.workers.remove(w)
        return w

    def pick_prefill(
        self, matches: dict[str, int], num_tokens: int, block_size: int
    ) -> WorkerLoad[C]:
        """Least prefill work (`WorkerLoad.prefill_work`), then fewest active requests,
        then the least recently used."""
        candidates = self.routable()
        if not candidates:
            raise LookupError(f"no healthy {self.role.value} worker")
        return min(
            candidates,
            key=lambda w: (
                w.prefill_work(matches, num_tokens, block_size),
                len(w.active),
                w.last_track,
            ),
        )

    def best_match(self, matches: dict[str, int]) -> WorkerLoad[C] | None:
        """The healthy worker holding the longest prefix, if any holds one."""
        held = [w for w in self.routable() if matches.get(w.name, 0) > 0]
        return max(held, key=lambda w: (matches[w.name], w.free_blocks), default=None)

    def decode_order(self) -> list[WorkerLoad[C]]:
        """Decode workers by KV headroom (free minus pending reservations), then batch size."""
        return sorted(self.routable(), key=lambda w: (-w.free_blocks, len(w.active)))

    def serviceable(self) -> bool:
        """At least one worker takes requests and has reported its stats."""
        return any(w.routable and w.stats is not None for w in self.workers)

    async def refresh(
        self,
        interval_s: float,
        timeout_s: float,
        spread_s: float = 0.0,
        then: Callable[[WorkerLoad[C]], object] | None = None,
    ) -> None:
        """Pull every worker's stats. A worker that is gone, or whose stats take over
        `timeout_s` `SILENT_AFTER` times in a row (a call to an actor Ray is restarting waits
        for the restart), is marked down; down workers are probed with backoff from
        `interval_s` up to `MAX_PROBE_INTERVAL_S`.

        `spread_s`: the calls start in `SPREAD_SLOTS` groups evenly over this long rather
        than all at once. A burst of one call per worker queues a request's own calls
        behind it (Ray submits a process's calls one at a time): at 200 workers a request
        sent one at a time waited 88 ms at the median (`make bench-pool`); one call at a
        time, Ray batches nothing and the idle router's CPU rose by half. `then(w)` runs
        once `w` answered (the router's index pull, spread the same way)."""
        workers = list(self.workers)
        slots = min(SPREAD_SLOTS, len(workers)) or 1

        async def one(i: int, w: WorkerLoad[C]) -> None:
            if spread_s > 0 and (slot := i * slots // len(workers)):
                await asyncio.sleep(spread_s * slot / slots)
            if not w.healthy and time.monotonic() < w.next_probe_s:
                return
            try:
                w.stats_arrived(await asyncio.wait_for(w.client.stats(), timeout_s))
            except asyncio.TimeoutError as e:
                # One slow answer is a loaded host, not a dead worker: an up worker is found
                # silent (and its pending calls failed) only after SILENT_AFTER misses in a row.
                w.missed_refreshes += 1
                if w.healthy and w.missed_refreshes < SILENT_AFTER:
                    log.info("stats of %s timed out (%d in a row)", w.name, w.missed_refreshes)
                    return
                w.probe_failed(e or type(e).__name__, interval_s)
            except WorkerUnavailable as e:  # the actor is gone: no second chance needed
                w.probe_failed(e, interval_s)
            except Exception as e:
                # Boundary of the refresh loop: a worker whose stats raise cannot be routed
                # to by load, so it is probed again later; the traceback says whose bug it is.
                log.exception("stats of %s failed", w.name)
                w.probe_failed(e, interval_s, silent=False)
            else:
                if then is not None:
                    then(w)

        await asyncio.gather(*(one(i, w) for i, w in enumerate(workers)))
