#!/usr/bin/env python
"""The planner under a 3x load step, acting on mock workers: whether attainment recovers.

`benchmarks/planner_step.py` runs the step on real workers, where every worker added is one
more process on the same two cores: the control loop shows, the capacity it buys does not.
Here the router and the planner are the real ones (`pdserve.tools.mock_workers`,
`benchmarks/pool_mock.py`), and the workers are mocks whose prompt passes and decode steps
take the time the profile's step model predicts, so a worker added or flipped adds the
capacity a real one would on its own cores. A cold add takes `--start-s` (the default
model's measured cold start, `make bench-pool`); a flip is a drain plus a role switch.

With `--floor` the planner also keeps the forecast floor its profile gives (`planner.profile`,
the same profile the mocks step by: the floor's model is then exact, and what is measured is
the loop). Poisson arrivals of `--prompt-len`-token prompts (`--max-tokens` out) at `--rate` for
`--phase-s`, three times that, then `--rate` again. Each request is scored against the SLO
the planner holds (`--ttft-ms`, `--tpot-ms`). Reported: every request's outcome (nothing
may be lost), the planner's decisions, the pools' sizes, the attainment of the requests
finished in the last `--window-s` each second, and how long after the step it was back
above 90 % to stay. Writes `benchmarks/results/planner-step-mock-latest.json` and a plot
(`.png`: offered rate, workers per role, attainment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # its siblings, as the other benchmarks import theirs

from planner_step import plot  # noqa: E402
from pool_mock import PROFILE, drive, mock_router, start_hosts, step_model  # noqa: E402

from engine.cpu import identity  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "planner-step-mock-latest.json"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from pdserve.plan.plan import forecast_floor
    from pdserve.tools.mock_workers import MockLauncher
    from protos.pdserve.v1 import generation_pb2 as gen
    from router.config import PlannerSettings

    hosts = start_hosts(args.hosts, step_model(args.profile))
    placed: dict[str, Any] = {}
    router = await mock_router(1, 1, hosts, placed)
    router.admin.launcher = MockLauncher(hosts, placed, args.start_s)
    await router.start()
    settings = PlannerSettings(
        enabled=True,
        mode=args.mode,
        interval_s=args.interval_s,
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        window_s=args.window_s,
        patience=2,
        max_prefill=args.max_workers,
        max_decode=args.max_workers,
        # the forecast floor from the same profile the mocks step by (their 1-thread model)
        profile=str(args.profile) if args.floor else "",
        profile_threads=1,
    )
    forecast = forecast_floor(args.profile, 1, args.tpot_ms) if args.floor else None
    planner = router.start_planner(settings, forecast)
    done: list[dict[str, Any]] = []  # finished requests
    rng = random.Random(0)
    sampling = gen.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        ids = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=ids), sampling=sampling)
        d = await drive(router, req, args.max_tokens)
        ttft = tpot = None
        met = False
        if d.first is not None:
            ttft = (d.first - d.sent) * 1e3
            tpot = (d.end - d.first) * 1e3 / max(1, d.tokens - 1)
            met = ttft <= args.ttft_ms and tpot <= args.tpot_ms
        done.append(
            {"end": d.end, "outcome": d.outcome, "ttft_ms": ttft, "tpot_ms": tpot, "met": met}
        )

    def sample(now: float) -> dict[str, Any]:
        """Offered rate, pool sizes, and attainment: ours (the last window_s) and the planner's."""
        recent = [d for d in done if d["end"] >= now - args.window_s]
        signals = planner.last_signals
        return {
            "t": now - t_start,
            "rate": rate,
            "prefill": len(router.prefill.routable()),
            "decode": len(router.decode.routable()),
            "attainment": sum(d["met"] for d in recent) / len(recent) if recent else None,
            "planner_attainment": signals.attainment if signals is not None else None,
            "floor_prefill": signals.floor_prefill if signals is not None else None,
            "floor_decode": signals.floor_decode if signals is not None else None,
        }

    rows: list[dict[str, Any]] = []
    tasks: list[asyncio.Task[None]] = []
    t_start = time.perf_counter()
    phases = [(args.rate, args.phase_s), (3 * args.rate, args.phase_s), (args.rate, args.phase_s)]
    i = 0
    next_sample = t_start
    for rate, seconds in phases:
        end = time.perf_counter() + seconds
        arrival = time.perf_counter()
        while True:
            arrival += rng.expovariate(rate)
            while time.perf_counter() < min(arrival, end):
                now = time.perf_counter()
                if now >= next_sample:
                    rows.append(sample(now))
                    next_sample += 1.0
                await asyncio.sleep(min(0.05, max(0.0, min(arrival, end) - now)))
            if arrival >= end:
                break
            tasks.append(asyncio.create_task(one(i)))
            i += 1
    await asyncio.gather(*tasks)
    planner.stop()
    decisions = {f"{a} ({m})": n for (a, m), n in planner.decisions.items()}
    await router.drain(0.0)
    ray.shutdown()
    # back above 90 %, to stay until the step ends (None: not within the step)
    step_at, step_end = args.phase_s, 2 * args.phase_s
    during = [r for r in rows if step_at <= r["t"] < step_end and r["attainment"] is not None]
    recovered = None
    for k, r in enumerate(during):
        if r["t"] > step_at + args.window_s and all(x["attainment"] >= 0.9 for x in during[k:]):
            recovered = r["t"] - step_at
            break
    outcomes: dict[str, int] = {}
    for d in done:
        outcomes[d["outcome"]] = outcomes.get(d["outcome"], 0) + 1
    return {
        "cpu": identity(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "requests": len(done),
        "outcomes": outcomes,
        "decisions": decisions,
        "recovered_s_after_step": recovered,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="act", choices=["advisory", "act"])
    p.add_argument("--rate", type=float, default=2.0, help="the base rate, req/s")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds of each phase")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=100.0)
    p.add_argument("--window-s", type=float, default=10.0, help="the planner's and ours")
    p.add_argument("--interval-s", type=float, default=2.0, help="the planner's tick")
    p.add_argument("--max-workers", type=int, default=4, help="per role")
    p.add_argument("--start-s", type=float, default=8.5, help="a cold add's modelled time")
    p.add_argument("--hosts", type=int, default=2, help="Ray actor processes of the mocks")
    p.add_argument("--profile", type=Path, default=PROFILE, help="a `pdserve profile` JSON")
    p.add_argument(
        "--floor", action="store_true", help="the planner's forecast floor from --profile too"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    rows = [dict(r, attainment=r["attainment"] if r["attainment"] is not None else 1.0)
            for r in result["rows"]]  # fmt: skip
    plot(rows, args.out.with_suffix(".png"))
    print(f"CPU: {result['cpu']}")
    print(f"{result['requests']} requests: {result['outcomes']}")
    print(f"planner decisions: {result['decisions']}")
    print(
        f"attainment back above 90 % to stay: {result['recovered_s_after_step']} s after the step"
    )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    lost = sum(n for k, n in result["outcomes"].items() if k != "ok")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
