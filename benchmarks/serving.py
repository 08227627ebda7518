#!/usr/bin/env python
"""Serving benchmark: disaggregated vs colocated on the same cores, and the router's overhead.

Run: ``.venv/bin/python benchmarks/serving.py`` (``make bench-serving``). One run does:

1. **SLO attainment vs request rate.** A chat-like workload (``pdserve bench --dataset-name
   random``: 512-token prompts, 64 output tokens, EOS ignored, greedy) on the ``small`` preset
   (~110M Llama, bf16) against two deployments of ``pdserve serve`` that use the same cores:

   * *disaggregated*: 1 prefill + 1 decode worker (``--prefill-workers 1 --decode-workers 1``);
   * *colocated*: 2 workers that each run both phases (``--colocated --decode-workers 2``).

   Every worker is a Ray actor with ``num_threads: 1`` (one torch thread) and ``num_cpus: 0.5``
   (set in a ``--config`` YAML written next to the results), so both modes run two
   single-threaded model workers, plus the router and the load generator, on the same cores.

   Each mode is first *calibrated*: a warm-up burst (discarded), then requests one at a time
   (``--max-concurrency 1``); the medians are the unloaded TTFT and TPOT. The SLOs are
   ``--slo-scale`` (3) times the lower of the two modes' unloaded medians (or ``--ttft-slo-ms``
   / ``--tpot-slo-ms``). The request rates are fractions of the disaggregated prefill worker's
   unloaded capacity (1000 / its server-reported ``prefill_ms``), the same rates for both
   modes; at each rate ``pdserve bench`` sends ``--num-prompts`` Poisson arrivals with the same
   seed, so both modes see the same prompts at the same times. Attainment is the fraction of
   the requests that met *both* SLOs (a failed request meets none), computed per request from
   the bench JSON (``ttfts``; TPOT = sum(``itls``) / (output tokens - 1)). Goodput, in
   DistServe's sense, is the highest rate at which >= 90 % of the requests meet both SLOs,
   interpolated linearly between the sweep points (a lower bound when the last point still
   attains 90 %).

2. **Router overhead.** The ``tiny`` preset (``--prefill-workers 1 --decode-workers 1``), 128
   token prompts, ``max_tokens=1``: one at a time, per request, the client's end-to-end latency
   minus the server-reported ``prefill_ms`` (what the router, gRPC, Ray, the decode reservation
   and the KV hand-over add to the engine's time); then the request rate at concurrency 8. Side
   by side in the same run: the engine in this process (``LLMEngine``, one torch thread) on
   the same prompts, one at a time and in batches of 8 (its best rate of the two is the
   ceiling the service's rate is divided by).

Results: ``benchmarks/results/serving-latest.json``, ``serving-latest.png`` (attainment vs
rate, both modes) and ``serving-latency-latest.png`` (TTFT and TPOT p50/p99 vs rate). The raw
``pdserve bench`` JSONs and the server logs go to ``build/serving-runs/`` (git-ignored); the
result JSON keeps every request's TTFT and TPOT, so attainment can be recomputed from it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PDSERVE_HOME", str(ROOT / ".venv" / "pdserve-home"))  # as the Makefile

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pdserve.models import BENCH_MODEL_HELP, resolve_model  # noqa: E402
from pdserve.plan.attainment import goodput  # noqa: E402
from pdserve.tools.procs import stop_process_group  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
ATTAINMENT_TARGET = 0.9  # DistServe: goodput = the highest rate with >= 90 % attainment
MODES: dict[str, list[str]] = {
    "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1"],
    "colocated": ["--colocated", "--decode-workers", "2"],
}
POOL_YAML = """\
# Both modes: two single-threaded model workers on the same cores (written by serving.py).
prefill:
  num_cpus: 0.5
  num_threads: 1
decode:
  num_cpus: 0.5
  num_threads: 1
"""
_LISTENING = re.compile(r"^pdserve: gRPC listening on (.+):(\d+)$")


# ---- the server ------------------------------------------------------------------------------
class Server:
    """`pdserve serve --grpc-port 0 --no-http ...` as a subprocess; SIGTERM (drain) to stop."""

    def __init__(self, name: str, args: list[str], log_dir: Path, start_timeout_s: float) -> None:
        self.name, self.args, self.log_dir = name, args, log_dir
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.target = ""
        self.start_s = 0.0

    def __enter__(self) -> Server:
        t0 = time.perf_counter()
        for attempt in range(2):  # a loaded host can time Ray's start-up out: retry once
            if self._start(attempt):
                self.start_s = time.perf_counter() - t0
                return self
            self.stop()
        raise RuntimeError(f"pdserve serve ({self.name}) did not start; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, attempt: int) -> bool:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PDSERVE_API_KEY")}
        env.update(PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        self.log_path = self.log_dir / f"serve-{self.name}-{attempt}.log"
        # O_APPEND: the server's stderr and the stdout lines copied below share the file.
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--grpc-port", "0", "--no-http"]
        self.proc = subprocess.Popen(
            cmd + self.args,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,  # its own process group: a hung server is killed whole
        )
        found = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self._log.write(line)
                self._log.flush()
                m = _LISTENING.match(line.strip())
                if m:
                    self.target = f"{m.group(1)}:{m.group(2)}"
                    found.set()
            found.set()  # exited

        threading.Thread(target=pump, daemon=True).start()
        found.wait(self.start_timeout_s)
        return bool(self.target) and self.proc.poll() is None

    def stop(self, timeout_s: float = 90.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stop_process_group(proc, timeout_s)  # SIGTERM drains; the group is killed if it hangs
        with contextlib.suppress(Exception):
            self._log.close()


def write_pool_config(run_dir: Path, transfer_timeout_s: float | None = None) -> Path:
    path = run_dir / "pools.yaml"
    text = POOL_YAML
    if transfer_timeout_s is not None:
        text += f"transfer:\n  timeout_s: {transfer_timeout_s}\n"
    path.write_text(text)
    return path


# ---- pdserve bench ---------------------------------------------------------------------------
def bench(
    target: str,
    run_dir: Path,
    name: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    rate: float = math.inf,
    max_concurrency: int | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """One `pdserve bench` run (a subprocess, as a user would run it); its result JSON."""
    out = run_dir / f"{name}.json"
    cmd = [
        sys.executable, "-m", "pdserve.cli", "bench",
        "--target", target,
        "--dataset-name", "random",
        "--random-input-len", str(input_len),
        "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts),
        "--seed", str(seed),
        "--request-rate", str(rate),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--request-id-prefix", f"{name}-",
        "--save-result", "--result-dir", str(run_dir), "--result-filename", out.name,
        "--disable-tqdm",
    ]  # fmt: skip
    if max_concurrency is not None:
        cmd += ["--max-concurrency", str(max_concurrency)]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    with open(run_dir / f"{name}.log", "w") as log:
        rc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
        ).returncode
    if rc != 0 or not out.exists():
        raise RuntimeError(f"pdserve bench {name} exited {rc}; see {run_dir / (name + '.log')}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def per_request(result: dict[str, Any]) -> dict[str, list[Any]]:
    """Per request: ok, TTFT ms, TPOT ms (sum of ITLs / (output tokens - 1)), max ITL ms."""
    ok, ttft, tpot, max_itl = [], [], [], []
    for err, t, itls, n in zip(
        result["errors"], result["ttfts"], result["itls"], result["output_lens"], strict=True
    ):
        good = not err and n > 0
        ok.append(good)
        ttft.append(t * 1e3 if good else math.nan)
        tpot.append((sum(itls) / (n - 1) * 1e3 if n > 1 else 0.0) if good else math.nan)
        max_itl.append(max(itls) * 1e3 if good and itls else math.nan)
    return {"ok": ok, "ttft_ms": ttft, "tpot_ms": tpot, "max_itl_ms": max_itl}


def top_errors(errors: list[str], n: int = 3) -> list[tuple[str, int]]:
    """The commonest error messages, ids and addresses masked so alike errors count together."""
    masked = (
        re.sub(r"[0-9a-f]{32}|\d+(\.\d+){3}:\d+|rate[\d.]+-\d+", "*", e)[:200] for e in errors if e
    )
    return Counter(masked).most_common(n)


def pct(values: list[float], q: float) -> float | None:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else None


def attainment(req: dict[str, list[Any]], ttft_slo: float, tpot_slo: float) -> dict[str, float]:
    n = len(req["ok"])
    rows = list(zip(req["ok"], req["ttft_ms"], req["tpot_ms"], strict=True))
    ttft_ok = [ok and t <= ttft_slo for ok, t, _ in rows]
    tpot_ok = [ok and p <= tpot_slo for ok, _, p in rows]
    both = [a and b for a, b in zip(ttft_ok, tpot_ok, strict=True)]
    return {"both": sum(both) / n, "ttft": sum(ttft_ok) / n, "tpot": sum(tpot_ok) / n}


def goodput_ratio(
    d: dict[str, Any], c: dict[str, Any], serving: dict[str, Any]
) -> tuple[float | None, str]:
    """Goodput disaggregated / colocated: a value when both crossed 90 % inside the sweep,
    else the bound the sweep allows ("< 0.42" when disaggregated never reached 90 %)."""
    lo, hi = serving["rates"][0], serving["rates"][-1]
    dv = d["rps"] if d["bound"] == "interpolated" else None
    cv = c["rps"] if c["bound"] == "interpolated" else None
    if dv and cv:
        return dv / cv, f"{dv / cv:.2f}"
    # an unknown side's bound: below the sweep -> < lowest rate; lower bound -> >= highest
    if d["bound"] == "below_sweep" and cv:
        return None, f"< {lo / cv:.2f}"
    if d["bound"] == "lower" and cv:
        return None, f">= {hi / cv:.2f}"
    if c["bound"] == "below_sweep" and dv:
        return None, f"> {dv / lo:.2f}"
    if c["bound"] == "lower" and dv:
        return None, f"<= {dv / hi:.2f}"
    return None, "undetermined (neither crossed 90 % inside the sweep)"


# ---- part 1: attainment vs rate --------------------------------------------------------------
def calibrate(target: str, run_dir: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    wl = dict(input_len=args.input_len, output_len=args.output_len)
    bench(target, run_dir, f"{mode}-warmup", num_prompts=args.warmup_prompts, seed=101, **wl)
    res = bench(
        target,
        run_dir,
        f"{mode}-unloaded",
        num_prompts=args.calib_prompts,
        seed=102,
        max_concurrency=1,
        **wl,
    )
    req = per_request(res)
    return {
        "n": len(req["ok"]),
        "failed": res["failed"],
        "ttft_ms": pct(req["ttft_ms"], 50),
        "tpot_ms": pct(req["tpot_ms"], 50),
        "ttft_ms_all": req["ttft_ms"],
        "tpot_ms_all": req["tpot_ms"],
        "server_prefill_ms": res.get("mean_prefill_ms"),
        "server_transfer_ms": res.get("mean_transfer_ms"),
        "server_ttft_ms": res.get("mean_server_ttft_ms"),
    }


def sweep_point(
    target: str, run_dir: Path, mode: str, rate: float, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    # A seed per rate: new prompts at every point (no prefix-cache hits from the last one),
    # the same prompts and arrival times in both modes.
    res = bench(
        target,
        run_dir,
        f"{mode}-rate{rate:g}",
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=seed,
        rate=rate,
    )
    req = per_request(res)
    point: dict[str, Any] = {
        "rate": rate,
        "seed": seed,
        "completed": res["completed"],
        "failed": res["failed"],
        "duration_s": res["duration"],
        "request_throughput": res["request_throughput"],
        "output_throughput": res["output_throughput"],
        "failures_by_status": res.get("failures_by_status", {}),
        "top_errors": top_errors(res["errors"]),
        "mean_queue_ms": res.get("mean_queue_ms"),
        "mean_prefill_ms": res.get("mean_prefill_ms"),
        "mean_transfer_ms": res.get("mean_transfer_ms"),
        "p99_itl_ms": res.get("p99_itl_ms"),
        "requests": req,
    }
    for metric in ("ttft", "tpot"):
        for q in (50, 90, 99):
            point[f"p{q}_{metric}_ms"] = pct(req[f"{metric}_ms"], q)
    return point


def run_sweep(args: argparse.Namespace, run_dir: Path, bar: tqdm) -> dict[str, Any]:
    model_dir = resolve_model(args.model, dtype=args.dtype)
    pools = write_pool_config(run_dir, args.transfer_timeout_s)
    common = ["--config", str(pools), "--model", str(model_dir), "--served-model-name",
              Path(args.model).name, "--dtype", args.dtype,
              "--num-kv-blocks", str(args.num_kv_blocks),
              "--max-model-len", str(args.max_model_len)]  # fmt: skip
    if args.transport:
        common += ["--transport", args.transport]
    calib: dict[str, Any] = {}
    sweep: dict[str, list[dict[str, Any]]] = {}
    servers: dict[str, Any] = {}
    rates: list[float] = [float(r) for r in args.rates.split(",")] if args.rates else []
    for mode in args.modes:
        bar.set_postfix_str(f"{mode}: starting the server")
        server_args = common + MODES[mode]
        with Server(mode, server_args, run_dir, args.start_timeout_s) as srv:
            servers[mode] = {"flags": server_args[2:], "start_s": srv.start_s}
            bar.set_postfix_str(f"{mode}: unloaded TTFT/TPOT")
            calib[mode] = calibrate(srv.target, run_dir, mode, args)
            bar.update()
            if not rates:
                rates = auto_rates(calib[mode], args.rate_fractions)
                bar.write(f"rates (req/s): {rates}")
            sweep[mode] = []
            for i, rate in enumerate(rates):
                bar.set_postfix_str(f"{mode}: {rate:g} req/s")
                seed = args.seed + i
                sweep[mode].append(sweep_point(srv.target, run_dir, mode, rate, seed, args))
                bar.update()
    slo = choose_slos(calib, args)
    for points in sweep.values():
        for p in points:
            p["attainment"] = attainment(p["requests"], slo["ttft_ms"], slo["tpot_ms"])
    good = {
        mode: goodput(
            [p["rate"] for p in pts], [p["attainment"]["both"] for p in pts], ATTAINMENT_TARGET
        )
        for mode, pts in sweep.items()
    }
    return {
        "model": {"name": args.model, "dtype": args.dtype, "checkpoint": str(model_dir)},
        "workload": {
            "dataset": "random (token ids, ignore_eos, greedy)",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts_per_rate": args.num_prompts,
            "arrivals": "Poisson (pdserve bench --request-rate, burstiness 1)",
            "seed": args.seed,
        },
        "deployments": {
            "disaggregated": "1 prefill + 1 decode worker, 1 torch thread each",
            "colocated": "2 colocated workers (each prefills and decodes), 1 torch thread each",
            "same_cores": f"{os.cpu_count()} CPUs shared by both workers, the router and the "
            "load generator, in both modes",
            "pools_yaml": pools.read_text(),
            "kv_transport": args.transport or "torch_dist (config default)",
            "servers": servers,
        },
        "calibration": calib,
        "slo": slo,
        "rates": rates,
        "sweep": sweep,
        "goodput": good,
    }


def auto_rates(calib: dict[str, Any], fractions: str) -> list[float]:
    """Fractions of the prefill worker's unloaded capacity (1000 / prefill_ms; TTFT if none)."""
    prefill_ms = calib.get("server_prefill_ms") or calib["ttft_ms"]
    capacity = 1000.0 / prefill_ms
    return [round(capacity * float(f), 2) for f in fractions.split(",")]


def choose_slos(calib: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ttft_base = min(c["ttft_ms"] for c in calib.values())
    tpot_base = min(c["tpot_ms"] for c in calib.values())
    return {
        "ttft_ms": args.ttft_slo_ms or args.slo_scale * ttft_base,
        "tpot_ms": args.tpot_slo_ms or args.slo_scale * tpot_base,
        "scale": args.slo_scale,
        "unloaded_ttft_ms": ttft_base,
        "unloaded_tpot_ms": tpot_base,
        "basis": (
            "given on the command line"
            if args.ttft_slo_ms or args.tpot_slo_ms
            else f"{args.slo_scale:g} x the lower of the two modes' unloaded medians"
        ),
        "attainment_target": ATTAINMENT_TARGET,
    }


# ---- part 2: router overhead -----------------------------------------------------------------
def engine_baseline(model_dir: Path, prompts: list[list[int]], batch: int) -> dict[str, Any]:
    """The engine in this process, one torch thread: prefill + 1 token, alone and batched."""
    import torch

    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    torch.set_num_threads(1)
    eng = LLMEngine.from_config(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_threads=1,
            cache=CacheConfig(block_size=16, num_blocks=1024),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        )
    )
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = iter(range(10**9))

    def run(group: list[list[int]]) -> None:
        for p in group:
            n = next(ids)
            eng.add_request(f"b{n}", p, sp, cache_salt=f"b{n}")
        while eng.has_unfinished():
            eng.step()

    for p in prompts[:10]:  # warm-up
        run([p])
    alone = []
    for p in prompts:
        t0 = time.perf_counter()
        run([p])
        alone.append((time.perf_counter() - t0) * 1e3)
    run(prompts[:batch])  # warm-up of the batched shapes
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        run(prompts[i : i + batch])
    batched_s = time.perf_counter() - t0
    rps_alone, rps_batched = 1000.0 / float(np.mean(alone)), len(prompts) / batched_s
    return {
        "p50_ms": pct(alone, 50),
        "p99_ms": pct(alone, 99),
        "rps_alone": rps_alone,
        f"rps_batch{batch}": rps_batched,
        "rps_best": max(rps_alone, rps_batched),
    }


async def _service_requests(
    target: str, prompts: list[list[int]], concurrency: int, prefix: str
) -> tuple[list[Any], float]:
    from pdserve.tools.bench import GrpcBackend, SampleRequest

    backend = GrpcBackend(target, None, 60.0)
    try:
        await backend.model_info(120.0)
        sem = asyncio.Semaphore(concurrency)
        sampling = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}

        async def one(i: int, p: list[int]) -> Any:
            async with sem:
                return await backend.generate(SampleRequest(p, len(p), 1, f"{prefix}{i}"), sampling)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return list(outs), time.perf_counter() - t0
    finally:
        await backend.close()


def run_overhead(args: argparse.Namespace, run_dir: Path, bar: tqdm) -> dict[str, Any]:
    model_dir = resolve_model("tiny")
    from engine.config import ModelConfig

    vocab = ModelConfig.from_hf(model_dir).vocab_size
    rng = np.random.default_rng(7)
    n, length = args.overhead_requests, args.overhead_prompt_len

    def prompts_(k: int) -> list[list[int]]:  # fresh random prompts: no prefix-cache hits
        return [[int(t) for t in rng.integers(4, vocab, length)] for _ in range(k)]

    warm, prompts, prompts_conc = prompts_(20), prompts_(n), prompts_(n)
    bar.set_postfix_str("router overhead: engine in process")
    engine = engine_baseline(model_dir, prompts, args.overhead_concurrency)
    bar.update()
    pools = write_pool_config(run_dir, args.transfer_timeout_s)
    server_args = ["--config", str(pools), "--model", str(model_dir),
                   "--served-model-name", "tiny", "--dtype", "float32",
                   "--prefill-workers", "1", "--decode-workers", "1"]  # fmt: skip
    bar.set_postfix_str("router overhead: starting the server")
    with Server("overhead-tiny", server_args, run_dir, args.start_timeout_s) as srv:
        bar.set_postfix_str("router overhead: one at a time")
        asyncio.run(_service_requests(srv.target, warm, 4, "warm-"))
        seq, _ = asyncio.run(_service_requests(srv.target, prompts, 1, "seq-"))
        bar.set_postfix_str(f"router overhead: concurrency {args.overhead_concurrency}")
        conc, conc_s = asyncio.run(
            _service_requests(srv.target, prompts_conc, args.overhead_concurrency, "conc-")
        )
    bar.update()
    ok = [o for o in seq if o.success]
    e2e = [o.latency * 1e3 for o in ok]
    prefill = [o.server_timings["mean_prefill_ms"] for o in ok]
    overhead = [e - p for e, p in zip(e2e, prefill, strict=True)]
    conc_ok = sum(o.success for o in conc)
    rps = conc_ok / conc_s
    return {
        "model": "tiny (float32)",
        "prompt_len": args.overhead_prompt_len,
        "max_tokens": 1,
        "requests": n,
        "failed_sequential": len(seq) - len(ok),
        "failed_concurrent": len(conc) - conc_ok,
        "concurrency": args.overhead_concurrency,
        "client_e2e_ms": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
        "server_prefill_ms": {"p50": pct(prefill, 50), "p99": pct(prefill, 99)},
        "overhead_ms": {
            "p50": pct(overhead, 50),
            "p90": pct(overhead, 90),
            "p99": pct(overhead, 99),
        },
        "server_queue_ms_p50": pct([o.server_timings["mean_queue_ms"] for o in ok], 50),
        "server_transfer_ms_p50": pct([o.server_timings["mean_transfer_ms"] for o in ok], 50),
        "server_ttft_ms_p50": pct([o.server_timings["mean_server_ttft_ms"] for o in ok], 50),
        "service_rps": rps,
        "engine": engine,
        "ratios": {
            "e2e_over_engine_alone_p50": (pct(e2e, 50) or math.nan) / engine["p50_ms"],
            "service_rps_over_engine_best": rps / engine["rps_best"],
        },
    }


# ---- plots -----------------------------------------------------------------------------------
COLORS = {"disaggregated": "tab:blue", "colocated": "tab:orange"}


def plot(res: dict[str, Any], png: Path, latency_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s, slo = res["serving"], res["serving"]["slo"]
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for mode, pts in s["sweep"].items():
        rates = [p["rate"] for p in pts]
        c = COLORS.get(mode)
        ax.plot(rates, [100 * p["attainment"]["both"] for p in pts], "o-", color=c,
                label=f"{mode}: both SLOs")  # fmt: skip
        ax.plot(rates, [100 * p["attainment"]["ttft"] for p in pts], ":", color=c, alpha=0.7,
                label=f"{mode}: TTFT only")  # fmt: skip
        ax.plot(rates, [100 * p["attainment"]["tpot"] for p in pts], "--", color=c, alpha=0.7,
                label=f"{mode}: TPOT only")  # fmt: skip
        g = s["goodput"][mode]
        if g["rps"] is not None:
            ax.axvline(g["rps"], color=c, lw=0.8, alpha=0.5)
    ax.axhline(100 * ATTAINMENT_TARGET, color="grey", lw=0.8, ls="-.")
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("SLO attainment (% of requests)")
    ax.set_ylim(-3, 103)
    wl = s["workload"]
    ax.set_title(
        f"{s['model'].get('name', s['model'].get('preset'))} {s['model']['dtype']}, "
        f"{wl['input_len']} in / "
        f"{wl['output_len']} out; SLO TTFT {slo['ttft_ms']:.0f} ms, TPOT {slo['tpot_ms']:.0f} ms",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for mode, pts in s["sweep"].items():
            rates = [p["rate"] for p in pts]
            c = COLORS.get(mode)
            for q, style in ((50, "o-"), (99, "s--")):
                vals = [p[f"p{q}_{metric}_ms"] or math.nan for p in pts]
                ax.plot(rates, vals, style, color=c, label=f"{mode} p{q}")
        ax.axhline(slo[f"{metric}_ms"], color="grey", lw=0.8, ls="-.", label="SLO")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_title(f"{metric.upper()} p50 / p99 vs rate", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(latency_png, dpi=120)
    plt.close(fig)


# ---- report ----------------------------------------------------------------------------------
def summary(res: dict[str, Any]) -> str:
    lines = []
    s = res.get("serving")
    if s:
        slo = s["slo"]
        lines.append(
            f"SLOs: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.1f} ms "
            f"({slo['basis']}; unloaded TTFT {slo['unloaded_ttft_ms']:.0f} ms, "
            f"TPOT {slo['unloaded_tpot_ms']:.1f} ms)"
        )
        for mode, c in s["calibration"].items():
            lines.append(
                f"  {mode:<14} unloaded TTFT {c['ttft_ms']:.0f} ms, TPOT {c['tpot_ms']:.1f} ms, "
                f"server prefill {c['server_prefill_ms'] or 0:.0f} ms"
            )
        head = f"{'mode':<14} {'rate':>6} {'done':>5} {'att%':>5} {'ttft%':>5} {'tpot%':>5} "
        head += f"{'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7}"
        lines.append(head)
        for mode, pts in s["sweep"].items():
            for p in pts:
                a = p["attainment"]
                lines.append(
                    f"{mode:<14} {p['rate']:>6.2f} {p['completed']:>5} {100 * a['both']:>5.0f} "
                    f"{100 * a['ttft']:>5.0f} {100 * a['tpot']:>5.0f} "
                    f"{p['p50_ttft_ms'] or math.nan:>9.0f} {p['p99_ttft_ms'] or math.nan:>8.0f} "
                    f"{p['p50_tpot_ms'] or math.nan:>9.1f} {p['p99_tpot_ms'] or math.nan:>7.1f}"
                )
        for mode, g in s["goodput"].items():
            lines.append(f"goodput ({mode}): {g['note']}")
        r = s.get("ratios", {})
        if r.get("goodput_ratio_note"):
            lines.append(f"goodput disaggregated / colocated: {r['goodput_ratio_note']}")
    o = res.get("router_overhead")
    if o:
        lines.append(
            f"router overhead (tiny, max_tokens=1): p50 {o['overhead_ms']['p50']:.1f} ms, "
            f"p99 {o['overhead_ms']['p99']:.1f} ms beyond server prefill "
            f"(e2e p50 {o['client_e2e_ms']['p50']:.1f} ms vs engine alone "
            f"{o['engine']['p50_ms']:.1f} ms); {o['service_rps']:.0f} req/s at concurrency "
            f"{o['concurrency']} = {o['ratios']['service_rps_over_engine_best']:.2f}x "
            "the engine's best"
        )
    return "\n".join(lines)


def plot_paths(out: Path) -> tuple[Path, Path]:
    """serving-latest.json -> serving-latest.png, serving-latency-latest.png."""
    png = out.with_suffix(".png")
    lat = out.with_name(out.stem.replace("-latest", "") + "-latency-latest.png")
    return png, (lat if lat != png else out.with_name(out.stem + "-latency.png"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "serving-latest.json")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "build" / "serving-runs",
                   help="raw pdserve bench JSONs and server logs (replaced each run)")  # fmt: skip
    p.add_argument("--modes", default="disaggregated,colocated")
    p.add_argument("--model", "--preset", dest="model", default="small", help=BENCH_MODEL_HELP)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=30, help="per rate and mode (>= 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", default=None, help="req/s, comma-separated (default: auto)")
    p.add_argument(
        "--rate-fractions",
        default="0.15,0.25,0.35,0.5,0.7,1.0",
        help="auto rates: fractions of the prefill worker's unloaded capacity",
    )
    p.add_argument("--slo-scale", type=float, default=3.0)
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--tpot-slo-ms", type=float, default=None)
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--calib-prompts", type=int, default=6)
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="per worker")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--transport",
        choices=["torch_dist", "grpc"],
        default=None,
        help="KV transport of the disaggregated sweep (default: the config default, torch_dist)",
    )
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=None,
        help="transfer.timeout_s for the servers (default: the config default, 10 s)",
    )
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--overhead-prompt-len", type=int, default=128)
    p.add_argument("--overhead-concurrency", type=int, default=8)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNGs from --out's JSON")
    args = p.parse_args(argv)
    if args.plot_only:
        png, lat = plot_paths(args.out)
        plot(json.loads(args.out.read_text()), png, lat)
        print(f"wrote {png} and {lat}")
        return 0
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    if not args.modes:
        p.error("--modes: at least one")

    t0 = time.perf_counter()
    shutil.rmtree(args.runs_dir, ignore_errors=True)
    args.runs_dir.mkdir(parents=True)
    res: dict[str, Any] = {
        "meta": {
            "when": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
            "host": socket.gethostname(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": list(os.getloadavg()),
        },
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    n_rates = len(args.rates.split(",")) if args.rates else len(args.rate_fractions.split(","))
    stages = 0 if args.skip_sweep else len(args.modes) * (1 + n_rates)
    stages += 0 if args.skip_overhead else 2
    with tqdm(total=stages, desc="serving", unit="step", file=sys.stderr) as bar:
        if not args.skip_sweep:
            res["serving"] = run_sweep(args, args.runs_dir, bar)
            g = res["serving"]["goodput"]
            ratios: dict[str, Any] = {}
            if {"disaggregated", "colocated"} <= g.keys():
                ratio, note = goodput_ratio(g["disaggregated"], g["colocated"], res["serving"])
                ratios["goodput_disaggregated_over_colocated"] = ratio
                ratios["goodput_ratio_note"] = note
                ratios["goodput_bounds"] = {m: g[m]["bound"] for m in g}
            res["serving"]["ratios"] = ratios
        if not args.skip_overhead:
            res["router_overhead"] = run_overhead(args, args.runs_dir, bar)
    res["meta"]["loadavg_end"] = list(os.getloadavg())
    res["meta"]["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    written = [args.out]
    if "serving" in res:
        png, lat = plot_paths(args.out)
        plot(res, png, lat)
        written += [png, lat]
    print(summary(res))
    names = ", ".join(str(w.relative_to(ROOT) if w.is_relative_to(ROOT) else w) for w in written)
    meta = res["meta"]
    print(
        f"wrote {names} in {meta['wall_s']:.0f} s "
        f"(load average {meta['loadavg_start'][0]:.1f} -> {meta['loadavg_end'][0]:.1f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
