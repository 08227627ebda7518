#!/usr/bin/env python
"""The real router and planner against 20-200 mock workers on a real Ray cluster: whether the
control plane holds at that size, and what the router costs per request.

Mock workers (`pdserve.tools.mock_workers`) answer the worker API from the profile's step
model (the committed `pdserve profile` of the default model, or `--profile`): prompt passes
and decode steps take the time the model predicts, tokens reach the router's token sink over
the real wire, and stats, reservations and heartbeats behave as a real worker's. Many share
one Ray actor process (`--hosts`); the router holds one handle per worker.

For each pool size N (half prefill, half decode, disaggregated), in the driver process (the
router, with Ray's driver threads, as in `pdserve serve`):

* **idle**: the router's CPU per second with no request (its refreshes of N workers' stats
  and index updates every `stats_refresh_s`);
* **load**: `--requests` requests at `--concurrency`, each `--prompt-len` tokens in and
  `--max-tokens` out; the router's CPU per request (its CPU during the load less the idle
  rate over the same time), the end-to-end latency, and every request's outcome;
* **the router's overhead per request**, under that load and then with `--alone-requests`
  sent one at a time: the part of each request's latency that no worker spent
  (`mock_workers.router_overhead_s`, from the mocks' marks of when each call reached them
  and when they answered);
* **the planner** (advisory, so it changes nothing): its tick times over the run.

Issue 41's targets: the router's overhead per request <= 1 ms at the median, every planner
tick <= 100 ms, at 200 workers. Prints a table; writes `benchmarks/results/pool-mock-latest.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from engine.cpu import identity  # noqa: E402
from pdserve.tools.mock_workers import (  # noqa: E402
    Driven,
    drive,
    mock_router,
    router_overhead_s,
    start_hosts,
    take_marks,
)

RESULTS = ROOT / "benchmarks" / "results" / "pool-mock-latest.json"
PROFILE = ROOT / "benchmarks" / "results" / "plan" / "profile.json"


def step_model(profile: Path) -> dict[str, float]:
    """The one-worker step model of a `pdserve profile` file (seconds per term)."""
    d = json.loads(profile.read_text())
    model: dict[str, float] = d["workers"]["1"]["step_model"]
    return model


async def measure(n: int, hosts: list[Any], args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    from router.config import PlannerSettings

    placed: dict[str, Any] = {}
    router = await mock_router(n // 2, n - n // 2, hosts, placed)
    prefill, decode = router.prefill, router.decode
    await router.start()
    planner = router.start_planner(
        PlannerSettings(enabled=True, mode="advisory", interval_s=1.0, max_prefill=n, max_decode=n)
    )
    ticks: list[float] = []

    async def watch_ticks() -> None:
        seen = 0
        while True:
            await asyncio.sleep(0.05)
            if sum(planner.decisions.values()) > seen:
                seen = sum(planner.decisions.values())
                ticks.append(planner.tick_s)

    watcher = asyncio.create_task(watch_ticks())
    try:
        await asyncio.sleep(2.0)  # the first refreshes and ticks
        bar.set_postfix_str(f"{n} workers: idle")
        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle_cpu_per_s = (time.process_time() - c0) / (time.perf_counter() - t0)

        bar.set_postfix_str(f"{n} workers: load")
        c0, t0 = time.process_time(), time.perf_counter()
        driven = await load(router, args.requests, args.concurrency, args)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        per_request_ms = (cpu - idle_cpu_per_s * wall) / args.requests * 1e3
        bar.set_postfix_str(f"{n} workers: one at a time")
        alone = await load(router, args.alone_requests, 1, args, offset=args.requests)
        marks = await take_marks(hosts)
        await asyncio.sleep(1.5)
        held = [w.stats for p in (prefill, decode) for w in p.workers if w.stats is not None]
        stuck = sum(1 for st in held if st.num_running or st.num_reserved)
    finally:
        watcher.cancel()
        await router.drain(0.0)
        await asyncio.gather(*(placed[w].remove.remote(w) for w in placed))
    latencies = [d.end - d.sent for d in driven]
    outcomes: dict[str, int] = {}
    for d in driven + alone:
        outcomes[d.outcome] = outcomes.get(d.outcome, 0) + 1
    return {
        "workers": n,
        "idle_router_cpu_per_s": idle_cpu_per_s,
        "router_cpu_ms_per_request": per_request_ms,
        "requests": args.requests,
        "wall_s": wall,
        "requests_per_s": args.requests / wall,
        "latency_ms_p50": statistics.median(latencies) * 1e3,
        "latency_ms_p90": statistics.quantiles(latencies, n=10)[-1] * 1e3,
        "router_overhead_ms": overhead(driven, marks),
        "router_overhead_ms_alone": overhead(alone, marks),
        "outcomes": outcomes,
        "workers_holding_requests_after": stuck,
        "planner_ticks": len(ticks),
        "planner_tick_ms_max": max(ticks) * 1e3 if ticks else None,
        "planner_tick_ms_p50": statistics.median(ticks) * 1e3 if ticks else None,
        "planner_last": planner.last.line() if planner.last else "",
        "ray_actor_processes": len(hosts),
    }


async def load(
    router: Any, count: int, concurrency: int, args: argparse.Namespace, offset: int = 0
) -> list[Driven]:
    """`count` requests through the router, `concurrency` in flight."""
    from protos.pdserve.v1 import generation_pb2 as gen

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(offset, offset + count):
        queue.put_nowait(i)
    driven: list[Driven] = []
    sampling = gen.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def client() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            ids = [(i * 7 + j) % 40000 + 100 for j in range(args.prompt_len)]
            req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=ids), sampling=sampling)
            driven.append(await drive(router, req, args.max_tokens))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return driven


def overhead(driven: list[Driven], marks: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The router's overhead per request (`router_overhead_s`): median, p90, and how many
    requests it was measured on."""
    each = (router_overhead_s(d, marks.get(d.request_id, {})) for d in driven)
    got = [o for o in each if o is not None]
    if not got:
        return {"n": 0, "p50": None, "p90": None}
    p90 = statistics.quantiles(got, n=10)[-1] if len(got) > 1 else got[0]
    return {"n": len(got), "p50": statistics.median(got) * 1e3, "p90": p90 * 1e3}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    model = step_model(args.profile)
    hosts = start_hosts(args.hosts, model)
    rows = []
    with tqdm(total=len(args.workers), desc="pool-mock", unit="size") as bar:
        for n in args.workers:
            rows.append(await measure(n, hosts, args, bar))
            bar.update()
    ray.shutdown()
    return {"cpu": identity(), "args": {k: str(v) for k, v in vars(args).items()},
            "step_model": model, "rows": rows}  # fmt: skip


def report(result: dict[str, Any]) -> list[str]:
    lines = [
        f"CPU: {result['cpu']}",
        "| workers (P + D) | router CPU idle, % of a core | router CPU per request, ms | "
        "req/s | latency p50 / p90, ms | router overhead p50 / p90, ms | the same, one at "
        "a time | outcomes | planner tick p50 / max, ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['workers']} | {r['idle_router_cpu_per_s'] * 100:.1f} | "
            f"{r['router_cpu_ms_per_request']:.2f} | {r['requests_per_s']:.1f} | "
            f"{r['latency_ms_p50']:.0f} / {r['latency_ms_p90']:.0f} | "
            f"{_pair(r['router_overhead_ms'])} | {_pair(r['router_overhead_ms_alone'])} | "
            f"{r['outcomes']} | "
            f"{r['planner_tick_ms_p50']:.2f} / {r['planner_tick_ms_max']:.2f} |"
        )
    return lines


def _pair(o: dict[str, Any]) -> str:
    return "-" if o["p50"] is None else f"{o['p50']:.2f} / {o['p90']:.2f} (n={o['n']})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[20, 100, 200],
        help="pool sizes, comma-separated (half each role)",
    )
    p.add_argument("--hosts", type=int, default=4, help="Ray actor processes hosting the mocks")
    p.add_argument("--requests", type=int, default=400, help="requests per pool size")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument(
        "--alone-requests", type=int, default=50, help="then requests sent one at a time"
    )
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens")
    p.add_argument("--idle-s", type=float, default=5.0, help="the idle measurement")
    p.add_argument("--profile", type=Path, default=PROFILE, help="a `pdserve profile` JSON")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    result = asyncio.run(main_async(args))
    print("\n".join(report(result)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    failed = sum(v for r in result["rows"] for k, v in r["outcomes"].items() if k != "ok")
    return 1 if failed or any(r["workers_holding_requests_after"] for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
