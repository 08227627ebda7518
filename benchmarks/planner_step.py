"""The planner under a load step (issue 41): `pdserve serve` with the planner on, a Poisson
load at a base rate, then 3x that rate, then the base rate again; every second the pools
(`/v1/admin/pool`) and the planner's signals (`/metrics`) are sampled.

Writes `benchmarks/results/planner-step-latest.json` and a timeline plot (`.png`: offered
rate, workers per role, the planner's rolling attainment), and prints the planner's
decisions. On a 2-core machine more workers add no cores: what this shows is the control
loop (what it decides, when, and that nothing is lost while it acts), not capacity.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling, as the other benchmarks import theirs

from pool_ops import start_server  # noqa: E402

from engine.cpu import identity  # noqa: E402
from pdserve.client import Client  # noqa: E402
from pdserve.pool_cli import call  # noqa: E402
from pdserve.tools.procs import stop_process_group  # noqa: E402

_SIGNAL = re.compile(r'^pdserve:planner_signal\{[^}]*signal="(\w+)"\} (\S+)$')


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[str], str, str]:
    config = ROOT / "build" / "planner-step.yaml"
    config.write_text(
        json.dumps(
            {
                "planner": {
                    "enabled": True,
                    "mode": args.mode,
                    "interval_s": 2.0,
                    "patience": 2,
                    "window_s": 20.0,
                    "ttft_ms": args.ttft_ms,
                    "tpot_ms": args.tpot_ms,
                    "max_prefill": 3,
                    "max_decode": 3,
                }
            }
        )
    )
    return start_server(args.model, log, ("--config", str(config)))


class Load:
    """Poisson arrivals at a rate the caller changes; each request on its own thread."""

    def __init__(self, target: str, prompt_len: int, max_tokens: int, seed: int) -> None:
        self.target, self.prompt_len, self.max_tokens = target, prompt_len, max_tokens
        self.rate = 0.0
        self.rng = random.Random(seed)
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sender = threading.Thread(target=self._send)
        self._sender.start()

    def _send(self) -> None:
        n = 0
        while not self._stop.is_set():
            if self.rate <= 0:
                time.sleep(0.05)
                continue
            time.sleep(self.rng.expovariate(self.rate))
            n += 1
            prompt = [4 + self.rng.randrange(400) for _ in range(self.prompt_len)]
            t = threading.Thread(target=self._one, args=(prompt, f"step-{n}"))
            t.start()
            self._threads.append(t)

    def _one(self, prompt: list[int], rid: str) -> None:
        client = Client(self.target, timeout_s=120)
        try:
            done = client.generate(prompt, request_id=rid, max_tokens=self.max_tokens,
                                   temperature=0.0, ignore_eos=True)  # fmt: skip
            if len(done.token_ids) == self.max_tokens:
                self.ok += 1
            else:
                self.errors.append(f"{rid}: {len(done.token_ids)} tokens")
        except Exception as e:  # counted: the run reports every one
            self.errors.append(f"{rid}: {e!r}"[:200])
        finally:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        self._sender.join()
        for t in self._threads:
            t.join(180)


def sample(url: str, t: float, rate: float) -> dict[str, Any]:
    _, pool = call(url, "GET", "/v1/admin/pool", None, None, 10.0)
    roles = [w["role"] for w in pool.get("workers", []) if w.get("state") == "serving"]
    signals: dict[str, float] = {}
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            m = _SIGNAL.match(line)
            if m:
                signals[m.group(1)] = float(m.group(2))
    return {
        "t": round(t, 2),
        "rate": rate,
        "prefill": roles.count("prefill"),
        "decode": roles.count("decode"),
        "attainment": signals.get("attainment"),
        "signals": signals,
    }


def plot(
    rows: list[dict[str, Any]], path: Path, predicted: list[dict[str, Any]] | None = None
) -> None:
    """Offered rate, workers per role and attainment over time; `predicted` (the same keys
    but the rate) dashed beside them: what `pdserve.plan.elastic` predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    a.plot(t, [r["rate"] for r in rows])
    a.set_ylabel("offered req/s")
    b.step(t, [r["prefill"] for r in rows], label="prefill", where="post")
    b.step(t, [r["decode"] for r in rows], label="decode", where="post")
    c.plot(t, [r["attainment"] for r in rows], label="measured")
    if predicted:
        tp = [r["t"] for r in predicted]
        b.step(
            tp, [r["prefill"] for r in predicted], "--", label="prefill, predicted", where="post"
        )
        b.step(tp, [r["decode"] for r in predicted], "--", label="decode, predicted", where="post")
        c.plot(tp, [r["attainment"] for r in predicted], "--", label="predicted")
        c.legend()
    b.set_ylabel("workers serving")
    b.legend()
    c.axhline(0.9, linestyle=":", color="grey")
    c.set_ylabel("attainment (window)")
    c.set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--mode", default="act", choices=["advisory", "act"])
    p.add_argument("--rate", type=float, default=2.0, help="the base rate, req/s")
    p.add_argument("--phase-s", type=float, default=40.0, help="seconds of each phase")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=100.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/planner-step-latest.json"))
    args = p.parse_args()
    (ROOT / "build").mkdir(exist_ok=True)
    log = ROOT / "build" / "planner-step-serve.log"
    proc, target, url = start(args, log)
    rows: list[dict[str, Any]] = []
    load = Load(target, args.prompt_len, args.max_tokens, seed=0)
    t0 = time.monotonic()
    try:
        for rate in (args.rate, 3 * args.rate, args.rate):
            load.rate = rate
            end = time.monotonic() + args.phase_s
            while time.monotonic() < end:
                rows.append(sample(url, time.monotonic() - t0, rate))
                time.sleep(1.0)
        load.rate = 0.0
    finally:
        load.stop()
        stop_process_group(proc, 60)
    decisions = [ln.split("router.planner: ", 1)[1] for ln in log.read_text().splitlines()
                 if "WARNING router.planner: planner" in ln]  # fmt: skip
    result = {
        "cpu": identity(), "args": vars(args), "timeline": rows, "decisions": decisions,
        "completed": load.ok, "errors": load.errors,
    }  # fmt: skip
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"CPU: {identity()}")
    for d in decisions:
        print(d)
    print(f"requests completed {load.ok}, errors {len(load.errors)}; {out} and its .png")
    return 1 if load.errors else 0


if __name__ == "__main__":
    sys.exit(main())
