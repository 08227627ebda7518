"""The goodput sweep of `make bench-peers`: requests per second at an SLO, DistServe's measure.

Every server (vLLM, pdserve colocated, pdserve disaggregated) in turn, alone on the machine,
takes the same Poisson arrivals (`vllm bench serve --request-rate R`, burstiness 1, fixed
seed) at a grid of rates, on prompts of mixed length: uniform between `lo` and `hi` tokens
(64-2048 by default: short chat turns and long documents), 64 tokens out, EOS ignored.
`vllm bench serve --goodput ttft:<ms> tpot:<ms>` counts the requests that met both bounds;
attainment at a rate is that count over the requests sent (a failed request misses).

The SLOs are scaled to the machine, from this run's own engine-alone figures in the same
dtype (a 512-token prompt's TTFT and the decode step, `peers.engine_alone`):

* TTFT <= `ttft_x` x the 512-token TTFT (a 2048-token prompt alone takes about 4-5x it, so
  the bound leaves room for some queueing, not for a prompt waiting behind several others);
* TPOT <= `tpot_x` x the engine's decode step: **TPOT-tight**, what a streaming chat user
  feels, and what a prompt pass stalling the running streams breaks.

The rates are fractions (0.15 to 1.4) of a capacity estimate from the same run: the c=8
request rate of the 512/64 workload (vLLM's, else the first server's), scaled by tokens per
request. The goodput of a server is the highest rate with at least 90 % attainment (the
first downward crossing, interpolated: `serving.goodput`). Once a server's attainment falls
under 50 %, its higher rates are not run (recorded as 0: attainment only falls with the
rate).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.plan.attainment import goodput

TARGET = 0.9
GIVE_UP_BELOW = 0.5
FRACTIONS = (0.15, 0.3, 0.5, 0.75, 1.0, 1.4)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput sweep")
    g.add_argument(
        "--goodput-servers",
        type=lambda s: s.split(",") if s else [],
        default=None,
        help="servers swept (default: the --servers of the tables); '' skips it",
    )
    g.add_argument("--goodput-lens", default="64-2048", help="prompt tokens, uniform lo-hi")
    g.add_argument("--goodput-output-len", type=int, default=64, help="tokens out per request")
    g.add_argument("--goodput-prompts", type=int, default=24, help="requests per rate")
    g.add_argument(
        "--goodput-rates",
        default="",
        help="comma-separated req/s (default: fractions of the run's capacity)",
    )
    g.add_argument(
        "--ttft-slo-x", type=float, default=10.0, help="TTFT SLO in engine-alone 512-token TTFTs"
    )
    g.add_argument("--tpot-slo-x", type=float, default=2.5,
                   help="TPOT SLO in engine-alone decode steps")  # fmt: skip


def lens(args: argparse.Namespace) -> tuple[int, int]:
    lo, hi = (int(x) for x in args.goodput_lens.split("-"))
    return lo, hi


def dataset_flags(args: argparse.Namespace) -> list[str]:
    """vLLM's random dataset draws input lengths uniformly from [n(1-r), n(1+r)]."""
    lo, hi = lens(args)
    mid, ratio = (lo + hi) / 2, (hi - lo) / (hi + lo)
    spread = json.dumps({"input": round(ratio, 6), "output": 0.0})
    return ["--dataset-name", "random", "--random-input-len", str(round(mid)),
            "--random-output-len", str(args.goodput_output_len),
            "--random-range-ratio", spread]  # fmt: skip


def slos(engine: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    return {
        "ttft_ms": round(args.ttft_slo_x * engine["ttft_ms"], 1),
        "tpot_ms": round(args.tpot_slo_x * engine["tpot_ms"], 1),
        "ttft_x": args.ttft_slo_x,
        "tpot_x": args.tpot_slo_x,
    }


def rates(section: dict[str, Any], args: argparse.Namespace) -> tuple[list[float], str]:
    """The sweep's rates and where they came from."""
    if args.goodput_rates:
        return [float(r) for r in args.goodput_rates.split(",")], "given"
    servers = section["servers"]
    base = "vllm" if "vllm" in servers else next(iter(servers))
    c8 = servers[base]["workloads"].get("c8", {})
    rps = c8.get("request_throughput")
    if not rps:
        raise SystemExit("peers: --goodput-rates is needed when the c8 workload is not run")
    lo, hi = lens(args)
    capacity = rps * (512 + 64) / ((lo + hi) / 2 + args.goodput_output_len)
    how = f"fractions {FRACTIONS} of {capacity:.3g} req/s ({base}'s c=8 rate, token-scaled)"
    return [round(f * capacity, 3) for f in FRACTIONS], how


def sweep(
    kinds: list[str],
    start: Callable[[str], AbstractContextManager[Any]],
    bench: Callable[[Any, list[str], str, int, int], dict[str, Any]],
    rate_grid: list[float],
    slo: dict[str, float],
    args: argparse.Namespace,
    bar: tqdm,
) -> dict[str, Any]:
    """Each server up in turn; a discarded warm-up, then each rate. `start(kind)` gives a
    running server; `bench(server, extra_flags, tag, num_prompts, seed)` runs `vllm bench
    serve` on the dataset with extra flags and returns its JSON.

    Every rate draws fresh prompts (its own seed; the warm-up another): a prompt seen before
    would be a prefix-cache hit, and a server with a bigger cache would look faster for it.
    Every server gets the same seed at the same rate: the same prompts at the same times."""
    goodput_flags = ["--goodput", f"ttft:{slo['ttft_ms']}", f"tpot:{slo['tpot_ms']}"]
    out: dict[str, Any] = {}
    for kind in kinds:
        points: list[dict[str, Any]] = []
        with start(kind) as srv:
            bar.set_postfix_str(f"goodput: {kind} warm-up")
            # Eight of the sweep's own prompts at once: long ones included (a server's first
            # 2048-token prompt may compile or grow buffers; that is no rate's business).
            warm = ["--request-rate", "inf", *goodput_flags]
            bench(srv, warm, f"{kind}-goodput-warmup", 8, args.seed + 1000)
            for k, rate in enumerate(rate_grid):
                bar.set_postfix_str(f"goodput: {kind} at {rate:g} req/s")
                if points and points[-1]["attainment"] < GIVE_UP_BELOW:
                    points.append({"rate": rate, "attainment": 0.0, "skipped": True})
                else:
                    res = bench(srv, ["--request-rate", str(rate), "--burstiness", "1",
                                      *goodput_flags], f"{kind}-goodput-{rate:g}",
                                args.goodput_prompts, args.seed + 1 + k)  # fmt: skip
                    points.append(point(rate, res, args.goodput_prompts))
                bar.update()
        attained = [p["attainment"] for p in points]
        out[kind] = {"points": points, "goodput": goodput(rate_grid, attained, TARGET)}
    return out


def point(rate: float, res: dict[str, Any], sent: int) -> dict[str, Any]:
    good = round((res.get("request_goodput") or 0.0) * res["duration"])
    return {
        "rate": rate,
        "attainment": good / sent,
        "completed": res.get("completed"),
        "achieved_rps": res.get("request_throughput"),
        "ttft_p50_ms": res.get("median_ttft_ms"),
        "ttft_p99_ms": res.get("p99_ttft_ms"),
        "tpot_p50_ms": res.get("median_tpot_ms"),
        "tpot_p99_ms": res.get("p99_tpot_ms"),
    }


def targets(g: dict[str, Any]) -> list[dict[str, Any]]:
    """Disaggregated goodput against colocated pdserve's and vLLM's (>= 1 each)."""
    res = g["servers"]
    dis = res.get("pdserve-disaggregated", {}).get("goodput", {})
    out = []
    for other in ("pdserve-colocated", "vllm"):
        ref = res.get(other, {}).get("goodput", {})
        value = None
        if dis.get("rps") is not None and ref.get("rps"):
            value = dis["rps"] / ref["rps"]
        # A bound, not a value, when a side never crossed 90 % inside the sweep.
        exact = dis.get("bound") == "interpolated" and ref.get("bound") == "interpolated"
        met = None if value is None else value >= 1.0
        out.append({"target": f"disaggregated goodput (TPOT-tight SLO) / {other}",
                    "value": value, "bound": ">= 1.0", "met": met,
                    "exact": exact, "note": f"{dis.get('note')} vs {ref.get('note')}"})  # fmt: skip
    return out


def table_text(g: dict[str, Any]) -> str:
    s = g["slo"]
    lines = [
        f"Goodput ({g['dtype']}): Poisson arrivals, prompts uniform in {g['lens']} tokens, "
        f"{g['output_len']} out, {g['prompts']} requests per rate; SLO TTFT <= "
        f"{s['ttft_ms']:.0f} ms ({s['ttft_x']:g}x the engine's 512-token TTFT) and TPOT <= "
        f"{s['tpot_ms']:.1f} ms ({s['tpot_x']:g}x its decode step); rates: {g['rates_from']}.",
        "",
        "| server | " + " | ".join(f"{r:g} req/s" for r in g["rates"]) + " | goodput (>= 90 %) |",
        "|---|" + "---|" * (len(g["rates"]) + 1),
    ]
    for kind, run in g["servers"].items():
        cells = [
            "-"
            if p.get("skipped")
            else f"{100 * p['attainment']:.0f} % (TPOT p99 {p['tpot_p99_ms']:.0f})"
            for p in run["points"]
        ]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {run['goodput']['note']} |")
    return "\n".join(lines)


def plot(g: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, run in g["servers"].items():
        pts = run["points"]
        ax.plot([p["rate"] for p in pts], [100 * p["attainment"] for p in pts], "o-", label=kind)
    ax.axhline(100 * TARGET, color="k", lw=1, ls="--", label="90 % (goodput)")
    s = g["slo"]
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_ylim(-5, 105)
    ax.set_title(f"SLO attainment, {g['dtype']}: TTFT <= {s['ttft_ms']:.0f} ms, "
                 f"TPOT <= {s['tpot_ms']:.0f} ms", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
