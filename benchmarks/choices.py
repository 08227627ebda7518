#!/usr/bin/env python
"""n > 1 on the real default model: what n choices from one prompt pass cost, against n = 1,
in disaggregated and colocated mode.

Run: ``.venv/bin/python benchmarks/choices.py`` (``make bench-choices``). Per mode
(``pdserve serve``: 1 prefill + 1 decode worker, or 2 colocated workers, each one torch
thread, as benchmarks/serving.py runs them), one request at a time: rounds of n = 1, 2, 4
and 8 (interleaved, so drift on a noisy host hits every n alike), each a chat-templated
prompt of about 250 tokens, ``max_tokens`` 64 per choice, EOS ignored, temperature 0.8 with
a seed. Client-side, per request:

- **TTFT**: send until the first chunk (every choice's first token comes from the one prompt
  pass, so n should barely move it);
- **decode output tokens/s**: the tokens after each choice's first, over the time from the
  first chunk to the last (the choices run as one decode batch on shared prompt blocks);
- the prefill workers' request count before and after (one prompt pass per request).

Prints and writes the medians and the ratios to n = 1 (targets: TTFT at n = 4 within 1.2x,
decode tokens/s at n = 4 at least 2.5x), and a plot of both against n:
``benchmarks/results/choices-latest.json`` and ``choices-latest.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PDSERVE_HOME", str(ROOT / ".venv" / "pdserve-home"))  # as the Makefile

from serving import MODES, Server, write_pool_config  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.tokenizer import Tokenizer  # noqa: E402
from pdserve.client import Client, make_request  # noqa: E402
from pdserve.models import DEFAULT_MODEL, resolve_model  # noqa: E402
from protos.pdserve.v1 import generation_pb2 as gen  # noqa: E402
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
WORDS = (
    "Story", "Tale", "Note", "Report", "Letter", "Poem", "Essay", "Sketch",
    "Memo", "Diary", "Legend", "Fable", "Account", "Chronicle", "Record", "Summary",
)  # fmt: skip
NS = (1, 2, 4, 8)
MAX_TOKENS = 64
TOPIC = (
    "You are a careful assistant. The harbour town below the cliffs has a lighthouse, a fish "
    "market, three bakeries, a small museum of old maps and a ferry that leaves at dawn. "
)


def prompts(tok: Tokenizer, count: int) -> list[list[int]]:
    """Chat-templated prompts of about 250 tokens, each used once and each its own from its
    first words: no prefix-cache hit beyond the template's head, so TTFT is a whole prompt
    pass."""
    return [
        tok.encode_chat(
            [{"role": "user", "content": f"{WORDS[i % 16]} {i}. " + TOPIC * 5 + "Tell me."}]
        )
        for i in range(count)
    ]


def one(client: Client, ids: list[int], n: int, rid: str) -> dict[str, float]:
    req = make_request(
        ids, rid, n=n, temperature=0.8, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    for resp in client.stream(req):
        if resp.HasField("chunk") and resp.chunk.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(resp.chunk.token_ids)
    assert tokens == n * MAX_TOKENS, (tokens, n)
    return {"ttft_s": first - t0, "decode_tok_s": (tokens - n) / (last - first)}


def prefill_requests(target: str) -> int:
    """The prefill workers' request count (colocated: 0)."""
    client = Client(target)
    try:
        info = gen_grpc.GenerationStub(client.channel).GetServerInfo(gen.GetServerInfoRequest())
    finally:
        client.close()
    return sum(w.num_requests_total for w in info.workers if w.role == "prefill")


def run_mode(target: str, ids: list[list[int]], rounds: int, bar: tqdm) -> dict[str, Any]:
    client = Client(target, timeout_s=600)
    samples: dict[int, list[dict[str, float]]] = {n: [] for n in NS}
    try:
        one(client, ids[-1], 4, "warmup")  # the last prompt: the rounds use the others
        before = prefill_requests(target)
        k = 0
        for r in range(rounds):
            for n in NS if r % 2 == 0 else reversed(NS):  # ABBA: drift hits every n alike
                samples[n].append(one(client, ids[k], n, f"choices-{k}"))
                k += 1
                bar.update()
        passes = prefill_requests(target) - before
    finally:
        client.close()
    out: dict[str, Any] = {"requests": k, "prefill_passes": passes, "by_n": {}}
    for n in NS:
        ttft = statistics.median(s["ttft_s"] for s in samples[n])
        tok_s = statistics.median(s["decode_tok_s"] for s in samples[n])
        out["by_n"][n] = {"ttft_ms_p50": round(ttft * 1e3, 1), "decode_tok_s_p50": round(tok_s, 1)}
    base = out["by_n"][1]
    for n in NS:
        row = out["by_n"][n]
        row["ttft_ratio"] = round(row["ttft_ms_p50"] / base["ttft_ms_p50"], 3)
        row["decode_tok_s_ratio"] = round(row["decode_tok_s_p50"] / base["decode_tok_s_p50"], 3)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, res in result["modes"].items():
        rows = [res["by_n"][n] for n in NS]
        a.plot(NS, [r["ttft_ms_p50"] for r in rows], marker="o", label=mode)
        b.plot(NS, [r["decode_tok_s_p50"] for r in rows], marker="o", label=mode)
    a.set(xlabel="n (choices)", ylabel="TTFT p50 (ms)", title="Time to first token")
    b.set(xlabel="n (choices)", ylabel="tokens/s p50", title="Decode output tokens/s")
    for ax in (a, b):
        ax.set_xticks(NS)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"n choices from one prompt pass ({DEFAULT_MODEL}, {os.cpu_count()} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS_DIR / "choices-latest.json"))
    p.add_argument("--modes", default="disaggregated,colocated")
    p.add_argument("--rounds", type=int, default=8, help="requests of each n per mode")
    args = p.parse_args(argv)
    model_dir = resolve_model(DEFAULT_MODEL)
    ids = prompts(Tokenizer.from_dir(model_dir), args.rounds * len(NS) + 1)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": DEFAULT_MODEL,
        "prompt_tokens": [min(len(x) for x in ids), max(len(x) for x in ids)],
        "max_tokens": MAX_TOKENS,
        "modes": {},
    }
    run_dir = ROOT / "build" / "choices-runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    pools = write_pool_config(run_dir)
    modes = [m for m in args.modes.split(",") if m]
    with tqdm(total=len(modes) * args.rounds * len(NS), desc="choices") as bar:
        for mode in modes:
            flags = ["--model", DEFAULT_MODEL, "--config", str(pools), *MODES[mode]]
            with Server(mode, flags, run_dir, 300.0) as server:
                result["modes"][mode] = run_mode(server.target, ids, args.rounds, bar)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
