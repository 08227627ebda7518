"""`make bench-pool`: what the pool operations cost on a real deployment (docs/operations.md).

`pdserve serve` (the default model unless --model, one prefill and one decode worker), then,
through the router's HTTP admin API:
- a cold worker start (`pool/add decode`: the Ray actor starts, loads the model, measures
  or reads its kernels, pairs, sends its first stats);
- flips of that warm worker, idle, `--repeats` times each way (the switch on the worker,
  and the whole operation with its drain);
- under load (greedy streams from `--streams` threads): a flip, then a drain of the first
  prefill worker; every stream must end whole (the run exits 1 otherwise).

Writes `benchmarks/results/pool-latest.json`, the CPU named.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.cpu import identity as cpu_name  # noqa: E402
from pdserve.client import Client  # noqa: E402
from pdserve.pool_cli import call  # noqa: E402
from pdserve.tools.procs import stop_process_group  # noqa: E402

_LISTENING = re.compile(r"^pdserve: (gRPC|HTTP) listening on (.+):(\d+)$")


def start_server(
    model: str | None, log: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], str, str]:
    """`pdserve serve` (with `extra` flags) on free ports: (process, gRPC target, HTTP base
    URL). `benchmarks/planner_step.py` starts its server with it too."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PDSERVE_API_KEY")}
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--grpc-port", "0", "--http-port", "0"]
    cmd += (["--model", model] if model else []) + list(extra)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=open(log, "w"), text=True, start_new_session=True,  # noqa: SIM115
    )  # fmt: skip
    ports: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        m = _LISTENING.match(line.strip())
        if m:
            ports[m.group(1)] = f"{m.group(2)}:{m.group(3)}"
        if len(ports) == 2:
            break
    if len(ports) < 2:
        raise RuntimeError(f"pdserve serve did not start; see {log}")
    threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()
    return proc, ports["gRPC"], f"http://{ports['HTTP']}"


def admin(url: str, op: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    method, path = ("GET", "/v1/admin/pool") if op == "status" else ("POST", f"/v1/admin/pool/{op}")
    status, answer = call(url, method, path, body, None, 900.0)
    if status != 200:
        raise RuntimeError(f"pool/{op} {body}: HTTP {status}: {answer}")
    return answer


class Load:
    """Greedy streams on `n` threads, one after another, until stopped."""

    def __init__(self, target: str, n: int, max_tokens: int) -> None:
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(target, k, max_tokens)) for k in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self, target: str, k: int, max_tokens: int) -> None:
        client = Client(target, timeout_s=300)
        i = k
        while not self._stop.is_set():
            prompt = [4 + (i * 31 + j * 7) % 4000 for j in range(256)]
            try:
                done = client.generate(
                    prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                )
                if len(done.token_ids) == max_tokens:
                    self.ok += 1
                else:
                    self.errors.append(f"short answer: {len(done.token_ids)} tokens")
            except Exception as e:  # counted: the run fails on any
                self.errors.append(repr(e)[:200])
            i += len(self.threads)
        client.close()

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the server's default model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/pool-latest.json"))
    args = p.parse_args()
    log = ROOT / "build" / "pool-serve.log"  # the server's own log (git-ignored)
    log.parent.mkdir(exist_ok=True)
    proc, target, url = start_server(args.model, log)
    result: dict[str, Any] = {"cpu": cpu_name(), "model": args.model or "default"}
    try:
        Client(target, timeout_s=300).generate("warm up", max_tokens=4)
        added = admin(url, "add", {"role": "decode"})
        result["cold_add_s"] = added["seconds"]
        name = added["worker"]
        flips: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
        for _ in range(args.repeats):
            for to in ("prefill", "decode"):
                flips[to].append(admin(url, "flip", {"worker": name, "to": to}))
        result["idle_flips"] = flips
        for to, runs in flips.items():
            result[f"flip_to_{to}_s_median"] = statistics.median(r["flip_s"] for r in runs)
            result[f"flip_to_{to}_whole_s_median"] = statistics.median(r["seconds"] for r in runs)
        load = Load(target, args.streams, args.max_tokens)
        try:
            time.sleep(5.0)
            result["loaded_flip"] = admin(url, "flip", {"worker": name, "to": "prefill"})
            time.sleep(3.0)
            result["loaded_drain"] = admin(url, "drain", {"worker": "pdserve-prefill-0"})
            time.sleep(3.0)
        finally:
            load.stop()
        result["load"] = {"completed": load.ok, "errors": load.errors}
        result["status_after"] = admin(url, "status")
    finally:
        stop_process_group(proc, 60)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"CPU: {result['cpu']}")
    print(f"cold worker start (pool/add decode): {result['cold_add_s']:.2f} s")
    for to in ("prefill", "decode"):
        print(
            f"flip to {to}: {result[f'flip_to_{to}_s_median'] * 1e3:.1f} ms on the worker, "
            f"{result[f'flip_to_{to}_whole_s_median']:.2f} s with drain and join "
            f"(median of {args.repeats})"
        )
    lf, ld = result["loaded_flip"], result["loaded_drain"]
    print(
        f"under load: flip {lf['flip_s'] * 1e3:.1f} ms (drain {lf['drained_s']:.2f} s, "
        f"ended {lf['ended']}); drain of pdserve-prefill-0 {ld['drained_s']:.2f} s "
        f"(ended {ld['ended']}); streams completed {load.ok}, errors {len(load.errors)}"
    )
    return 1 if load.errors or lf["ended"] or ld["ended"] else 0


if __name__ == "__main__":
    sys.exit(main())
