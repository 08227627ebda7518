#!/usr/bin/env python
"""Where the service's time goes: CPU per output token, by process and thread, and profiles.

Run: ``.venv/bin/python benchmarks/breakdown.py [--mode pdserve-colocated]`` (needs the vLLM
virtualenv that ``benchmarks/peers.py`` installs, for its client). It starts one pdserve
server as ``peers.py`` does and drives it with the same ``vllm bench serve`` workloads
(``c1`` and ``c8`` by default), measuring, for each workload, in the service itself:

* **CPU time per output token** of every process the server started (the router, which is
  also Ray's driver; each Ray actor; raylet, GCS and Ray's helpers) and of the client, from
  ``/proc/<pid>/stat`` before and after the run, and for the workers per OS thread
  (``/proc/<pid>/task``): the engine thread is named ``pd-engine`` (``engine.loop``), so its
  share, the torch intra-op threads' and the Ray/asyncio threads' come apart;
* **the engine's own step time** per step, from the workers' ``pdserve:engine_step_seconds``
  and ``pdserve:engine_steps`` counters on the router's ``/metrics``; against the client's
  TPOT it says what the serving path adds to each token;
* with ``--omp-ab``, instead, the A/B behind building the engine on its own thread
  (``engine.loop``): the same engine in fresh processes, 64 greedy tokens after a 512-token
  prompt, stepped on a non-main thread, (a) built on that thread, (b) built on the main
  thread first (as workers did: the main thread's OpenMP team stays behind), alternating;
* with ``--profile``, a second pass of each workload under ``py-spy record`` (router and
  workers, on-CPU samples only), summarized as the top functions by self and by inclusive
  samples. py-spy steals CPU on a small box: the figures above come from the first pass.

Results: ``benchmarks/results/breakdown-latest.json`` and a printed table; raw files under
``build/breakdown-runs/<timestamp>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
STEP_RE = re.compile(r"^pdserve:engine_step(s|_seconds)_total\{([^}]*)\} (\S+)$")


# ---- /proc -----------------------------------------------------------------------------------
def _stat(path: Path) -> tuple[str, int, float] | None:
    """(comm, ppid, utime + stime seconds) of one /proc stat file."""
    try:
        text = path.read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    rest = text[text.rindex(")") + 2 :].split()
    return comm, int(rest[1]), (int(rest[11]) + int(rest[12])) * TICK_S


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(d / "stat")) is not None:
            parent[int(d.name)] = st[1]
    out, frontier = [], {root}
    while frontier:
        kids = {p for p, pp in parent.items() if pp in frontier}
        out += sorted(kids)
        frontier = kids
    return [root, *out]


def label(pid: int, root: int) -> str:
    if pid == root:
        return "router (pdserve serve, Ray driver)"
    cmd = _cmdline(pid)
    if m := re.search(r"ray::(\w+)", cmd):
        return f"actor {m.group(1)}"
    for key in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env"):
        if key in cmd:
            return f"ray {key}"
    return f"other: {cmd[:60]}"


def snapshot(root: int) -> dict[int, dict[str, Any]]:
    """CPU seconds per process (by pid) and, for actors, per thread (by tid)."""
    procs: dict[int, dict[str, Any]] = {}
    for pid in descendants(root):
        st = _stat(Path(f"/proc/{pid}/stat"))
        if st is None:
            continue
        entry: dict[str, Any] = {"label": label(pid, root), "cpu_s": st[2], "threads": {}}
        if entry["label"].startswith("actor") or pid == root:
            for t in Path(f"/proc/{pid}/task").iterdir():
                if (ts := _stat(t / "stat")) is not None:
                    entry["threads"][int(t.name)] = (ts[0], ts[2])
        procs[pid] = entry
    return procs


def delta(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """CPU seconds spent between two snapshots, per process label and per thread name."""
    out: dict[str, Any] = {}
    for pid, a in after.items():
        b = before.get(pid, {"cpu_s": 0.0, "threads": {}})
        row = out.setdefault(a["label"], {"cpu_s": 0.0, "threads": Counter()})
        row["cpu_s"] += a["cpu_s"] - b["cpu_s"]
        # by OS thread name: `pd-engine` is the engine loop (torch's OpenMP threads inherit
        # the name of the thread that started them); Ray's C++ threads have their own names
        for tid, (name, cpu) in a["threads"].items():
            row["threads"][name] += cpu - b["threads"].get(tid, (name, 0.0))[1]
    return out


# ---- the server's counters -------------------------------------------------------------------
def engine_steps(base_url: str) -> dict[str, tuple[float, float]]:
    """Per worker: (steps, step seconds) from the router's /metrics."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if m := STEP_RE.match(line):
            worker = re.search(r'worker="([^"]*)"', m.group(2))
            key = worker.group(1) if worker else m.group(2)
            pair = out.setdefault(key, [0.0, 0.0])
            pair[0 if m.group(1) == "s" else 1] = float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


def wait_stats_fresh(base_url: str, s: float = 2.5) -> dict[str, tuple[float, float]]:
    """The router refreshes worker stats a few times a second: let it catch up first."""
    time.sleep(s)
    return engine_steps(base_url)


# ---- py-spy ----------------------------------------------------------------------------------
def profile_start(
    pids: dict[str, int], out_dir: Path, duration_s: int
) -> list[subprocess.Popen[bytes]]:
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("breakdown: --profile needs py-spy (.venv/bin/pip install py-spy)")
    procs = []
    for name, pid in pids.items():
        out = out_dir / f"{name}.txt"
        cmd = [spy, "record", "-p", str(pid), "-d", str(duration_s), "-r", "50",
               "-f", "raw", "-o", str(out), "--nonblocking"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def summarize_profile(path: Path, top: int = 15) -> dict[str, Any]:
    """Collapsed stacks -> top functions by self and by inclusive samples."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = [re.sub(r" \((/.*/)?([^/]+)\)$", r" (\2)", f) for f in stack.split(";")[1:]]
        count = int(n)
        total += count
        if frames:
            self_c[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    return {
        "samples": total,
        "self": [(f, c / total) for f, c in self_c.most_common(top)] if total else [],
        "inclusive": [(f, c / total) for f, c in incl.most_common(top)] if total else [],
    }


# ---- the OpenMP-team A/B ---------------------------------------------------------------------
def omp_ab(model: Path, rounds: int, threads: int, run_dir: Path) -> dict[str, Any]:
    """`peers.engine_alone` on both sides of the A/B, alternating, in fresh processes."""
    sides: dict[str, list[float]] = {"thread": [], "main": []}
    for rnd in range(rounds):
        for side in sides:
            log = run_dir / f"omp-ab-{side}-{rnd}.log"
            sides[side].append(peers.engine_alone(model, threads, log, side)["tpot_ms"])
    med = {k: sorted(v)[len(v) // 2] for k, v in sides.items()}
    return {"rounds": sides, "median_tpot_ms": med, "main_over_engine_thread":
            med["main"] / med["thread"], "threads": threads}  # fmt: skip


# ---- the run ---------------------------------------------------------------------------------
def actor_pids(root: int) -> dict[str, int]:
    out = {"router": root}
    for pid in descendants(root):
        lab = label(pid, root)
        if lab.startswith("actor"):
            out[lab.split()[1] + f"-{pid}"] = pid
    return out


def one_pass(
    cli: Path, srv: peers.Server, model: Path, name: str, wl: peers.Workload,
    run_dir: Path, tag: str, seed: int,
) -> dict[str, Any]:  # fmt: skip
    root = srv.proc.pid if srv.proc else 0
    steps0 = wait_stats_fresh(srv.base_url)
    cpu0 = snapshot(root)
    t0 = time.perf_counter()
    out = run_dir / f"{tag}.json"
    client_before = os.times()
    res = peers.run_bench(
        peers.bench_cmd(cli, srv, model, name, wl, out, seed, wl.num_prompts),
        run_dir / f"{tag}.log",
        1800,
    )
    client_after = os.times()
    wall = time.perf_counter() - t0
    cpu1 = snapshot(root)
    steps1 = wait_stats_fresh(srv.base_url)
    tokens = res["total_output_tokens"]
    d = delta(cpu0, cpu1)
    client_cpu = (client_after.children_user + client_after.children_system) - (
        client_before.children_user + client_before.children_system
    )
    eng = {}
    for w, (n1, s1) in steps1.items():
        n0, s0 = steps0.get(w, (0.0, 0.0))
        if n1 > n0:
            eng[w] = {"steps": n1 - n0, "step_ms": (s1 - s0) / (n1 - n0) * 1e3,
                      "busy": (s1 - s0) / wall}  # fmt: skip
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "client": peers.summarize(res),
        "engine": eng,
        "cpu_ms_per_token": {
            lab: {
                "total": row["cpu_s"] / tokens * 1e3,
                "threads": {
                    t: c / tokens * 1e3 for t, c in row["threads"].most_common() if c > 0.005
                },
            }
            for lab, row in sorted(d.items(), key=lambda kv: -kv[1]["cpu_s"])
            if row["cpu_s"] > 0.005
        },
        "client_cpu_ms_per_token": client_cpu / tokens * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="pdserve-colocated",
                   choices=["pdserve-colocated", "pdserve-disaggregated"])  # fmt: skip
    p.add_argument("--workloads", type=lambda s: s.split(","), default=["c1", "c8"])
    p.add_argument("--c1-prompts", type=int, default=8)
    p.add_argument("--c8-prompts", type=int, default=32)
    p.add_argument("--prefix-prompts", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--profile", action="store_true", help="a second pass under py-spy")
    p.add_argument(
        "--omp-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only the OpenMP-team A/B, this many alternating rounds",
    )
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=peers.RESULTS_DIR / "breakdown-latest.json")
    args = p.parse_args(argv)
    run_dir = peers.BUILD / "breakdown-runs" / f"{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    model = peers.resolve_model(peers.DEFAULT_MODEL, dtype="float32")
    if args.omp_ab:
        ab = omp_ab(model, args.omp_ab, os.cpu_count() or 1, run_dir)
        print(json.dumps(ab, indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"omp_ab": ab}, indent=1))
        return 0
    cli = peers.ensure_vllm()
    name = peers.DEFAULT_MODEL
    wls = peers.workloads(args)
    result: dict[str, Any] = {"mode": args.mode, "label": args.label, "workloads": {}}
    with peers.server_for(args.mode, cli, model, name, run_dir, args, "float32") as srv:
        for w in args.workloads:  # warm-up of each shape
            wl = wls[w]
            warm = run_dir / f"warmup-{w}.json"
            cmd = peers.bench_cmd(cli, srv, model, name, wl, warm, 1000, 2 * wl.concurrency)
            peers.run_bench(cmd, run_dir / f"warmup-{w}.log", 900)
        for w in args.workloads:
            wl = wls[w]
            row = one_pass(cli, srv, model, name, wl, run_dir, w, 0)
            if args.profile:
                assert srv.proc is not None
                pids = actor_pids(srv.proc.pid)
                spies = profile_start(pids, run_dir, int(row["wall_s"]) + 5)
                one_pass(cli, srv, model, name, wl, run_dir, f"{w}-profiled", 1)
                for s in spies:
                    s.wait(60)
                row["profiles"] = {
                    n: summarize_profile(run_dir / f"{n}.txt")
                    for n in pids
                    if (run_dir / f"{n}.txt").exists()
                }
                for n in pids:
                    if (run_dir / f"{n}.txt").exists():
                        (run_dir / f"{n}.txt").rename(run_dir / f"{w}-{n}.txt")
            result["workloads"][w] = row
            print_row(w, row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}; raw in {run_dir}")
    return 0


def print_row(w: str, row: dict[str, Any]) -> None:
    c = row["client"]
    print(f"\n== {w}: {row['output_tokens']} tokens in {row['wall_s']:.1f} s; client TPOT p50 "
          f"{c['median_tpot_ms']:.1f} ms, ITL p50 {c['median_itl_ms']:.1f} ms, "
          f"{c['output_throughput']:.1f} tok/s")  # fmt: skip
    for wk, e in row["engine"].items():
        print(f"   engine {wk}: {e['steps']:.0f} steps, {e['step_ms']:.1f} ms/step, "
              f"busy {e['busy']:.0%}")  # fmt: skip
    print(f"   CPU ms per output token (client: {row['client_cpu_ms_per_token']:.2f}):")
    for lab, r in row["cpu_ms_per_token"].items():
        threads = ", ".join(f"{t} {v:.2f}" for t, v in list(r["threads"].items())[:6])
        print(f"     {r['total']:7.2f}  {lab}" + (f"  [{threads}]" if threads else ""))
    for n, prof in row.get("profiles", {}).items():
        print(f"   py-spy {n} ({prof['samples']} samples), top self:")
        for f, share in prof["self"][:8]:
            print(f"     {share:6.1%}  {f}")


if __name__ == "__main__":
    raise SystemExit(main())
