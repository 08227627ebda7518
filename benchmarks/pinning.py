#!/usr/bin/env python
"""Disaggregated on one host, pinned and not: each worker on its own core (`pool.cpu_affinity`)
against the OS's placement, A/B in one run.

Run: ``.venv/bin/python benchmarks/pinning.py`` (``make bench-pinning``). The setup is
`make bench-peers`' disaggregated one (the default model, float32, 1 prefill + 1 decode
worker), started twice per variant in the order A B A B so that drift on a noisy host hits
both: unpinned (one torch thread each, as today) and pinned (prefill on core 0, decode on
core 1, a thread per core). Each start runs `pdserve bench` (random 512 tokens in, 64 out,
EOS ignored) at concurrency 1 (8 prompts) and 4 (16 prompts). Reported per variant: TTFT
and TPOT p50 and p99 of each start, and the spread of TPOT p50 between its two starts (the
erratic mode the issue names: 204.6 ms in one round, 100.3 ms in the next).

Results: ``benchmarks/results/pinning-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PDSERVE_HOME", str(ROOT / ".venv" / "pdserve-home"))  # as the Makefile

from serving import Server, bench  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pdserve.models import DEFAULT_MODEL  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pinning-latest.json"
VARIANTS = {  # the pools' YAML of each variant
    "unpinned": "\n".join(
        f"{pool}:\n  num_cpus: 0.5\n  num_threads: 1" for pool in ("prefill", "decode")
    ),
    "pinned": "\n".join(
        f'{pool}:\n  num_cpus: 0.5\n  cpu_affinity: "{core}"'
        for pool, core in (("prefill", 0), ("decode", 1))
    ),
}
LOADS = {"c1": (1, 8), "c4": (4, 16)}  # concurrency, prompts


def _row(result: dict[str, Any]) -> dict[str, float]:
    return {
        k: round(float(result[k]), 1)
        for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    } | {"output_throughput": round(float(result["output_throughput"]), 1)}


def one_start(variant: str, round_: int, run_dir: Path, bar: tqdm) -> dict[str, Any]:
    pools = run_dir / f"pools-{variant}.yaml"
    pools.write_text(VARIANTS[variant])
    flags = ["--model", DEFAULT_MODEL, "--config", str(pools),
             "--prefill-workers", "1", "--decode-workers", "1"]  # fmt: skip
    out: dict[str, Any] = {}
    with Server(f"{variant}-{round_}", flags, run_dir, 300.0) as server:
        name = f"{variant}-{round_}"
        bench(server.target, run_dir, f"{name}-warmup", num_prompts=2, input_len=512,
              output_len=8, seed=7, max_concurrency=1)  # fmt: skip
        for load, (conc, n) in LOADS.items():
            res = bench(server.target, run_dir, f"{name}-{load}", num_prompts=n, input_len=512,
                        output_len=64, seed=11 + round_, max_concurrency=conc)  # fmt: skip
            out[load] = _row(res)
            bar.update()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    run_dir = ROOT / "build" / "pinning-runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    starts: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tqdm(total=args.rounds * len(VARIANTS) * len(LOADS), desc="pinning") as bar:
        for r in range(args.rounds):
            for variant in VARIANTS:  # A B A B
                starts[variant].append(one_start(variant, r, run_dir, bar))
    summary: dict[str, Any] = {}
    for variant, runs in starts.items():
        for load in LOADS:
            tpots = [run[load]["median_tpot_ms"] for run in runs]
            summary[f"{variant}/{load}"] = {
                "tpot_p50_by_start": tpots,
                "tpot_p50_spread": round(max(tpots) / min(tpots), 3),
                "ttft_p50_by_start": [run[load]["median_ttft_ms"] for run in runs],
                "tpot_p99_by_start": [run[load]["p99_tpot_ms"] for run in runs],
                "throughput_by_start": [run[load]["output_throughput"] for run in runs],
            }
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "starts": starts,
        "summary": summary,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
