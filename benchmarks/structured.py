#!/usr/bin/env python
"""Structured outputs on the real default model: compile time, and what a grammar costs a
decode step, in disaggregated and colocated mode side by side.

Run: ``.venv/bin/python benchmarks/structured.py`` (``make bench-structured``). One run does:

1. **Compile time** in this process (`engine.structured.GrammarBackend` on the served
   tokenizer): the first compile, which loads xgrammar and builds the tokenizer's info, then
   each of the 10 schemas of tests/structured_data.py cold and cached.
2. **Per mode** (``pdserve serve``: 1 prefill + 1 decode worker, or 2 colocated workers, each
   one torch thread, as benchmarks/serving.py runs them): 200 ``json_schema`` requests (20
   prompts x the 10 schemas, chat-templated, greedy, ``max_tokens`` 160) at concurrency 8,
   each validated with ``jsonschema``; then the same 200 prompts unconstrained, each exactly as
   many tokens as its constrained run (EOS ignored), at the same concurrency. TPOT per
   request is (last chunk - first chunk) / (chunks - 1), client-side, and the decode TPOT the
   same from the second chunk on (in disaggregated mode the first interval is the handover);
   the ratios are constrained p50 / unconstrained p50 (target <= 1.15x).
3. **Across modes**: how many of the 200 outputs are equal token for token.
4. **A pathological schema at the edge** (disaggregated): short requests one at a time,
   alone and while a schema that takes ~8 s to compile is refused at the router's 5 s bound;
   their p50 latency ratio (target <= 2x).

Results: ``benchmarks/results/structured-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PDSERVE_HOME", str(ROOT / ".venv" / "pdserve-home"))  # as the Makefile

import grpc  # noqa: E402
import jsonschema  # noqa: E402
from serving import MODES, Server, write_pool_config  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.structured import StructuredOutput  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from pdserve.client import Client, make_request  # noqa: E402
from pdserve.models import DEFAULT_MODEL, resolve_model  # noqa: E402
from tests.structured_data import MORE_PROMPTS, SCHEMAS, SLOW_SCHEMA  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
CONCURRENCY = 8
MAX_TOKENS = 160
FREE_TOKENS = 48


def compile_times(model_dir: Path) -> dict[str, Any]:
    backend = Tokenizer.from_dir(model_dir).grammar_backend(
        ModelConfig.from_hf(model_dir).vocab_size
    )
    t0 = time.perf_counter()
    backend.compile(StructuredOutput("json_object"))
    first = time.perf_counter() - t0
    cold, cached = [], []
    for schema in SCHEMAS:
        so = StructuredOutput("json", json.dumps(schema))
        t0 = time.perf_counter()
        backend.compile(so)
        cold.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        backend.compile(so)
        cached.append((time.perf_counter() - t0) * 1e3)
    return {
        "first_compile_s": round(first, 3),
        "schema_cold_ms": [round(x, 2) for x in cold],
        "schema_cached_ms": [round(x, 4) for x in cached],
        "schema_cold_ms_median": round(statistics.median(cold), 2),
        "schema_cached_ms_median": round(statistics.median(cached), 4),
    }


def one(
    target: str, ids: list[int], schema: dict[str, Any] | int | None, rid: str
) -> dict[str, Any]:
    """One streamed request; `schema` an int: unconstrained, exactly that many tokens."""
    client = Client(target, timeout_s=300)
    try:
        if not isinstance(schema, dict):
            n = schema or FREE_TOKENS
            req = make_request(ids, rid, temperature=0.0, max_tokens=n, ignore_eos=True)
        else:
            req = make_request(ids, rid, temperature=0.0, max_tokens=MAX_TOKENS)
            req.structured_output.json_schema = json.dumps(schema)
        t0 = time.perf_counter()
        times, tokens, text, reason = [], [], "", 0
        for resp in client.stream(req):
            if resp.HasField("chunk"):
                times.append(time.perf_counter())
                tokens += list(resp.chunk.token_ids)
                text += resp.chunk.text
            else:
                reason = resp.complete.finish_reason
    finally:
        client.close()
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    # the decode worker's steps alone: from the second token on (the first interval is the
    # handover in disaggregated mode: the KV transfer's tail and the decode start)
    decode = (times[-1] - times[1]) / (len(times) - 2) if len(times) > 2 else None
    return {
        "tokens": tokens,
        "text": text,
        "finish_reason": reason,
        "ttft_s": times[0] - t0 if times else None,
        "tpot_s": tpot,
        "decode_tpot_s": decode,
    }


def load(
    target: str,
    prompts: list[list[int]],
    schemas: list[dict[str, Any] | int | None] | list[dict[str, Any] | None],
    bar: tqdm | None = None,
) -> list[dict[str, Any]]:
    def run(i: int) -> dict[str, Any]:
        out = one(target, prompts[i], schemas[i], f"r{i}-{time.monotonic_ns()}")
        if bar is not None:
            bar.update(1)
        return out

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(run, range(len(prompts))))


def edge_cost(target: str, prompt: list[int], n: int = 12) -> dict[str, Any]:
    """Short unconstrained requests one at a time, alone and while a pathological schema is
    being compiled (and refused) at the edge: their p50 latencies and the ratio."""

    def latency(i: int) -> float:
        t0 = time.perf_counter()
        one(target, prompt, 8, f"edge-{i}-{time.monotonic_ns()}")
        return time.perf_counter() - t0

    alone = [latency(i) for i in range(n)]
    refused: dict[str, Any] = {}

    def slow() -> None:
        client = Client(target, timeout_s=60)
        req = make_request(prompt, f"slow-{time.monotonic_ns()}", max_tokens=4)
        req.structured_output.json_schema = json.dumps(SLOW_SCHEMA)
        t0 = time.perf_counter()
        try:
            list(client.stream(req))
            refused["status"] = "OK"
        except grpc.RpcError as e:  # the expected refusal: INVALID_ARGUMENT
            refused["status"] = e.code().name
            refused["details"] = (e.details() or "")[:160]
        refused["after_s"] = round(time.perf_counter() - t0, 2)
        client.close()

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(slow)
        time.sleep(0.05)
        under: list[float] = []
        while not fut.done() and len(under) < 4 * n:
            under.append(latency(len(under)))
        fut.result()
    a, u = statistics.median(alone), statistics.median(under)
    return {
        "refused": refused,
        "alone_p50_ms": round(a * 1e3, 1),
        "during_compile_p50_ms": round(u * 1e3, 1),
        "ratio": round(u / a, 3),
        "requests_during": len(under),
    }


def valid(out: dict[str, Any], schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(out["text"]), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 1)


def p50(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS_DIR / "structured-latest.json"))
    p.add_argument("--modes", default="disaggregated,colocated")
    args = p.parse_args(argv)
    model_dir = resolve_model(DEFAULT_MODEL)
    tok = Tokenizer.from_dir(model_dir)
    pairs = [(p, s) for s in SCHEMAS for p in MORE_PROMPTS]
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p, _ in pairs]
    schemas: list[dict[str, Any] | None] = [s for _, s in pairs]
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "model": DEFAULT_MODEL,
        "concurrency": CONCURRENCY,
        "compile": compile_times(model_dir),
        "modes": {},
    }
    run_dir = ROOT / "build" / "structured-runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    pools = write_pool_config(run_dir)
    modes = [m for m in args.modes.split(",") if m]
    outputs: dict[str, list[dict[str, Any]]] = {}
    with tqdm(total=len(modes) * 2 * len(prompts), desc="structured") as bar:
        for mode in modes:
            flags = ["--model", DEFAULT_MODEL, "--config", str(pools), *MODES[mode]]
            with Server(mode, flags, run_dir, 300.0) as server:
                load(server.target, prompts[:CONCURRENCY], schemas[:CONCURRENCY])  # warm-up
                constrained = load(server.target, prompts, schemas, bar)
                # the same prompts unconstrained, each exactly as long as its constrained run
                lengths: list[dict[str, Any] | int | None] = [len(o["tokens"]) for o in constrained]
                free = load(server.target, prompts, lengths, bar)
                if mode == "disaggregated":
                    result["edge"] = edge_cost(server.target, prompts[0])
            outputs[mode] = constrained
            ok = sum(valid(o, s) for o, (_, s) in zip(constrained, pairs, strict=True))
            c50, f50 = p50([o["tpot_s"] for o in constrained]), p50([o["tpot_s"] for o in free])
            cd50 = p50([o["decode_tpot_s"] for o in constrained])
            fd50 = p50([o["decode_tpot_s"] for o in free])
            result["modes"][mode] = {
                "requests": len(constrained),
                "valid": ok,
                "finish_stop": sum(o["finish_reason"] == 1 for o in constrained),
                "constrained_tpot_ms_p50": round(c50 * 1e3, 2) if c50 else None,
                "free_tpot_ms_p50": round(f50 * 1e3, 2) if f50 else None,
                "tpot_ratio": round(c50 / f50, 3) if c50 and f50 else None,
                "constrained_decode_tpot_ms_p50": _ms(cd50),
                "free_decode_tpot_ms_p50": _ms(fd50),
                "decode_tpot_ratio": round(cd50 / fd50, 3) if cd50 and fd50 else None,
                "constrained_ttft_ms_p50": _ms(p50([o["ttft_s"] for o in constrained])),
                "free_ttft_ms_p50": _ms(p50([o["ttft_s"] for o in free])),
                "mean_tokens": round(statistics.mean(len(o["tokens"]) for o in constrained), 1),
            }
    if len(outputs) == 2:
        a, b = outputs.values()
        same = sum(x["tokens"] == y["tokens"] for x, y in zip(a, b, strict=True))
        result["equal_across_modes"] = same
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
