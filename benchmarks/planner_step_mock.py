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
from pdserve.plan.elastic import recovered_after  # noqa: E402

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
            {"sent": d.sent - t_start, "first": None if d.first is None else d.first - t_start,
             "end": d.end, "outcome": d.outcome, "ttft_ms": ttft, "tpot_ms": tpot, "met": met,
             "tokens": d.tokens}
        )  # fmt: skip

    def sample(now: float) -> dict[str, Any]:
        """Offered rate, pool sizes, and attainment: ours (the last window_s) and the planner's."""
        recent = [d for d in done if d["end"] >= now - args.window_s]
        signals = planner.last_signals
        last = planner.last
        fresh = not decided or decided[-1][1] is not last
        if last is not None and last.action != "hold" and fresh:
            decided.append((now - t_start, last))
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
    decided: list[tuple[float, Any]] = []  # (when a sample first saw it, the decision)
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
    series = [(r["t"], r["attainment"]) for r in rows]
    recovered = recovered_after(series, step_at, step_end, args.window_s)
    outcomes: dict[str, int] = {}
    for d in done:
        outcomes[d["outcome"]] = outcomes.get(d["outcome"], 0) + 1
    return {
        "cpu": identity(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "requests": len(done),
        "outcomes": outcomes,
        "decisions": decisions,
        "decided": [f"t={t:.0f} s: {d.line()}" for t, d in decided],
        "recovered_s_after_step": recovered,
        "rows": rows,
        "predicted": predict(args, settings, done, t_start) if args.predict else None,
    }


def poisson_steps(args: argparse.Namespace, rng: random.Random) -> list[float]:
    """Arrival times of the step load (`--rate`, three times it, `--rate` again)."""
    out, t = [], 0.0
    for k, rate in enumerate((args.rate, 3 * args.rate, args.rate)):
        end = (k + 1) * args.phase_s
        while (t := t + rng.expovariate(rate)) < end:
            out.append(t)
        t = end
    return out


def predict(
    args: argparse.Namespace, settings: Any, done: list[dict[str, Any]], t_start: float
) -> dict[str, Any]:
    """The same arrivals through `pdserve.plan.elastic`: the simulator's pools (1P1D, the
    profile's 1-thread model, as the mocks step by; no transfer and no served costs, which
    the mocks do not model) under the planner acting on simulated time."""
    import dataclasses

    from pdserve.plan.elastic import ElasticSimulator, attainment_series
    from pdserve.plan.plan import Profile, forecast_floor, sim_config
    from pdserve.plan.sim import Overheads, PoolShape, Transfer
    from pdserve.plan.workload import WorkloadRequest
    from pdserve.tools.mock_workers import BLOCK_SIZE

    cfg = dataclasses.replace(
        sim_config(Profile.read(args.profile), PoolShape(prefill=1, decode=1)),
        block_size=BLOCK_SIZE, pool_blocks=4096, transfer=Transfer(), overheads=Overheads(),
    )  # fmt: skip
    forecast = forecast_floor(args.profile, 1, args.tpot_ms) if args.floor else None
    acting = dataclasses.replace(settings, mode="act")
    ttft_s, tpot_s = args.ttft_ms / 1e3, args.tpot_ms / 1e3
    step_at, step_end = args.phase_s, 2 * args.phase_s

    def simulate(arrivals: list[float]) -> tuple[Any, dict[float, float | None]]:
        workload = [WorkloadRequest(t, args.prompt_len, args.max_tokens) for t in arrivals]
        run = ElasticSimulator(cfg, acting, forecast, args.start_s).run_elastic(workload)
        return run, dict(attainment_series(run.outcomes, ttft_s, tpot_s, args.window_s))

    run, series = simulate(sorted(d["sent"] for d in done))
    # the same load, other Poisson draws: how much the recovery owes to this run's draw
    others = []
    for seed in range(1, args.realizations + 1):
        _, s = simulate(poisson_steps(args, random.Random(seed)))
        others.append(recovered_after(list(s.items()), step_at, step_end, args.window_s))
    pools = {round(s.t): (s.prefill, s.decode) for s in run.samples}
    rows, last = [], (1, 1)
    for t in sorted(series):
        last = pools.get(round(t), last)
        rows.append({"t": t, "prefill": last[0], "decode": last[1], "attainment": series[t]})
    return {
        "recovered_s_after_step": recovered_after(
            list(series.items()), step_at, step_end, args.window_s
        ),
        "other_draws_recovered_s": others,
        "decisions": [f"t={t:.0f} s: {line}" for t, line in run.decisions],
        "failed": sum(1 for o in run.outcomes if o.failed),
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
    p.add_argument(
        "--predict",
        action="store_true",
        help="also the planner acting on the same arrivals in the simulator (pdserve.plan.elastic)",
    )
    p.add_argument(
        "--realizations", type=int, default=20, help="--predict: other draws of the load too"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    rows = [dict(r, attainment=r["attainment"] if r["attainment"] is not None else 1.0)
            for r in result["rows"]]  # fmt: skip
    pred = result["predicted"]
    predicted = [dict(r, attainment=r["attainment"] if r["attainment"] is not None else 1.0)
                 for r in pred["rows"]] if pred else None  # fmt: skip
    plot(rows, args.out.with_suffix(".png"), predicted)
    print(f"CPU: {result['cpu']}")
    print(f"{result['requests']} requests: {result['outcomes']}")
    print(f"planner decisions: {result['decisions']}")
    for line in result["decided"]:
        print(f"  {line}")
    print(
        f"attainment back above 90 % to stay: {result['recovered_s_after_step']} s after the step"
    )
    if pred:
        print("predicted (pdserve.plan.elastic, the planner acting on the same arrivals):")
        for line in pred["decisions"]:
            print(f"  {line}")
        print(f"  back above 90 % to stay: {pred['recovered_s_after_step']} s after the step")
        others = pred["other_draws_recovered_s"]
        within = sum(1 for r in others if r is not None and r <= 30)
        print(f"  on {len(others)} other Poisson draws of the load: within 30 s in {within}: "
              f"{others}")  # fmt: skip
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    lost = sum(n for k, n in result["outcomes"].items() if k != "ok")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
