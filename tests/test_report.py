"""benchmarks/report.py: the headline rows come from the ratios the targets are about.

The KV-transfer JSON compares `torch_dist` with two ceilings (one contiguous gloo send, and
the same bytes split into the transfer's messages). The headline must show the first, at
every size: it once showed the second at the largest size only, hiding an 8 MiB miss.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _load_bench(name: str) -> Any:
    """benchmarks/<name>.py by path: putting benchmarks/ on sys.path would let its engine.py
    shadow the engine package for every later import in this pytest process."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"benchmarks/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load_bench("report")


def _ratio(transport: str, ceiling: str, size: int, value: float) -> dict[str, Any]:
    return {
        "transport": transport,
        "ceiling": ceiling,
        "size_mib": size,
        "ratio_median": value,
        "ratio_best": value,
        "target": None,
        "pass": None,
    }


def test_kv_headline_uses_the_targeted_ceiling_at_every_size() -> None:
    ratios = []
    for size, full, split in ((8, 0.62, 0.89), (64, 1.39, 0.86), (512, 1.03, 0.86)):
        ratios.append(_ratio("torch_dist", "raw gloo", size, full))
        ratios.append(_ratio("torch_dist", "raw gloo, 64 msgs", size, split))
        ratios.append(_ratio("raw gloo, 64 msgs", "raw gloo", size, full / split))
        ratios.append(_ratio("grpc", "raw gRPC", size, 0.7))
    data = {"ratios": ratios, "targets": {"torch_dist_over_raw_gloo": 0.8}}
    _, rows = report.kv_section(data)
    by_name = {r[0]: r for r in rows}
    gloo = by_name["KV transfer torch_dist vs raw gloo (8 / 64 / 512 MiB)"]
    assert gloo[1] == "0.62 / 1.39 / 1.03"
    assert gloo[3] == ">= 0.8"
    assert by_name["KV transfer grpc vs raw gRPC (8 / 64 / 512 MiB)"][1] == "0.70 / 0.70 / 0.70"
    assert not any("64 msgs" in r[0] for r in rows)


def test_report_leaves_benchmarks_off_sys_path() -> None:
    """benchmarks/engine.py must never shadow the engine package: not after report.py is
    imported, and not after it borrowed serving.py's goodput helper (spawned worker
    processes inherit sys.path, and once failed to import engine.config because of it)."""
    bench_dir = str(ROOT / "benchmarks")
    assert bench_dir not in sys.path
    ratio = report._goodput_ratio()
    assert callable(ratio)
    assert bench_dir not in sys.path
    import engine

    assert hasattr(engine, "__path__"), engine  # the package, not benchmarks/engine.py


def _load_prefix_bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "bench_prefix_cache", ROOT / "benchmarks/prefix_cache.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefix_breakdown_splits_a_profiled_step_into_matmuls_attention_and_the_rest() -> None:
    """The breakdown the prefix benchmark prints: matmul and attention kernels' self time,
    the rest of the wall time, and warm / cold of matmuls plus attention alone."""
    import torch
    import torch.nn.functional as F

    bench = _load_prefix_bench()
    a = torch.randn(256, 256)
    q = torch.randn(1, 4, 64, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.mm(a, a)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        a.add(1)
    parts = bench.step_parts(prof, 10.0)  # a 10 s "step": the rest is nearly all of it
    assert parts["matmul_ms"] > 0 and parts["attention_ms"] > 0
    assert parts["total_ms"] == 10_000.0
    assert parts["rest_ms"] == 10_000.0 - parts["matmul_ms"] - parts["attention_ms"]

    def p(mm: float, att: float, total: float) -> dict[str, float]:
        return {"matmul_ms": mm, "attention_ms": att, "rest_ms": total - mm - att,
                "total_ms": total}  # fmt: skip

    b = bench.breakdown({
        "cold": [p(400, 200, 800), p(500, 300, 1000), p(420, 240, 820)],
        "warm": [p(50, 40, 110), p(40, 50, 100), p(45, 45, 130)],
    })  # fmt: skip
    assert b["cold"]["matmul_ms"] == 420 and b["warm"]["attention_ms"] == 45  # medians
    assert b["kernels_ratio"] == (45 + 45) / (420 + 240)
    assert b["warm_over_cold"]["total_ms"] == 110 / 820
    assert b["n"] == 3


def test_peer_ratios_and_targets_divide_pdserve_by_vllm() -> None:
    """Each ratio is pdserve's figure over vLLM's for the same workload; a missing server
    or workload gives no ratio (n/a), never a made-up one; the report shows the targets."""
    peers = _load_bench("peers")

    def wl(tok_s: float, ttft: float, tpot: float) -> dict[str, float]:
        return {"output_throughput": tok_s, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
                "median_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot}  # fmt: skip

    data: dict[str, Any] = {
        "workloads": {"c1": {}, "c8": {}},
        "engine_alone": {"tpot_ms": 20.0, "ttft_ms": 300.0, "threads": 2},
        "servers": {
            "vllm": {"workloads": {"c1": wl(40, 300, 22), "c8": wl(120, 1200, 44)}},
            "pdserve-colocated": {"workloads": {"c1": wl(36, 330, 25), "c8": wl(150, 1100, 40)}},
        },
    }
    rows = {(r["workload"], r["metric"]): r for r in peers.ratios(data)}
    assert rows[("c8", "output tok/s")]["pdserve-colocated/vllm"] == 150 / 120
    assert rows[("c1", "TPOT p50 ms")]["pdserve-colocated/vllm"] == 25 / 22
    targets = {t["target"]: t for t in peers.targets(data)}
    assert targets["colocated c=8 output tok/s / vLLM"]["met"] is True  # 1.25x >= 1.2x
    assert targets["colocated c=1 TPOT p50 / vLLM"]["met"] is False
    assert targets["colocated c=1 TPOT p50 / engine alone"]["value"] == 25 / 20
    assert targets["disaggregated c=8 output tok/s / vLLM"]["value"] is None  # not run
    data["ratios"], data["targets"] = peers.ratios(data), peers.targets(data)
    data["table_md"] = peers.table_text(data)
    body, headline = report.peers_section(data)
    assert "| c8 | output tok/s | 120.0 | 150.0 | 1.25x |" in body
    assert headline[0][:2] == ("colocated c=8 output tok/s / vLLM", "1.25x")


def test_goodput_sweep_targets_table_and_report() -> None:
    """The goodput sweep's pieces: the random dataset spans the asked prompt lengths, SLOs
    scale with the engine-alone figures, goodput is the interpolated 90 % crossing, the
    disaggregated/other ratio is a value only when both crossed inside the sweep, and the
    report lists every dtype's targets and the sweep's."""
    import argparse

    peers = _load_bench("peers")
    good = sys.modules["peers_goodput"]
    args = argparse.Namespace(goodput_lens="64-2048", goodput_output_len=64, goodput_rates="",
                              ttft_slo_x=10.0, tpot_slo_x=2.5)  # fmt: skip
    flags = good.dataset_flags(args)
    n = int(flags[flags.index("--random-input-len") + 1])
    r = __import__("json").loads(flags[flags.index("--random-range-ratio") + 1])["input"]
    assert (round(n * (1 - r)), round(n * (1 + r))) == (64, 2048)
    assert good.slos({"ttft_ms": 200.0, "tpot_ms": 20.0}, args)["tpot_ms"] == 50.0
    section = {"servers": {"vllm": {"workloads": {"c8": {"request_throughput": 2.0}}}}}
    rates, _ = good.rates(section, args)
    assert rates == [round(f * 2.0 * 576 / 1120, 3) for f in good.FRACTIONS]

    def run(att: list[float]) -> dict[str, Any]:
        pts = [
            {"rate": x, "attainment": a, "tpot_p99_ms": 40.0}
            for x, a in zip(rates, att, strict=True)
        ]
        return {"points": pts, "goodput": peers_goodput_of(good, rates, att)}

    assert len(rates) == 6
    servers = {
        "vllm": run([1.0, 1.0, 1.0, 0.95, 0.5, 0.2]),
        "pdserve-colocated": run([1.0, 0.8, 0.4, 0.1, 0.0, 0.0]),
        "pdserve-disaggregated": run([1.0, 1.0, 1.0, 1.0, 0.95, 0.92]),
    }
    g = {"dtype": "bfloat16", "slo": good.slos({"ttft_ms": 200.0, "tpot_ms": 20.0}, args),
         "rates": rates, "rates_from": "test", "lens": "64-2048", "output_len": 64,
         "prompts": 24, "servers": servers}  # fmt: skip
    g["targets"] = good.targets(g)
    by = {t["target"].rsplit("/ ", 1)[1]: t for t in g["targets"]}
    assert by["vllm"]["value"] is not None and by["vllm"]["exact"] is False  # disagg never fell
    assert by["vllm"]["met"] is True
    assert by["pdserve-colocated"]["value"] == rates[-1] / g["servers"]["pdserve-colocated"][
        "goodput"]["rps"]  # fmt: skip
    text = good.table_text(g)
    assert "| pdserve-colocated | 100 % (TPOT p99 40) | 80 % (TPOT p99 40) |" in text
    data = {"dtypes": {"bfloat16": {"targets": [{"target": "t1", "value": 1.2, "bound": ">= 1.0",
                                                   "met": True}]}},
            "goodput": g, "table_md": "T"}  # fmt: skip
    body, rows = report.peers_section(data)
    assert body == "T" and rows[0][:2] == ("bfloat16: t1", "1.20x")
    assert [row[0] for row in rows[1:]] == [t["target"] for t in g["targets"]]
    assert peers.DEFAULT_SERVERS == ("vllm", "pdserve-colocated", "pdserve-disaggregated")


def peers_goodput_of(good: Any, rates: list[float], att: list[float]) -> dict[str, Any]:
    result: dict[str, Any] = good.goodput(rates, att, good.TARGET)
    return result
