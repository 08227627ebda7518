#!/usr/bin/env python
"""Where disaggregation wins on GPUs, predicted: DistServe's qualitative result from
`pdserve plan`'s simulator on device profiles extrapolated from H100 and H200 rooflines
(`pdserve.plan.device`; unmeasured, every assumption stated in the profile).

For each device, prompt length and TPOT bound, on one 8-device node (a larger machine is
copies of it, `pdserve plan --devices`), it finds each candidate's goodput: the highest rate
at which 90 % of requests meet TTFT and TPOT (bisection on the rate, the simulator run at
each), for colocated workers and for every P:D split. It reports per device the best
colocated and the best split goodput, their ratio, and the P:D the plan picks.

Workload per cell: Poisson arrivals, every prompt `L` tokens (nothing shared), 128 tokens
out; TTFT within max(250 ms, 4 uncached passes of `L` on one device).

Run: `.venv/bin/python benchmarks/plan_devices.py` (part of `make bench-plan`), a few
minutes; writes `benchmarks/results/plan/devices.json` and `devices.png`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this directory's engine.py would shadow the engine package
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pdserve.plan.device import DEVICES, device_profile  # noqa: E402
from pdserve.plan.plan import DEVICE_UNIT, Profile, candidates, point, sim_config  # noqa: E402
from pdserve.plan.sim import PoolShape, simulate  # noqa: E402
from pdserve.plan.stepmodel import StepShape  # noqa: E402
from pdserve.plan.workload import WorkloadRequest  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "plan"
PROMPTS = (512, 2048, 6144)
TPOT_MS = (25, 50, 100)
OUTPUT_TOKENS = 128
TARGET = 0.9
MIN_REQUESTS = 400
MIN_DURATION_S = 4.0


@dataclass(frozen=True)
class Cell:
    device: str
    profile_path: str
    prompt: int
    tpot_s: float
    ttft_s: float
    unit: int = DEVICE_UNIT
    seed: int = 0


def workload(prompt: int, rate: float, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, prompt])
    duration = max(MIN_DURATION_S, MIN_REQUESTS / rate)
    t, out = 0.0, list[WorkloadRequest]()
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration:
            return out
        out.append(WorkloadRequest(t, prompt, OUTPUT_TOKENS))


def attainment(profile: Profile, shape: PoolShape, cell: Cell, rate: float) -> float:
    reqs = workload(cell.prompt, rate, cell.seed)
    out = simulate(sim_config(profile, shape), reqs, cell.seed)
    return point(rate, out, cell.ttft_s, cell.tpot_s).attainment


def goodput(profile: Profile, shape: PoolShape, cell: Cell, start: float) -> float:
    """The highest rate with attainment >= 90 %, to 1/16 of the bracket: doubling from
    `start` until it fails, then bisection."""
    lo, hi = 0.0, start
    for _ in range(6):
        if attainment(profile, shape, cell, hi) < TARGET:
            break
        lo, hi = hi, hi * 2
    else:
        return lo
    for _ in range(4):
        mid = (lo + hi) / 2
        if attainment(profile, shape, cell, mid) >= TARGET:
            lo = mid
        else:
            hi = mid
    return lo


def run_cell(cell: Cell) -> dict[str, Any]:
    profile = Profile.read(cell.profile_path)
    model = profile.models[1]
    # a start near the node's decode throughput at a full batch
    step = model.predict(StepShape((), (cell.prompt + OUTPUT_TOKENS // 2,) * 128))
    start = cell.unit * 128 / (step * OUTPUT_TOKENS) / 4
    rows: list[dict[str, Any]] = []
    for shape in candidates([1], cell.unit, (8192,)):
        rows.append({"shape": shape.label, "colocated": bool(shape.colocated),
                     "prefill": shape.prefill, "decode": shape.decode,
                     "goodput_rps": round(goodput(profile, shape, cell, start), 3)})  # fmt: skip
    colo = max((r for r in rows if r["colocated"]), key=lambda r: r["goodput_rps"])
    split = max((r for r in rows if not r["colocated"]), key=lambda r: r["goodput_rps"])
    return {
        "device": cell.device,
        "prompt": cell.prompt,
        "tpot_ms": round(cell.tpot_s * 1e3),
        "ttft_ms": round(cell.ttft_s * 1e3),
        "unit_devices": cell.unit,
        "colocated_rps_per_device": round(colo["goodput_rps"] / cell.unit, 3),
        "split_rps_per_device": round(split["goodput_rps"] / cell.unit, 3),
        "split_over_colocated": round(split["goodput_rps"] / colo["goodput_rps"], 2)
        if colo["goodput_rps"]
        else None,
        "best_split": f"{split['prefill']}P:{split['decode']}D",
        "candidates": rows,
    }


def plot(cells: list[dict[str, Any]], path: Path, prompts: list[int], tpots: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = sorted({c["device"] for c in cells})
    fig, axes = plt.subplots(1, len(devices), figsize=(5.2 * len(devices), 4.2), squeeze=False)
    for ax, dev in zip(axes[0], devices, strict=True):
        grid = np.full((len(tpots), len(prompts)), np.nan)
        for c in cells:
            if c["device"] == dev and c["split_over_colocated"] is not None:
                grid[tpots.index(c["tpot_ms"]), prompts.index(c["prompt"])] = c[
                    "split_over_colocated"
                ]
        im = ax.imshow(grid, cmap="RdBu", vmin=0, vmax=2, origin="lower")
        for c in cells:
            if c["device"] == dev:
                i, j = tpots.index(c["tpot_ms"]), prompts.index(c["prompt"])
                ax.text(j, i, f"{c['split_over_colocated']}x\n{c['best_split']}", ha="center",
                        va="center", fontsize=8)  # fmt: skip
        ax.set_xticks(range(len(prompts)), [str(p) for p in prompts])
        ax.set_yticks(range(len(tpots)), [f"{t} ms" for t in tpots])
        ax.set_xlabel("prompt tokens (128 out)")
        ax.set_ylabel("TPOT bound")
        ax.set_title(f"{DEVICES[dev].name}: split / colocated goodput", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(
        f"predicted from published rooflines (unmeasured), llama-3-8b, "
        f"{cells[0]['unit_devices']} devices",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", default=",".join(DEVICES))
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt lengths")
    p.add_argument("--tpot-ms", default=",".join(map(str, TPOT_MS)), help="TPOT bounds (ms)")
    p.add_argument(
        "--unit", type=int, default=DEVICE_UNIT, help="devices in the node planned (8: one node)"
    )
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-devices-"))
    prompts = [int(x) for x in args.prompts.split(",")]
    tpots = [int(x) for x in args.tpot_ms.split(",")]
    cells = []
    for dev in args.devices.split(","):
        path = tmp / f"{dev}.json"
        path.write_text(json.dumps(device_profile(dev, args.model)))
        one = Profile.read(path).models[1]
        for prompt in prompts:
            ttft = max(0.25, 4 * one.predict(StepShape(((prompt, 0),))))
            cells += [Cell(dev, str(path), prompt, t / 1e3, ttft, args.unit) for t in tpots]
    with ProcessPoolExecutor(args.jobs) as ex:
        results = list(tqdm(ex.map(run_cell, cells), total=len(cells), desc="cells"))
    doc = {
        "model": args.model,
        "unit_devices": args.unit,
        "output_tokens": OUTPUT_TOKENS,
        "measured": False,
        "assumptions": json.loads((tmp / f"{cells[0].device}.json").read_text())["assumptions"],
        "cells": results,
    }
    (out / "devices.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, out / "devices.png", prompts, tpots)
    print("device | prompt | TPOT ms | TTFT ms | colocated req/s/dev | split req/s/dev | "
          "split/colocated | best split")  # fmt: skip
    for c in results:
        print(f"{c['device']} | {c['prompt']} | {c['tpot_ms']} | {c['ttft_ms']} | "
              f"{c['colocated_rps_per_device']} | {c['split_rps_per_device']} | "
              f"{c['split_over_colocated']} | {c['best_split']}")  # fmt: skip
    print(f"wrote {out / 'devices.json'} and {out / 'devices.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
