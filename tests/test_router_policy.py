"""Router policy as tables, without Ray, workers or a model: pair ranking, prefill
placement, the waiting line, and conditional disaggregation."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import grpc
import pytest

from engine.sampling import SamplingParams
from pool_api.messages import Role, WorkerRequest, WorkerStats
from pool_api.prefix_index import MemoryPrefixIndex
from protos.pdserve.v1 import generation_pb2 as gen
from router.active import ActiveRequest, RequestFailed
from router.clients import DecodeClient, PrefillClient
from router.config import PolicySettings, PrefillFailurePolicy, RouterConfig
from router.flow import RequestFlow
from router.pools import SILENT_AFTER, Pool, WorkerLoad, overflow_worker, rank_pairs
from router.reservation import Reserver, WaitingLine
from router.token_sink import TokenSinkServer

BS = 16
NEVER_CALLED: Any = None  # policy reads loads and stats only


def stats(name: str, role: Role, free: int, kv_bytes_per_block: int = 1000) -> WorkerStats:
    return WorkerStats(name, role, free, 64, 0, 0, 0, 0, 0, 0, {}, kv_bytes_per_block)


def prefill_pool(*outstanding: int) -> Pool[PrefillClient]:
    clients = [PrefillClient(f"p{i}", NEVER_CALLED) for i in range(len(outstanding))]
    pool = Pool(Role.PREFILL, clients)
    for w, n in zip(pool.workers, outstanding, strict=True):
        w.outstanding_tokens = n
        w.stats_arrived(stats(w.name, Role.PREFILL, 64))
    return pool


def decode_pool(*free: int) -> Pool[DecodeClient]:
    pool = Pool(Role.DECODE, [DecodeClient(f"d{i}", NEVER_CALLED) for i in range(len(free))])
    for w, n in zip(pool.workers, free, strict=True):
        w.stats_arrived(stats(w.name, Role.DECODE, n))
    return pool


def names(pc: Any) -> tuple[str, str]:
    return pc.prefill.name, pc.decode.name


@pytest.mark.parametrize(
    ("outstanding", "free", "matches", "num_tokens", "best"),
    [
        # idle, no cache: the tie breaks toward KV headroom
        ((0, 0), (10, 40), {}, 64, ("p0", "d1")),
        # a busy prefill worker loses to an idle one
        ((4096, 0), (40, 40), {}, 64, ("p1", "d0")),
        # a prefill worker holding the prefix wins although it has queued work
        ((512, 0), (40, 40), {"p0": 60}, 64 * BS, ("p0", "d0")),
        # a decode worker holding the prefix moves less KV
        ((0, 0), (40, 40), {"d1": 3}, 4 * BS + 1, ("p0", "d1")),
        # a decode worker without room for the delta ranks last, prefix or not
        ((0, 0), (2, 40), {"d0": 3}, 10 * BS, ("p0", "d1")),
    ],
)
def test_rank_pairs(
    outstanding: tuple[int, ...],
    free: tuple[int, ...],
    matches: dict[str, int],
    num_tokens: int,
    best: tuple[str, str],
) -> None:
    pairs = rank_pairs(
        prefill_pool(*outstanding).workers,
        decode_pool(*free).workers,
        matches,
        num_tokens,
        BS,
        prefill_tokens_per_s=10_000.0,
        transfer_bytes_per_s=1e6,
    )
    assert len(pairs) == len(outstanding) * len(free)
    assert names(pairs[0]) == best
    assert [p.sort_key() for p in pairs] == sorted(p.sort_key() for p in pairs)


@pytest.mark.parametrize(
    ("outstanding", "active", "matches", "down", "best"),
    [
        ((100, 0), (0, 0), {}, (), "p1"),  # least work
        ((0, 0), (3, 1), {}, (), "p1"),  # equal work: fewest active requests
        ((100, 0), (0, 0), {"p0": 8}, (), "p0"),  # its cached prefix is work it skips
        ((0, 100), (0, 0), {}, ("p0",), "p1"),  # a down worker is not picked
    ],
)
def test_pick_prefill(
    outstanding: tuple[int, ...],
    active: tuple[int, ...],
    matches: dict[str, int],
    down: tuple[str, ...],
    best: str,
) -> None:
    pool = prefill_pool(*outstanding)
    for w, n in zip(pool.workers, active, strict=True):
        w.active = {f"r{i}" for i in range(n)}
        if w.name in down:
            w.mark_down("test")
    assert pool.pick_prefill(matches, 10 * BS, BS).name == best


def test_pick_prefill_with_every_worker_down() -> None:
    pool = prefill_pool(0)
    pool.workers[0].mark_down("test")
    with pytest.raises(LookupError):
        pool.pick_prefill({}, BS, BS)


def test_load_counters_follow_the_prompt_pass() -> None:
    w: WorkerLoad[PrefillClient] = prefill_pool(0).workers[0]
    with w.prefilling("r", 100):
        assert (w.outstanding_tokens, w.active) == (100, {"r"})
    assert (w.outstanding_tokens, w.active) == (0, set())
    d = decode_pool(10).workers[0]
    d.reserved("r", 4)
    assert (d.free_blocks, d.active) == (6, {"r"})
    d.stats_arrived(stats(d.name, Role.DECODE, 6))  # fresh stats count the reservation
    assert d.free_blocks == 6


def test_waiting_line_is_first_come_first_served_and_an_abort_wakes_the_next() -> None:
    """a holds the line; b gives up while waiting (abort); c is served once a is done."""

    async def main() -> list[str]:
        line, order = WaitingLine(), []
        done, aborted = asyncio.Event(), set()

        async def wait(name: str) -> None:
            def give_up() -> None:
                if name in aborted:
                    raise RequestFailed(grpc.StatusCode.CANCELLED, f"{name} aborted")

            try:
                async with line.first(give_up):
                    order.append(name)
                    if name == "a":
                        await done.wait()  # the head holds the line
            except RequestFailed:
                order.append(f"{name} left")

        tasks = [asyncio.create_task(wait(n)) for n in "abc"]
        await asyncio.sleep(0.1)
        assert order == ["a"] and len(line) == 3
        aborted.add("b")
        await asyncio.sleep(0.2)  # b checks every 50 ms
        assert order == ["a", "b left"] and len(line) == 2
        done.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
        assert len(line) == 0
        return order

    assert asyncio.run(main()) == ["a", "b left", "c"]


def flow(
    threshold: int, policy: PrefillFailurePolicy, prefill_up: bool, colocated: bool = False
) -> RequestFlow:
    cfg = RouterConfig(
        policy=PolicySettings(local_prefill_threshold=threshold, prefill_failure_policy=policy)
    )
    prefill, decode = prefill_pool(0), decode_pool(40, 40)
    if not prefill_up:
        prefill.workers[0].mark_down("test")
    info = gen.ModelInfo(block_size=BS, model_fingerprint="fp")
    reserver = Reserver(cfg.policy, prefill, decode, BS, lambda coro: None)
    sinks = TokenSinkServer("127.0.0.1")  # never started: placement only
    return RequestFlow(
        cfg, prefill, decode, MemoryPrefixIndex(), info, reserver, NEVER_CALLED, colocated, sinks
    )


def active(num_tokens: int) -> ActiveRequest:
    wr = WorkerRequest("r", tuple(range(num_tokens)), SamplingParams(max_tokens=4))
    return ActiveRequest(wr, 0.0)


@pytest.mark.parametrize(
    ("threshold", "num_tokens", "matches", "prefill_up", "colocated", "local"),
    [
        (0, 1, {}, True, False, False),  # threshold 0: always disaggregate
        (32, 32, {}, True, False, True),  # at the threshold: local
        (32, 33, {}, True, False, False),  # one token over: disaggregate
        (32, 6 * BS, {"d1": 5}, True, False, True),  # the cached prefix does not count
        (32, 6 * BS, {"p0": 5}, True, False, False),  # a prefill worker's prefix does not help
        (0, 1000, {}, True, True, True),  # colocated: always local
        (0, 1000, {}, False, False, True),  # no prefill worker up: recompute locally
    ],
)
def test_conditional_disaggregation(
    threshold: int,
    num_tokens: int,
    matches: dict[str, int],
    prefill_up: bool,
    colocated: bool,
    local: bool,
) -> None:
    f = flow(threshold, "recompute", prefill_up, colocated)
    assert (f._local_worker(active(num_tokens), matches) is not None) is local


def test_no_prefill_worker_under_the_fail_policy_is_unavailable() -> None:
    with pytest.raises(RequestFailed) as e:
        flow(0, "fail", prefill_up=False)._local_worker(active(100), {})
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("prefill_backlog", "decode_backlog", "matches", "num_tokens", "picked"),
    [
        ((511,), (0, 0), {}, 512, None),  # under the threshold: disaggregate
        ((512,), (0, 0), {}, 512, "d0"),  # every prefill worker at it: an idle decode worker
        ((512, 0), (0, 0), {}, 512, None),  # one prefill worker is free: it takes the prompt
        ((512,), (512, 0), {}, 512, "d1"),  # the decode worker with less of its own work
        ((512,), (512, 512), {}, 512, None),  # no decode worker is lighter: wait in line
        ((512,), (100, 0), {"d0": 10}, 10 * BS, "d0"),  # its cached prefix makes d0 lighter
        ((2048,), (0, 0), {"p0": 200}, 200 * BS, None),  # p0 holds all but a block of it
    ],
)
def test_a_busy_prefill_pool_overflows_to_the_lightest_decode_worker(
    prefill_backlog: tuple[int, ...],
    decode_backlog: tuple[int, int],
    matches: dict[str, int],
    num_tokens: int,
    picked: str | None,
) -> None:
    prefill, decode = prefill_pool(*prefill_backlog), decode_pool(40, 40)
    for w, n in zip(decode.workers, decode_backlog, strict=True):
        w.outstanding_tokens = n
    got = overflow_worker(prefill.workers, decode.workers, matches, num_tokens, BS, 512)
    assert (got.name if got else None) == picked


def test_a_prompt_pass_is_counted_once_and_released_once() -> None:
    (w,) = prefill_pool(0).workers
    done = w.prompt_pass(100)
    with w.prefilling("r", 28):
        assert w.outstanding_tokens == 128
    done()
    done()
    assert w.outstanding_tokens == 0


def test_overflow_is_off_at_zero_and_reaches_the_flow() -> None:
    prefill, decode = prefill_pool(10**6), decode_pool(40, 40)
    assert overflow_worker(prefill.workers, decode.workers, {}, 64, BS, 0) is None
    f = flow(0, "recompute", prefill_up=True)
    f.prefill.workers[0].outstanding_tokens = 4096
    assert f._local_worker(active(512), {}) is None  # RouterConfig() leaves it off
    f.cfg = RouterConfig(policy=PolicySettings(prefill_overflow_tokens=1024))
    assert f._local_worker(active(512), {}) is not None


class StatsOnly:
    """A decode worker that answers stats (what a probe asks), and nothing else."""

    async def stats(self) -> WorkerStats:
        return stats("d0", Role.DECODE, 40)


def test_a_worker_failing_transfers_in_a_row_is_taken_out_and_probed_back() -> None:
    from router.pools import TRANSFER_FAILURES_DOWN

    pool = Pool(Role.DECODE, [DecodeClient("d0", cast(Any, StatsOnly()))])
    d = pool.workers[0]
    for _ in range(TRANSFER_FAILURES_DOWN - 1):
        d.transfer_done(ok=False)
    d.transfer_done(ok=True)  # a success in between: the count starts again
    for _ in range(TRANSFER_FAILURES_DOWN - 1):
        d.transfer_done(ok=False)
    assert d.healthy
    d.transfer_done(ok=False)
    assert not d.healthy
    asyncio.run(pool.refresh(0.2, 1.0))  # inside the cool-down: not probed, still down
    assert not d.healthy
    d.next_probe_s = time.monotonic()  # the cool-down is over: the probe brings it back
    asyncio.run(pool.refresh(0.2, 1.0))
    assert d.healthy


def test_a_burst_spreads_over_equally_free_decode_workers() -> None:
    """Reservations still in flight count against their worker, so requests placed at the
    same instant do not all pick the first of two equally free decode workers."""

    class SlowDecode:
        def __init__(self, name: str) -> None:
            self.name, self.reserved = name, 0

        async def reserve(self, request: WorkerRequest) -> Any:
            from pool_api.messages import ReserveResult
            from protos.pdserve.v1 import kv_transfer_pb2 as kvpb

            self.reserved += 1
            await asyncio.sleep(0.05)
            ticket = kvpb.TransferTicket(transfer_id=request.request_id, dst_block_ids=[1, 2])
            return ReserveResult(ticket.SerializeToString(), 30)

    workers = [SlowDecode("d0"), SlowDecode("d1")]
    decode = Pool(Role.DECODE, [DecodeClient(w.name, cast(Any, w)) for w in workers])
    for w in decode.workers:
        w.stats_arrived(stats(w.name, Role.DECODE, 40))
    cfg = RouterConfig()
    reserver = Reserver(cfg.policy, prefill_pool(0), decode, BS, lambda coro: None)

    async def burst() -> None:
        acts = [active(3 * BS) for _ in range(6)]
        for i, a in enumerate(acts):
            a.request = WorkerRequest(f"r{i}", a.request.prompt_token_ids, a.request.params)
        await asyncio.gather(*(reserver.reserve(a, {}) for a in acts))

    asyncio.run(burst())
    assert [w.reserved for w in workers] == [3, 3]


def test_ties_go_to_the_least_recently_used_prefill_worker() -> None:
    """Among idle, equally placed prefill workers the next request goes to the one used
    longest ago, in both placement paths: a worker that just restarted (or sat idle) gets
    work instead of losing every tie to the first in order (`make chaos`' kill-prefill
    found none of 90 s of probes reaching the restarted worker)."""
    pool = prefill_pool(0, 0, 0)
    picked = []
    for i in range(6):
        w = pool.pick_prefill({}, 10 * BS, BS)
        with w.prefilling(f"r{i}", 10 * BS):  # placed, then done: idle again, all equal
            picked.append(w.name)
    assert picked == ["p0", "p1", "p2", "p0", "p1", "p2"]
    decode = decode_pool(40)
    firsts = []
    for i in range(4):
        (pair, *_) = rank_pairs(pool.workers, decode.workers, {}, 4 * BS, BS, 1e4, 1e6)
        with pair.prefill.prefilling(f"q{i}", 4 * BS):
            firsts.append(pair.prefill.name)
    assert len(set(firsts[:3])) == 3, firsts


class _SlowStats:
    """A worker API whose stats never answer in time (the unit under test is the pool)."""

    async def stats(self) -> object:
        await asyncio.sleep(10)
        raise AssertionError("never reached")


def test_one_slow_stats_answer_does_not_make_a_worker_silent() -> None:
    """A loaded host's worker that misses one refresh stays up with its calls pending; the
    second miss in a row marks it down and fails what waits on it (`SILENT_AFTER`)."""
    client = PrefillClient("p0", _SlowStats())  # type: ignore[arg-type]
    pool: Pool[PrefillClient] = Pool(Role.PREFILL, [client])
    w = pool.workers[0]
    w.stats_arrived(stats("p0", Role.PREFILL, 64))

    async def run() -> list[bool]:
        waiter = asyncio.ensure_future(client.until_silent())
        seen = []
        for _ in range(SILENT_AFTER):
            await pool.refresh(0.01, timeout_s=0.05)
            await asyncio.sleep(0)
            seen.append(w.healthy and not waiter.done())
        return seen

    assert asyncio.run(run()) == [True] * (SILENT_AFTER - 1) + [False]
    assert not w.healthy and w.missed_refreshes == SILENT_AFTER
