#!/usr/bin/env python
"""`make bench-plan`: `pdserve plan`'s predictions against real runs on this machine.

Lanes (docs/plan.md), each scored on data the fit never saw:

- **A, step time**: the profile's held-out shapes (`pdserve profile`; its JSON has them).
- **C, end to end**: real `pdserve serve` runs, colocated (one worker, every core) and 1P1D
  (one single-threaded worker each), replaying built-in workloads with `pdserve bench
  --dataset-name trace` at fractions of each configuration's predicted capacity. For each
  run the simulator predicts the same requests. The fixed served costs (`Overheads`: the
  TTFT offset and a per-step cost) are calibrated on the **fit workload** (`chat`) alone;
  the other workloads (`documents`, `agentic`) are held out.

Per run it records the load average before the run (runs taken on a busy machine are
marked and left out of the scores), n, TTFT and TPOT p50/p90 measured and predicted,
attainment at the SLO measured and predicted; per configuration and workload, the goodput
(interpolated, `pdserve.plan.attainment.goodput`) measured and predicted; and whether the
best configuration predicted is the one measured best.

- **B, transfer**: the profile's held-out transfer sizes, per transport (`pdserve profile`
  times real transfers between two processes; its JSON has them). The 1P1D runs use the
  serving transport's fitted `α + bytes/β`.

The SLO scales with the machine and the workload (`workload_slo`): TTFT within 8 predicted
512-token prompt passes, or 4 passes of the workload's 90th-percentile prompt where longer;
TPOT within 5 predicted batch-1 decode steps (both with the largest worker). Each run sends
prompts of its own (a seed per run), so no run hits what an earlier one left in the server's
prefix cache, and lasts long enough for `--min-requests` requests (up to 3 x `--duration`).

Results: `benchmarks/results/plan/validation.json` and `validation.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from serving import Server
from tqdm import tqdm

from engine.cpu import identity
from engine.loop import STEP_LOG_ENV
from pdserve.plan.attainment import goodput
from pdserve.plan.plan import Profile, capacity_rps, point, sim_config
from pdserve.plan.sim import (
    Outcome,
    Overheads,
    PoolShape,
    SimConfig,
    offered_token_rate,
    simulate,
)
from pdserve.plan.stepmodel import StepCost, StepShape, fit_relative
from pdserve.plan.workload import WorkloadRequest, built_in, dump
from pdserve.plan.workload import load as load_trace

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "plan"
CONFIGS = {
    "colocated": PoolShape(colocated=1, threads=2),
    "1P1D": PoolShape(prefill=1, decode=1),
}
FIT_WORKLOAD = "chat"
BUSY_CORES = 0.3  # cores busy (of all) while the idle server waits: a busy machine


def busy_cores(seconds: float = 2.0) -> float:
    """Cores busy over `seconds` (from /proc/stat), taken while the server idles between
    runs: what else is running on the machine. (The load average still counts the last
    run's work for a minute after it.)"""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    t0, i0 = read()
    time.sleep(seconds)
    t1, i1 = read()
    return (1 - (i1 - i0) / max(1, t1 - t0)) * len(os.sched_getaffinity(0))


def serve_args(config: str, model: str, dtype: str, run_dir: Path) -> list[str]:
    args = ["--model", model, "--dtype", dtype]
    if config == "colocated":
        ncpu = len(os.sched_getaffinity(0))
        cfg = run_dir / "colocated.yaml"
        cfg.write_text(f"decode:\n  num_cpus: {ncpu}\n  num_threads: {ncpu}\n")
        return [*args, "--colocated", "--decode-workers", "1", "--config", str(cfg)]
    return [*args, "--prefill-workers", "1", "--decode-workers", "1"]


def replay(target: str, trace: Path, out: Path, seed: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "bench",
        "--target",
        target,
        "--dataset-name",
        "trace",
        "--dataset-path",
        str(trace),
        "--seed",
        str(seed),
        "--temperature",
        "0",
        "--save-result",
        "--result-filename",
        str(out),
        "--disable-tqdm",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.read_text())


def measured_outcomes(reqs: list[WorkloadRequest], res: dict[str, Any]) -> list[Outcome]:
    """The bench result as the simulator's outcomes (times relative to each arrival)."""
    out = []
    for r, ttft, itl, err in zip(reqs, res["ttfts"], res["itls"], res["errors"], strict=True):
        o = Outcome(r.arrival_s, r.output_tokens)
        if err:
            o.failed = err[:80]
        else:
            o.first_token_s = r.arrival_s + ttft
            o.last_token_s = o.first_token_s + sum(itl)
        out.append(o)
    return out


TPOT_STEPS = 5


def workload_slo(model: StepCost, workload: str, duration: float, seed: int) -> tuple[float, float]:
    """The SLO (TTFT, TPOT seconds) of a workload, scaled to the machine (`model`: the
    largest worker's): TTFT within 8 uncached 512-token passes, or 4 passes of the
    workload's 90th-percentile prompt where that is longer (a long document's answer may
    start later than a chat's); TPOT within 5 batch-1 decode steps at 512 tokens (at 3, a
    served run's TPOT p90 sat on the bound at the lowest rate on a noisy host, and every
    attainment was decided by noise)."""
    prompts = sorted(r.prompt_tokens for r in built_in(workload, 1.0, duration, seed))
    p90 = prompts[int(0.9 * (len(prompts) - 1))]
    ttft = max(8 * model.predict(StepShape(((512, 0),))), 4 * model.predict(StepShape(((p90, 0),))))
    return ttft, TPOT_STEPS * model.predict(StepShape((), (512,)))


def summary(outcomes: list[Outcome], slo: tuple[float, float]) -> dict[str, Any]:
    """`pdserve plan`'s figures of one rate (`plan.point`), and the failed count."""
    p = point(0.0, outcomes, *slo)
    figures = asdict(p)
    return {
        "n": p.n,
        "failed": sum(1 for o in outcomes if o.failed or o.ttft_s is None),
        **{k: figures[k] for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")},
        "attainment": p.attainment,
    }


def read_steps(log_dir: Path, t0: float, t1: float) -> list[dict[str, Any]]:
    """The step records (`engine.loop.StepLog`) every worker wrote between t0 and t1 (wall
    clock), each with its worker's name."""
    out = []
    for f in sorted(log_dir.glob("*.jsonl")):
        worker = f.stem.rsplit("-", 1)[0]
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line still being written
            if t0 <= rec["t"] <= t1:
                out.append(rec | {"worker": worker})
    return out


def served_steps(cfg: SimConfig, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The served steps against the profile's model of each step's worker (its prefill or
    decode model in `cfg`; fitted on an idle machine):

    - `engine_mape`, `engine_bias_pct`: the model's error on `LLMEngine.step` itself, served
      (the router, Ray and the client share the host's cores with it);
    - `scale`: the loop's cycles (the step, handing its outputs on, the commands run before
      the next) summed, over the model's predictions summed: what a served step costs for
      each second the profile predicts. A sum, not a mean of ratios: a request's TPOT is the
      mean cycle of the steps it rides, long and short alike."""
    if not steps:
        return {"n": 0}

    def model(worker: str) -> StepCost:
        return cfg.prefill_model if "-prefill-" in worker else cfg.decode_model

    pred = np.array([model(s["worker"]).predict(StepShape(tuple(map(tuple, s["chunks"])),
                                                          tuple(s["decode"])))
                     for s in steps])  # fmt: skip
    eng = np.array([s["step_s"] for s in steps])
    cycle = eng + np.array([s["out_s"] + s["gap_s"] for s in steps])
    return {
        "n": len(steps),
        "engine_mape": round(float(np.mean(np.abs(pred - eng) / eng)) * 100, 1),
        "engine_bias_pct": round(float(np.mean((eng - pred) / pred)) * 100, 1),
        "out_ms_mean": round(float(np.mean([s["out_s"] for s in steps])) * 1e3, 3),
        "gap_ms_mean": round(float(np.mean([s["gap_s"] for s in steps])) * 1e3, 3),
        "rows_mean": round(float(np.mean([s["rows"] for s in steps])), 2),
        "scale": round(float(cycle.sum() / pred.sum()), 4),
    }


def calibrate(profile: Profile, config: str, fit_runs: list[dict[str, Any]]) -> Overheads:
    """The served costs the engine's steps in isolation do not show, from the fit workload's
    quiet runs alone (every rate), fixed before any held-out run is scored:

    - how much slower a served step is than the profile's prediction, as a line in the
      output token rate the run offered (`step_scale + scale_per_token_s x tokens/s`): each
      run's `served_steps` scale, fitted on the runs' offered token rates (least squares,
      non-negative). On this host the router, Ray and the load generator run on the
      workers' cores and take more of them the more tokens stream;
    - the TTFT offset (`router_s`: the router, the hop to the worker, the first token out):
      the median of measured minus predicted TTFT at the lowest rate, where nothing queues.
    """
    base = sim_config(profile, CONFIGS[config])
    quiet = [r for r in fit_runs if not r["busy"] and r["served_steps"].get("n")] or fit_runs
    x = [[1.0, offered_token_rate(r["requests"])] for r in quiet]
    s0, s1 = fit_relative(x, [r["served_steps"].get("scale", 1.0) for r in quiet], relative=False)
    over = Overheads(step_scale=s0, scale_per_token_s=s1)
    low = min(quiet, key=lambda r: r["request_rate"])
    sim = simulate(replace(base, overheads=over), low["requests"], low["seed"])
    d = [m - o.ttft_s for m, o in zip(low["m_ttft"], sim, strict=True)
         if m is not None and o.ttft_s is not None]  # fmt: skip
    return replace(over, router_s=max(0.0, statistics.median(d)) if d else 0.0)


def err_pct(pred: float | None, meas: float | None) -> float | None:
    if pred is None or not meas:
        return None
    return round(abs(pred - meas) / meas * 100, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--profile",
        default=str(OUT / "profile.json"),
        help="profile to validate (made with `pdserve profile` when missing)",
    )
    p.add_argument(
        "--fractions",
        default="0.3,0.5,0.7,0.85,1.0,1.1",
        help="rates, as fractions of each configuration's predicted capacity",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument(
        "--min-requests",
        type=int,
        default=40,
        help="a run at a low rate lasts long enough for this many (up to 3 x --duration)",
    )
    p.add_argument("--workloads", default="chat,documents,agentic")
    p.add_argument("--configs", default="colocated,1P1D")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(OUT))
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep the runs already in OUT/runs (each trace, result and meta file) and run only "
        "the missing ones",
    )
    args = p.parse_args(argv)

    out = Path(args.out)
    run_dir = out / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    prof_path = Path(args.profile)
    if not prof_path.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "profile",
                "--model",
                args.model,
                "--dtype",
                args.dtype,
                "--out",
                str(prof_path),
            ],
            check=True,
        )
    profile = Profile.read(prof_path)
    big = profile.models[max(profile.models)]
    slos = {w: workload_slo(big, w, args.duration, args.seed) for w in args.workloads.split(",")}
    fractions = [float(f) for f in args.fractions.split(",")]
    workloads = args.workloads.split(",")
    configs = args.configs.split(",")
    if FIT_WORKLOAD not in workloads:
        raise SystemExit(f"the fit workload ({FIT_WORKLOAD}) must be among --workloads")
    from pdserve.models import resolve_model

    model_dir = str(resolve_model(args.model))
    runs: list[dict[str, Any]] = []
    total = len(configs) * len(workloads) * len(fractions)
    bar = tqdm(total=total, desc="bench-plan", file=sys.stderr)
    for config in configs:
        shape = CONFIGS[config]
        with contextlib.ExitStack() as stack:
            server: list[Server] = []  # started when a run of this configuration needs it

            steps_dir = run_dir / "steps" / config

            def target(
                config: str = config,
                stack: Any = stack,
                server: Any = server,
                logs: Path = steps_dir,
            ) -> str:
                if not server:
                    args_ = serve_args(config, model_dir, args.dtype, run_dir)
                    os.environ[STEP_LOG_ENV] = str(logs)  # the workers log their steps
                    server.append(stack.enter_context(Server(config, args_, run_dir, 300)))
                    warm = built_in("chat", 1.0, 4, seed=99)
                    dump(warm, run_dir / "warmup.jsonl")
                    replay(server[0].target, run_dir / "warmup.jsonl", run_dir / "warmup.json", 99)
                return str(server[0].target)

            for wi, workload in enumerate(workloads):
                probe = built_in(workload, 1.0, args.duration, args.seed)
                cap = capacity_rps(profile, probe, shape.cores)
                for fi, f in enumerate(fractions):
                    rate = round(f * cap, 4)
                    # A seed of its own per run: a server serves all of a configuration's
                    # runs, and a run with the seed of an earlier one sends the same prompts,
                    # which its prefix cache still holds (the simulator starts empty). The
                    # configurations share seeds: the same requests at the same rate.
                    seed = args.seed + 1 + wi * len(fractions) + fi
                    duration = min(3 * args.duration, max(args.duration, args.min_requests / rate))
                    name = f"{config}-{workload}-{f}"
                    trace, result = run_dir / f"{name}.jsonl", run_dir / f"{name}.json"
                    meta_path = run_dir / f"{name}.meta.json"
                    steps_path = run_dir / f"{name}.steps.json"
                    if args.reuse and trace.exists() and result.exists():
                        reqs = load_trace(trace)  # what was sent
                        res = json.loads(result.read_text())
                        # a run without its meta file: the load before it was not recorded
                        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
                        steps = json.loads(steps_path.read_text()) if steps_path.exists() else []
                        if (meta.get("seed"), meta.get("duration_s")) != (seed, round(duration, 1)):
                            raise SystemExit(f"--reuse: {meta_path} is of another design: rerun")
                    else:
                        reqs = built_in(workload, rate, duration, seed)
                        bar.set_postfix_str(f"{name} ({len(reqs)} req)")
                        dump(reqs, trace)
                        where = target()
                        time.sleep(3)  # the last run's streams end and its workers go quiet
                        meta = {"load_before": round(os.getloadavg()[0], 2),
                                "busy_cores_before": round(busy_cores(), 2),
                                "seed": seed, "duration_s": round(duration, 1)}  # fmt: skip
                        t0 = time.time()
                        res = replay(where, trace, result, seed)
                        meta["wall_s"] = round(time.time() - t0, 1)
                        meta_path.write_text(json.dumps(meta))
                        time.sleep(1.5)  # the workers' logs are flushed once they are idle
                        steps = read_steps(steps_dir, t0, time.time())
                        steps_path.write_text(json.dumps(steps))
                    other = meta.get("busy_cores_before")
                    measured = measured_outcomes(reqs, res)
                    runs.append(
                        {
                            "config": config,
                            "workload": workload,
                            "fraction": f,
                            "rate": rate,
                            "seed": seed,
                            "duration_s": round(duration, 1),
                            "capacity_rps": round(cap, 4),
                            "load_before": meta.get("load_before"),
                            "busy_cores_before": other,
                            "busy": other is not None and other > BUSY_CORES,
                            "wall_s": meta.get("wall_s"),
                            "measured": summary(measured, slos[workload]),
                            "served_steps": served_steps(sim_config(profile, shape), steps),
                            "steps": steps,
                            "m_ttft": [o.ttft_s for o in measured],
                            "reqs": str(trace),
                        }
                    )
                    bar.update()
    bar.close()

    # calibrate on the fit workload, then predict every run with the calibrated costs
    for r in runs:
        r["requests"] = load_trace(r["reqs"])  # exactly what was sent
        # the load as requests per second against the capacity estimate (requests per
        # second): an agentic session is several requests
        r["request_rate"] = round(len(r["requests"]) / r["duration_s"], 4)
        r["load"] = round(r["request_rate"] / r["capacity_rps"], 3)
        r["token_rate"] = round(offered_token_rate(r["requests"]), 1)
    overheads = {
        c: calibrate(
            profile,
            c,
            [r for r in runs if r["config"] == c and r["workload"] == FIT_WORKLOAD],
        )
        for c in configs
    }
    for r in runs:
        cfg = replace(sim_config(profile, CONFIGS[r["config"]]), overheads=overheads[r["config"]])
        r["predicted"] = summary(simulate(cfg, r["requests"], r["seed"]), slos[r["workload"]])
        m, pr = r["measured"], r["predicted"]
        r["errors_pct"] = {
            k: err_pct(pr[k], m[k])
            for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")
        }
        r["attainment_points"] = round((pr["attainment"] - m["attainment"]) * 100, 1)
        for k in ("m_ttft", "requests", "steps"):
            r.pop(k)

    goodputs: dict[str, dict[str, Any]] = {}
    for c in configs:
        for w in workloads:
            rs = sorted(
                (r for r in runs if r["config"] == c and r["workload"] == w and not r["busy"]),
                key=lambda r: r["request_rate"],
            )
            if not rs:
                goodputs[f"{c}/{w}"] = {"measured": {"rps": None, "note": "no quiet run"},
                                        "predicted": {"rps": None, "note": "-"},
                                        "error_pct": None}  # fmt: skip
                continue
            rates = [r["request_rate"] for r in rs]
            gm = goodput(rates, [r["measured"]["attainment"] for r in rs])
            gp = goodput(rates, [r["predicted"]["attainment"] for r in rs])
            goodputs[f"{c}/{w}"] = {
                "measured": gm,
                "predicted": gp,
                "error_pct": err_pct(gp["rps"], gm["rps"]),
            }
    best = {}
    for w in workloads:

        def rps(c: str, side: str, w: str = w) -> float:
            return goodputs[f"{c}/{w}"][side]["rps"] or 0.0

        best[w] = {
            "measured": max(configs, key=lambda c: rps(c, "measured")),
            "predicted": max(configs, key=lambda c: rps(c, "predicted")),
        }
    scores = {}
    for c in configs:
        for w in workloads:
            quiet = [r for r in runs if r["config"] == c and r["workload"] == w and not r["busy"]]
            low = [r for r in quiet if r["load"] < 0.85]
            high = [r for r in quiet if r["load"] >= 0.85]
            for band, rs in (("below 85% load", low), ("85% and above", high)):
                if not rs:
                    continue
                row: dict[str, Any] = {
                    "runs": len(rs),
                    "requests": sum(r["measured"]["n"] for r in rs),
                }
                for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms"):
                    errs = [r["errors_pct"][k] for r in rs if r["errors_pct"][k] is not None]
                    row[k] = round(float(np.mean(errs)), 1) if errs else None
                row["attainment_points_max"] = max(abs(r["attainment_points"]) for r in rs)
                scores[f"{c}/{w} {band}"] = row
    report = {
        "cpu": identity(),
        "model": args.model,
        "dtype": args.dtype,
        "profile": str(prof_path),
        "slo_ms": {
            w: {"ttft": round(t * 1e3, 1), "tpot": round(p * 1e3, 1)} for w, (t, p) in slos.items()
        },
        "fit_workload": FIT_WORKLOAD,
        "overheads": {c: o.__dict__ for c, o in overheads.items()},
        "lane_A": profile.errors["A_step_time"],
        "lane_B": lane_b(profile),
        "runs": runs,
        "scores": scores,
        "goodput": goodputs,
        "best": best,
    }
    (out / "validation.json").write_text(json.dumps(report, indent=1) + "\n")
    # the profile with what this run calibrated and measured: `pdserve plan --profile` on it
    # uses these served costs and prints lane C's errors beside its answer
    validated = json.loads(prof_path.read_text())
    kind = {"colocated": "colocated", "1P1D": "split"}
    validated["overheads"] = {kind[c]: o.__dict__ for c, o in overheads.items()}
    validated["validation"] = {
        "C": {
            "held_out_workloads": [w for w in workloads if w != FIT_WORKLOAD],
            "scores": scores,
            "goodput_error_pct": {k: g["error_pct"] for k, g in goodputs.items()},
            "report": str(out / "validation.json"),
        }
    }
    (out / "profile.validated.json").write_text(json.dumps(validated, indent=1) + "\n")
    print_report(report)
    plot(report, out / "validation.png")
    return 0


def lane_b(profile: Profile) -> dict[str, Any] | str:
    """The profile's held-out transfer errors and fitted costs, per transport."""
    transports = (profile.raw.get("transfer") or {}).get("transports") or {}
    return {
        name: {k: t["held_out"][k] for k in ("mape", "n", "max_ape", "noise_pct")}
        | {
            "alpha_ms": round(t["alpha_s"] * 1e3, 3),
            "beta_gb_s": round(t["beta_bytes_per_s"] / 1e9, 3),
        }
        for name, t in transports.items()
    } or "unvalidated"


def print_report(rep: dict[str, Any]) -> None:
    print(f"bench-plan: {rep['model']} {rep['dtype']} on {rep['cpu']}")
    print(f"SLO (ms): {rep['slo_ms']}; calibrated on {rep['fit_workload']}: {rep['overheads']}")
    print(f"lane A (held-out step shapes): {rep['lane_A']}")
    print(f"lane B (held-out transfer sizes, per transport): {rep.get('lane_B')}")
    head = (
        "config",
        "workload",
        "load",
        "req/s",
        "n",
        "busy cores",
        "TTFT50 m/p",
        "TTFT90 m/p",
        "TPOT50 m/p",
        "TPOT90 m/p",
        "attain m/p",
    )
    print(" | ".join(head))
    for r in rep["runs"]:
        m, p = r["measured"], r["predicted"]

        def mp(k: str, m: dict[str, Any] = m, p: dict[str, Any] = p) -> str:
            return f"{m[k]}/{p[k]}"

        print(
            " | ".join(
                str(x)
                for x in (
                    r["config"],
                    r["workload"] + ("" if r["workload"] != rep["fit_workload"] else " (fit)"),
                    r["load"],
                    r["request_rate"],
                    m["n"],
                    r["busy_cores_before"],
                    mp("ttft_p50_ms"),
                    mp("ttft_p90_ms"),
                    mp("tpot_p50_ms"),
                    mp("tpot_p90_ms"),
                    f"{m['attainment'] * 100:.0f}/{p['attainment'] * 100:.0f}",
                )
            )
        )
    print(
        "served steps against the profile's model: n steps, |error| % and bias % of the "
        "engine's step, served cycles over the model's predictions (scale):"
    )
    for r in rep["runs"]:
        sv = r.get("served_steps") or {}
        if sv.get("n"):
            print(
                f"  {r['config']} {r['workload']} load {r['load']}: n {sv['n']}, "
                f"|error| {sv['engine_mape']}%, bias {sv['engine_bias_pct']:+}%, "
                f"scale {sv['scale']} at {r['token_rate']} tokens/s "
                f"(rows {sv['rows_mean']}, out {sv['out_ms_mean']}, gap {sv['gap_ms_mean']})"
            )
    print("mean |error| % per quiet run (n = runs, requests), attainment max |points|:")
    for k, sc in rep["scores"].items():
        print(f"  {k}: {sc}")
    for k, g in rep["goodput"].items():
        print(
            f"goodput {k}: measured {g['measured']['note']}, predicted {g['predicted']['note']}"
            f" (error {g['error_pct']} %)"
        )
    for w, b in rep["best"].items():
        print(f"best for {w}: measured {b['measured']}, predicted {b['predicted']}")


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rep["runs"]})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        for i, c in enumerate(sorted({r["config"] for r in rep["runs"]})):
            rs = sorted(
                (r for r in rep["runs"] if r["workload"] == w and r["config"] == c),
                key=lambda r: r["request_rate"],
            )
            x = [r["request_rate"] for r in rs]
            ax.plot(
                x,
                [r["measured"]["attainment"] * 100 for r in rs],
                "-o",
                color=f"C{i}",
                label=f"{c} measured",
            )
            ax.plot(
                x,
                [r["predicted"]["attainment"] * 100 for r in rs],
                "--x",
                color=f"C{i}",
                label=f"{c} predicted",
            )
        ax.axhline(90, color="grey", lw=0.8)
        ax.set_title(w + (" (fit)" if w == rep["fit_workload"] else " (held out)"))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.legend(fontsize=7)
    fig.suptitle(f"pdserve plan vs real runs: {rep['cpu']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
