"""The router's control plane at 20-200 workers, without the workers: what one request's
placement (`Reserver.pair_order`: every prefill x decode pair ranked) and one planner tick
(`Planner.read` + `decide`) cost in the router's own CPU, with pools of N workers whose
stats are set by hand (their clients are never called).

The whole router against 20-200 mock workers on Ray is `benchmarks/pool_mock.py`; this
isolates the part of its cost that grows with the pool, to see whether the placement stays
within the 1 ms target at that size.
Prints a table and writes `benchmarks/results/pool-scale-latest.json`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.cpu import identity  # noqa: E402
from pool_api.messages import Role, WorkerStats  # noqa: E402
from router.clients import DecodeClient, PrefillClient  # noqa: E402
from router.config import PlannerSettings, PolicySettings  # noqa: E402
from router.membership import PoolAdmin  # noqa: E402
from router.planner import Planner  # noqa: E402
from router.pools import Pool  # noqa: E402
from router.reservation import Reserver  # noqa: E402


def pools(n: int) -> tuple[Pool[Any], Pool[Any]]:
    """n/2 prefill and n/2 decode workers with stats (clients never called)."""
    never: Any = None
    out = []
    for role, cls in ((Role.PREFILL, PrefillClient), (Role.DECODE, DecodeClient)):
        clients = [cls(f"pdserve-{role.value}-{i}", never) for i in range(n // 2)]
        pool: Pool[Any] = Pool(role, clients)
        for i, w in enumerate(pool.workers):
            w.stats = WorkerStats(w.name, role, 1000 - i, 1024, i % 8, 0, 0, 64 * i, 0, 0,
                                  kv_bytes_per_block=65536)  # fmt: skip
        out.append(pool)
    return out[0], out[1]


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(n: int) -> dict[str, float]:
    """One pool size: the placement per request and the planner tick, median ms."""
    from engine.sampling import SamplingParams
    from pool_api.messages import WorkerRequest
    from router.active import ActiveRequest

    prefill, decode = pools(n)
    reserver = Reserver(PolicySettings(), prefill, decode, 16, lambda c: None)
    req = WorkerRequest("r", tuple(range(512)), SamplingParams(max_tokens=64))
    act = ActiveRequest(req, time.perf_counter())
    matches = {f"pdserve-decode-{i}": 4 for i in range(0, n // 2, 7)}
    place = timed(lambda: reserver.pair_order(act, matches), 200)
    never_indexed: Any = None
    admin = PoolAdmin(prefill, decode, never_indexed, lambda name: 0, False, 60.0)
    planner = Planner(PlannerSettings(enabled=True), admin, prefill, decode, False)
    tick = timed(lambda: planner.decide(planner.read(time.perf_counter())), 50)
    return {"workers": n, "placement_ms": place * 1e3, "planner_tick_ms": tick * 1e3}


def main() -> int:
    rows = [measure(n) for n in (20, 50, 100, 200)]
    print(f"CPU: {identity()}")
    print("| workers (P + D) | placement per request, ms | planner tick, ms |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['placement_ms']:.3f} | {r['planner_tick_ms']:.3f} |")
    out = ROOT / "benchmarks/results/pool-scale-latest.json"
    out.write_text(json.dumps({"cpu": identity(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
