"""`pdserve plan`: which pool shape serves a workload best at an SLO, predicted from a profile.

For the cores (or devices) given, every candidate pool shape is simulated
(`pdserve.plan.sim`) at a grid of request rates: colocated workers, and prefill:decode
splits, each with the worker sizes the profile measured, and each at a few step budgets.
For each candidate the answer is its attainment curve (the share of requests meeting both
bounds, per rate) and its goodput (the highest rate with at least 90 % attainment); the
best is the candidate with the highest goodput (ties: fewer cores, then colocated).

The rate grid is fractions of one capacity estimate for the whole machine (the same grid
for every candidate, so their curves compare point by point), and a candidate stops being
simulated above the first rate where it falls under 50 % (attainment only falls with the
rate; recorded as 0).

Every answer carries the profile's held-out errors per validation lane ("unvalidated"
where the profile has none): a prediction whose error is unknown says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.plan.attainment import TARGET, goodput, parse_slo
from pdserve.plan.sim import Outcome, Overheads, PoolShape, SimConfig, Transfer, simulate
from pdserve.plan.stepmodel import StepCost, StepModel, StepShape
from pdserve.plan.workload import BUILT_IN, WorkloadRequest, built_in, load, rescaled
from router.forecast import ForecastFloor

FRACTIONS = (0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.1, 1.4)
"""The rate grid, as fractions of the machine's capacity estimate (`capacity_rps`)."""
BUDGETS = (2048,)
"""Step budgets tried by default (`scheduler.max_num_batched_tokens`; 2048 is the served
default); `--budgets 512,2048` tries more."""
GIVE_UP_BELOW = 0.5
DEVICE_UNIT = 8
"""`--devices N` above this plans N / 8 copies of an 8-device machine (one node)."""
PROBE_S = 600.0
"""Seconds of the workload (at 1 req/s, or the trace) that the capacity estimate draws on."""


@dataclass(frozen=True)
class Profile:
    """What the simulator reads of a `pdserve profile` JSON."""

    models: dict[int, StepCost]  # worker size (threads, or devices) -> step-time model
    block_size: int
    kv_bytes_per_block: int
    pool_blocks: int
    transfer: Transfer
    overheads: dict[str, Overheads]  # "colocated" / "split" -> the served costs
    errors: dict[str, Any]  # lane -> held-out error record, where measured
    raw: dict[str, Any]

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--profile: cannot read {path}: {e}") from None
        try:
            models = {int(k): _step_cost(w) for k, w in d["workers"].items()}
            tr = d.get("transfer", {}).get("chosen") or {}
            transfer = Transfer(
                float(tr.get("alpha_s", 0.0)), float(tr.get("beta_bytes_per_s", math.inf))
            )
            errors: dict[str, Any] = {
                "A_step_time": {
                    k: {"mape": w["held_out"]["mape"], "n": w["held_out"]["n"]}
                    for k, w in d["workers"].items()
                    if "held_out" in w
                }
                or "unvalidated",
                "B_transfer": {
                    "transport": tr.get("transport"),
                    "mape": tr["held_out"]["mape"],
                    "n": tr["held_out"]["n"],
                }
                if "held_out" in tr
                else "unvalidated",
                "C_end_to_end": d.get("validation", {}).get("C", "unvalidated"),
            }
            return cls(
                models,
                int(d["block_size"]),
                int(d["kv_bytes_per_block"]),
                int(d["pool_blocks"]),
                transfer,
                _overheads(d.get("overheads")),
                errors,
                d,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--profile: {path} is not a pdserve profile ({e})") from None


@dataclass(frozen=True)
class _ProfileTimes:
    """`router.forecast.StepTimes` from a profile's step-cost model."""

    model: StepCost

    def prefill_s(self, tokens: int) -> float:
        return self.model.predict(StepShape(((tokens, 0),), ()))

    def decode_s(self, batch: int, ctx: int) -> float:
        return self.model.predict(StepShape((), (ctx,) * batch))


def forecast_floor(path: str | Path, threads: int, tpot_ms: float) -> ForecastFloor:
    """The planner's forecast floor (`planner.profile`) from the profile at `path`: its model
    of `threads`-thread workers (0, or a size it did not measure: its smallest). ValueError
    names a file that is not a profile."""
    profile = Profile.read(path)
    size = threads if threads in profile.models else min(profile.models)
    return ForecastFloor(_ProfileTimes(profile.models[size]), tpot_ms / 1e3, size)


def _step_cost(worker: dict[str, Any]) -> StepCost:
    """A measured worker's fitted model, or a device's roofline (`pdserve.plan.device`)."""
    if "roofline" in worker:
        from pdserve.plan.device import RooflineModel

        return RooflineModel.from_json(worker["roofline"])
    return StepModel.from_json(worker["step_model"])


def _overheads(d: dict[str, Any] | None) -> dict[str, Overheads]:
    """A profile's served costs: one set for all shapes, or one per kind ("colocated",
    "split") as `make bench-plan` calibrates them; none measured: all zero."""
    d = d or {}
    if "colocated" in d or "split" in d:
        return {k: Overheads.from_json(d.get(k)) for k in ("colocated", "split")}
    return dict.fromkeys(("colocated", "split"), Overheads.from_json(d))


def candidates(
    sizes: Sequence[int], cores: int, budgets: Sequence[int] = BUDGETS
) -> list[PoolShape]:
    """Every pool shape on at most `cores` cores from the profiled worker sizes: colocated
    workers of one size, or prefill and decode pools (each of one size). Only shapes that
    use every core, or that no worker size could grow into, are kept: an idle core is never
    the better plan on a machine."""
    shapes: list[PoolShape] = []
    for b in budgets:
        for t in sizes:
            k = cores // t
            if k >= 1:
                shapes.append(PoolShape(colocated=k, threads=t, budget=b))
        for tp in sizes:
            for td in sizes:
                for p in range(1, cores // tp + 1):
                    left = cores - p * tp
                    d = left // td
                    if d >= 1:
                        shapes.append(PoolShape(prefill=p, decode=d, prefill_threads=tp,
                                                decode_threads=td, budget=b))  # fmt: skip
    smallest = min(sizes)
    return [s for s in dict.fromkeys(shapes) if cores - s.cores < smallest]


def capacity_rps(profile: Profile, requests: Sequence[WorkloadRequest], cores: int) -> float:
    """The machine's throughput on this workload, simulated: its first requests all at once
    on colocated workers of the largest profiled size filling `cores` (enough to fill every
    worker's batch twice over: 200 at least), requests over the time to finish them. Only the
    rate grid's scale depends on it."""
    t = max(t for t in profile.models if t <= cores) if min(profile.models) <= cores else 0
    if not t:
        raise ValueError(
            f"--cores {cores}: the profile's smallest worker needs {min(profile.models)}"
        )
    shape = PoolShape(colocated=max(1, cores // t), threads=t)
    cfg = sim_config(profile, shape)
    size = max(200, 2 * cfg.max_num_seqs * shape.colocated)
    burst = [replace(r, arrival_s=0.0) for r in requests[:size]]
    outcomes = simulate(cfg, burst)
    makespan = max((o.last_token_s or 0.0) for o in outcomes)
    return len(burst) / makespan if makespan > 0 else float("inf")


@dataclass
class Point:
    rate: float
    attainment: float
    n: int
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p90_ms: float | None = None
    simulated: bool = True


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def point(rate: float, outcomes: Sequence[Outcome], ttft_s: float, tpot_s: float) -> Point:
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and not o.failed]
    # a one-token request has no time per output token
    tpots = [
        o.tpot_s for o in outcomes if o.tpot_s is not None and not o.failed and o.output_tokens > 1
    ]
    met = sum(o.meets(ttft_s, tpot_s) for o in outcomes)
    return Point(
        rate,
        met / len(outcomes) if outcomes else 0.0,
        len(outcomes),
        _pct(ttfts, 50),
        _pct(ttfts, 90),
        _pct(tpots, 50),
        _pct(tpots, 90),
    )


def sim_config(profile: Profile, shape: PoolShape) -> SimConfig:
    def model(t: int) -> StepCost:
        if t not in profile.models:
            raise ValueError(f"the profile has no {t}-thread worker")
        return profile.models[t]

    pre = model(shape.threads if shape.colocated else shape.prefill_threads)
    dec = model(shape.threads if shape.colocated else shape.decode_threads)
    return SimConfig(
        shape, pre, dec, profile.block_size, profile.kv_bytes_per_block, profile.pool_blocks,
        profile.transfer, profile.overheads["colocated" if shape.colocated else "split"],
        max_num_seqs=int(profile.raw.get("max_num_seqs", 64)),
    )  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One candidate's curve: picklable, for a process pool (within `pdserve plan` only)."""

    profile_path: str
    shape: PoolShape
    rates: tuple[float, ...]
    workload: str
    duration_s: float
    seed: int
    ttft_s: float
    tpot_s: float


def workload_at(name: str, rate: float, duration_s: float, seed: int) -> list[WorkloadRequest]:
    if name in BUILT_IN:
        return built_in(name, rate, duration_s, seed)
    return rescaled(load(name), rate)


def curve(job: Job) -> list[Point]:
    profile = Profile.read(job.profile_path)
    cfg = sim_config(profile, job.shape)
    points: list[Point] = []
    for rate in job.rates:
        if points and points[-1].attainment < GIVE_UP_BELOW:
            points.append(Point(rate, 0.0, 0, simulated=False))
            continue
        reqs = workload_at(job.workload, rate, job.duration_s, job.seed)
        points.append(point(rate, simulate(cfg, reqs, job.seed), job.ttft_s, job.tpot_s))
    return points


def plan(
    profile_path: str,
    workload: str,
    slo: tuple[float, float],
    cores: int,
    duration_s: float = 600.0,
    rate: float | None = None,
    seed: int = 0,
    budgets: Sequence[int] = BUDGETS,
    jobs: int = 1,
    replicas: int = 1,
) -> dict[str, Any]:
    """Every candidate's attainment curve and goodput on `cores` (cores, or a device
    profile's devices). With `replicas` > 1 the machine is that many copies of `cores`
    behind one router: each copy is planned alone and its rates and goodput are scaled
    (requests spread evenly; what one copy cannot do for another, e.g. prefix reuse across
    copies, is not modelled)."""
    profile = Profile.read(profile_path)
    probe = workload_at(workload, rate or 1.0, max(duration_s, PROBE_S), seed)
    cap = capacity_rps(profile, probe, cores)
    rates = sorted({round(f * cap, 4) for f in FRACTIONS} | ({round(rate, 4)} if rate else set()))
    shapes = candidates(sorted(profile.models), cores, budgets)
    if not shapes:
        raise ValueError(
            f"--cores {cores}: no pool shape fits (profiled sizes {sorted(profile.models)})"
        )
    work = [Job(profile_path, s, tuple(rates), workload, duration_s, seed, *slo) for s in shapes]
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(min(jobs, len(work))) as ex:
            curves = list(ex.map(curve, work))
    else:
        curves = [curve(j) for j in work]
    results = []
    for shape, pts in zip(shapes, curves, strict=True):
        g = goodput([p.rate for p in pts], [p.attainment for p in pts], TARGET)
        at = next((p for p in pts if rate and math.isclose(p.rate, round(rate, 4))), None)
        results.append(
            {
                "shape": shape.label,
                "pool": asdict(shape),
                "cores": shape.cores,
                "goodput_rps": g["rps"],
                "goodput_bound": g["bound"],
                "at_rate": asdict(at) if at else None,
                "curve": [asdict(p) for p in pts],
            }
        )

    def rank(r: dict[str, Any]) -> tuple[float, int, bool]:
        return (-(r["goodput_rps"] or 0.0), r["cores"], r["pool"]["colocated"] == 0)

    results.sort(key=rank)
    answer = {
        "profile": profile_path,
        "model": profile.raw.get("model_name"),
        "dtype": profile.raw.get("dtype"),
        "cpu": profile.raw.get("cpu"),
        "measured_profile": bool(profile.raw.get("measured", True)),
        "workload": workload,
        "duration_s": duration_s,
        "slo": {"ttft_ms": slo[0] * 1e3, "tpot_ms": slo[1] * 1e3, "target": TARGET},
        "cores": cores * replicas,
        "unit": "devices" if profile.raw.get("device", "cpu") != "cpu" else "cores",
        "replicas": replicas,
        "capacity_estimate_rps": round(cap, 4),
        "rates": rates,
        "best": results[0]["shape"],
        "candidates": results,
        "errors": profile.errors,
    }
    return _replicated(answer, replicas) if replicas > 1 else answer


def _replicated(answer: dict[str, Any], k: int) -> dict[str, Any]:
    """One copy's answer as `k` copies': every rate and goodput times k."""

    def times(v: float | None) -> float | None:
        return None if v is None else round(v * k, 4)

    answer["rates"] = [times(r) for r in answer["rates"]]
    answer["capacity_estimate_rps"] = times(answer["capacity_estimate_rps"])
    for c in answer["candidates"]:
        c["goodput_rps"] = times(c["goodput_rps"])
        for p in c["curve"]:
            p["rate"] = times(p["rate"])
    return answer


def plot(answer: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, c in enumerate(answer["candidates"]):
        pts = c["curve"]
        style = "-" if i == 0 else "--" if c["pool"]["colocated"] else ":"
        label = f"{c['shape']} ({c['goodput_rps'] or 0:.3g} req/s)"
        rates, att = [p["rate"] for p in pts], [p["attainment"] * 100 for p in pts]
        ax.plot(rates, att, style, marker="o", ms=3, label=label)
    ax.axhline(TARGET * 100, color="grey", lw=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    slo = answer["slo"]
    ax.set_title(
        f"{answer['workload']}: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.0f} ms, "
        f"{answer['cores']} {answer['unit']} (predicted)",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.3g}{unit}"


def print_answer(answer: dict[str, Any], out: Any = sys.stdout) -> None:
    slo = answer["slo"]
    print(
        f"pdserve plan: {answer['workload']} on {answer['cores']} {answer['unit']}"
        + (f" ({answer['replicas']} copies of the shapes below)" if answer["replicas"] > 1 else "")
        + ", TTFT <= "
        f"{slo['ttft_ms']:.0f} ms and TPOT <= {slo['tpot_ms']:.0f} ms for {TARGET:.0%} of "
        f"requests ({answer['model']} {answer['dtype']}, {answer['cpu']})",
        file=out,
    )
    rates = answer["rates"]
    print("attainment (%) at req/s: " + "  ".join(f"{r:.3g}" for r in rates), file=out)
    for c in answer["candidates"]:
        cells = " ".join(
            f"{p['attainment'] * 100:5.1f}" if p["simulated"] else "    -" for p in c["curve"]
        )
        print(f"  {c['shape']:<22} goodput {_fmt(c['goodput_rps']):>7} req/s  {cells}", file=out)
    print(f"best: {answer['best']}", file=out)
    for lane, err in answer["errors"].items():
        if isinstance(err, dict) and "scores" in err:  # lane C: one line per score
            print(f"held-out error, lane {lane} (mean |error| %, attainment max points):", file=out)
            for key, sc in err["scores"].items():
                cells = ", ".join(f"{k} {v}" for k, v in sc.items())
                print(f"  {key}: {cells}", file=out)
            continue
        print(f"held-out error, lane {lane}: {json.dumps(err)}", file=out)
    if not answer["measured_profile"]:
        print("the profile is an unmeasured extrapolation (a published roofline)", file=out)


def run_plan(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    if args.devices is not None and args.cores is not None:
        raise ValueError("--cores and --devices: one of them")
    units = args.devices if args.devices is not None else args.cores
    if units is None:
        units = len(os.sched_getaffinity(0))
    if units < 1:
        raise ValueError("--cores/--devices: at least 1")
    replicas = 1
    if args.devices is not None:
        device = Profile.read(args.profile).raw.get("device", "cpu")
        if device == "cpu":
            raise ValueError(
                "--devices: the profile is of a CPU; make a device's with "
                "`pdserve profile --device h100`, or plan --cores"
            )
        if units > DEVICE_UNIT:
            if units % DEVICE_UNIT:
                raise ValueError(f"--devices: up to {DEVICE_UNIT}, or a multiple of it")
            replicas, units = units // DEVICE_UNIT, DEVICE_UNIT
    if args.workload not in BUILT_IN and not Path(args.workload).is_file():
        raise ValueError(f"--workload: one of {', '.join(BUILT_IN)} or a .jsonl file")
    budgets: tuple[int, ...] = BUDGETS
    if args.budgets:
        try:
            budgets = tuple(int(b) for b in args.budgets.split(","))
        except ValueError:
            raise ValueError(f"--budgets: integers, e.g. 512,2048, not {args.budgets!r}") from None
        if min(budgets) < 1:
            raise ValueError("--budgets: positive")
    jobs = args.jobs or len(os.sched_getaffinity(0))
    answer = plan(
        args.profile, args.workload, slo, units, args.duration,
        args.rate / replicas if args.rate else None, args.seed, budgets, jobs, replicas,
    )  # fmt: skip
    if args.plot:
        plot(answer, Path(args.plot))
        answer["plot"] = args.plot
    if args.json:
        print(json.dumps(answer, indent=1))
    else:
        print_answer(answer)
        if args.plot:
            print(f"attainment curves: {args.plot}")
    return 0
