#!/usr/bin/env python
"""The attention and MLP kernels the model could run on a CPU, timed at the default model's
shapes, each with its startup cost.

Run: ``.venv/bin/python benchmarks/kernel_options.py`` (``make bench-kernels``). On this CPU, in
float32 and (where the CPU does bf16 in hardware) bfloat16, with every core:

* **decode attention** (one query per request, batch 1 / 8 / 32, 520 keys, 9 query heads on
  3 KV heads, head_dim 64, lengths varied so a mask is needed): torch's SDPA (its CPU flash
  kernel), SDPA forced to the math backend, `engine.attention` (two matmuls, scores in
  float32: what the engine runs in bf16), and that function under ``torch.compile``
  (inductor, dynamic shapes);
* **prefill attention** (one 512- and one 2048-token causal prompt): SDPA (what the engine
  runs in float32), the two-matmul formulation over the whole square, the latter under
  ``torch.compile``, and `engine.attention`'s blocked matmuls (what it runs in bf16);
* **the MLP** of one layer at 8 and 512 rows: the engine's projections (packed oneDNN where
  available, SiLU and the product in its epilogues), and the plain ``F.linear`` formulation
  under ``torch.compile`` (inductor's CPU backend; inductor cannot lower the packed oneDNN
  op: it wants its weights as graph constants).

* **the decode step** of the real model (batch 1 / 8 / 32, 512-token prompts) with the
  engine's decode attention and with SDPA in its place, alternated in one process: the A/B
  of the bf16 matmul path; and **the prompt pass** (time to the first token of a 512- and a
  2048-token prompt) with the engine's prefill attention and with SDPA in its place.

Each compiled variant's compile time is measured in a fresh process twice, the second with
inductor's on-disk caches warm (``TORCHINDUCTOR_CACHE_DIR`` under ``build/``): what a
restart pays, cold and cached. Results: ``benchmarks/results/kernels-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine import cpu  # noqa: E402
from engine.attention import (  # noqa: E402
    blocked_prefill_attention,
    decode_attention,
    matmul_attention,
    prefill_attention,
    sdpa_attention,
    sdpa_prefill_attention,
)

RESULTS = ROOT / "benchmarks" / "results" / "kernels-latest.json"
CACHE = ROOT / "build" / "inductor-cache"
H, HKV, D, SPAN = 9, 3, 64, 520  # SmolLM2-135M's heads; a 512-token prompt's context
D_MODEL, FFN = 576, 1536


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of `reps` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def matmul_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one prompt as two matmuls (scores in float32): q [H, S, D]."""
    s = q.shape[1]
    qg = q.view(HKV, H // HKV, s, D).float()
    scores = torch.matmul(qg, k.float().unsqueeze(1).transpose(-1, -2)) * D**-0.5
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril_()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v.unsqueeze(1)).view(H, s, D)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What the engine runs for a prompt that starts at position 0: q [H, S, D]."""
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=D**-0.5, enable_gqa=True
    )[0]


def mlp_plain(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gu = F.linear(x, gate_up)
    return F.linear(F.silu(gu[:, :FFN]) * gu[:, FFN:], down)


def decode_case(batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, H, D, generator=g).to(dtype)
    k = torch.randn(batch, HKV, SPAN, D, generator=g).to(dtype)
    v = torch.randn(batch, HKV, SPAN, D, generator=g).to(dtype)
    lens = torch.randint(SPAN // 2, SPAN + 1, (batch,), generator=g)
    lens[0] = SPAN
    mask = (torch.arange(SPAN)[None, :] < lens[:, None]).view(batch, 1, 1, SPAN)
    return q, k, v, mask


def decode_rows(dtype: torch.dtype, reps: int) -> dict[str, Any]:
    compiled = torch.compile(decode_attention, dynamic=True)
    return {f"b{batch}": decode_batch(batch, dtype, reps, compiled) for batch in (1, 8, 32)}


def decode_batch(
    batch: int, dtype: torch.dtype, reps: int, compiled: Callable[..., torch.Tensor]
) -> dict[str, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, mask = decode_case(batch, dtype)
    sc = D**-0.5

    def math() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa_attention(q, k, v, mask, sc)

    return {
        "sdpa_flash_ms": timed(partial(sdpa_attention, q, k, v, mask, sc), reps),
        "sdpa_math_ms": timed(math, reps),
        "matmuls_ms": timed(partial(matmul_attention, q, k, v, mask, sc), reps),
        "engine_ms": timed(lambda: decode_attention(q, k, v, mask, sc), reps),
        "compiled_matmuls_ms": timed(lambda: compiled(q, k, v, mask, sc), reps),
    }


def prefill_rows(dtype: torch.dtype, reps: int) -> dict[str, Any]:
    compiled = torch.compile(matmul_prefill, dynamic=True)
    out: dict[str, Any] = {}
    for s in (512, 2048):
        g = torch.Generator().manual_seed(s)
        q = torch.randn(H, s, D, generator=g).to(dtype)
        k = torch.randn(HKV, s, D, generator=g).to(dtype)
        v = torch.randn(HKV, s, D, generator=g).to(dtype)
        n = max(3, reps // (4 if s > 512 else 1))
        # The engine's layout: [S, heads, D] views of the step's q/k/v.
        engine_layout = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None, D**-0.5)
        out[f"s{s}"] = {
            "sdpa_flash_ms": timed(partial(sdpa_causal, q, k, v), n),
            "matmuls_ms": timed(partial(matmul_prefill, q, k, v), n),
            "compiled_matmuls_ms": timed(partial(compiled, q, k, v), n),
            "blocked_ms": timed(partial(blocked_prefill_attention, *engine_layout), n),
            "engine_ms": timed(partial(prefill_attention, *engine_layout), n),
        }
    return out


def mlp_rows(dtype: torch.dtype, reps: int) -> dict[str, Any]:
    from engine.projections import OneDnnProjections

    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(2 * FFN, D_MODEL, generator=g) * 0.02).to(dtype)
    down = (torch.randn(D_MODEL, FFN, generator=g) * 0.02).to(dtype)
    packed = None
    if OneDnnProjections.available(torch.device("cpu"), dtype):
        # `OneDnnProjections._gated` + the down projection, on weights packed the same way.
        pack, linear = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
        pg, pu = pack(gate_up[:FFN].contiguous()), pack(gate_up[FFN:].contiguous())
        pd = pack(down)

        def packed(x: torch.Tensor) -> torch.Tensor:
            gate = linear(x, pg, None, "swish", [], "")
            return linear(linear.binary(x, gate, pu, None, "mul"), pd, None, "none", [], "")

    compiled = torch.compile(mlp_plain, dynamic=True)
    out: dict[str, Any] = {}
    for rows in (8, 512):
        x = torch.randn(rows, D_MODEL, generator=g).to(dtype)
        row = {
            "plain_ms": timed(partial(mlp_plain, x, gate_up, down), reps),
            "compiled_plain_ms": timed(partial(compiled, x, gate_up, down), reps),
        }
        if packed is not None:
            row["packed_onednn_ms"] = timed(partial(packed, x), reps)
        out[f"rows{rows}"] = row
    return out


def engine_steps(dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    """The A/B in one process: the real model's decode step (batch 1 / 8 / 32, 512-token
    prompts) with the engine's decode attention and with SDPA in its place, alternated."""
    from engine.sampling import SamplingParams

    # Blocks for 32 x (512 + the steps): a preempted request would make steps mixed.
    eng = _engine(dtype, num_blocks=2048)
    vocab = eng.model_config.vocab_size
    variants = {"engine": decode_attention, "sdpa": sdpa_attention}

    def step_ms() -> float:
        eng.step()  # warm-up
        return timed(eng.step, 10)

    out: dict[str, Any] = {}
    for batch in (1, 8, 32):
        g = torch.Generator().manual_seed(batch)
        params = SamplingParams(max_tokens=2 * rounds * 12 + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            ids = torch.randint(100, vocab - 100, (512,), generator=g).tolist()
            eng.add_request(f"b{batch}-{i}", ids, params)
        while eng.scheduler.waiting:
            eng.step()
        out[f"b{batch}"] = _alternated("decode_attention", variants, step_ms, rounds)
        assert eng.scheduler.num_preemptions == 0, "the batch did not fit: steps were mixed"
        for r in list(eng.requests):
            eng.abort(r)
    return out


def prefill_steps(dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    """The A/B in one process: the real model's prompt pass (time to the first token of one
    512- and one 2048-token prompt, chunked as the engine's budget cuts it) with the engine's
    prefill attention and with SDPA in its place, alternated; a fresh prompt every time, so
    the prefix cache never serves one."""
    from engine.sampling import SamplingParams

    eng = _engine(dtype, num_blocks=1024)
    vocab = eng.model_config.vocab_size
    variants = {"engine": prefill_attention, "sdpa": sdpa_prefill_attention}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for length in (512, 2048):

        def first_token(length: int = length) -> None:
            ids = torch.randint(100, vocab - 100, (length,), generator=g).tolist()
            eng.add_request(f"p{length}-{time.monotonic_ns()}", ids, params)
            while eng.has_unfinished():
                eng.step()

        measure = partial(timed, first_token, 3)
        out[f"s{length}"] = _alternated("prefill_attention", variants, measure, rounds)
    return out


def _alternated(
    attr: str,
    variants: dict[str, Callable[..., torch.Tensor]],
    measure: Callable[[], float],
    rounds: int,
) -> dict[str, float]:
    """`measure` with `engine.model`'s kernel `attr` set to each of the two variants in turn
    ("engine", then "sdpa"; A B A B, `rounds` times): each one's median and their ratio. The
    engine's own kernel is put back whatever happens."""
    import engine.model as model_mod

    original = getattr(model_mod, attr)
    times: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for _ in range(rounds):
            for v, fn in variants.items():
                setattr(model_mod, attr, fn)
                times[v].append(measure())
    finally:
        setattr(model_mod, attr, original)
    med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    return {"engine_ms": med["engine"], "sdpa_ms": med["sdpa"],
            "engine_over_sdpa": med["engine"] / med["sdpa"]}  # fmt: skip


def _engine(dtype: torch.dtype, num_blocks: int) -> Any:
    """The real default model in an engine of `num_blocks` KV blocks."""
    from engine.config import CacheConfig
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.models import DEFAULT_MODEL, resolve_model

    name = str(dtype).removeprefix("torch.")
    model = str(resolve_model(DEFAULT_MODEL, dtype="float32"))
    cfg = EngineConfig(model=model, dtype=name, cache=CacheConfig(num_blocks=num_blocks))
    return LLMEngine.from_config(cfg)


COMPILE_SNIPPET = """
import sys, time, torch
import importlib.util
sys.path.insert(0, sys.argv[1])
path = sys.argv[1] + "/benchmarks/kernel_options.py"  # by path: benchmarks/ is no package
spec = importlib.util.spec_from_file_location("bench_kernels", path)
kernels = importlib.util.module_from_spec(spec); spec.loader.exec_module(kernels)
dtype = getattr(torch, sys.argv[2]); which = sys.argv[3]
torch.set_num_threads(int(sys.argv[4]))
t = time.perf_counter()
if which == "decode":
    q, k, v, mask = kernels.decode_case(8, dtype)
    torch.compile(kernels.decode_attention, dynamic=True)(q, k, v, mask, 0.125)
elif which == "prefill":
    q = torch.randn(9, 512, 64).to(dtype); k = torch.randn(3, 512, 64).to(dtype)
    torch.compile(kernels.matmul_prefill, dynamic=True)(q, k, k)
else:
    x = torch.randn(8, kernels.D_MODEL).to(dtype)
    gu = torch.randn(2 * kernels.FFN, kernels.D_MODEL).to(dtype)
    dn = torch.randn(kernels.D_MODEL, kernels.FFN).to(dtype)
    torch.compile(kernels.mlp_plain, dynamic=True)(x, gu, dn)
print(time.perf_counter() - t)
"""


def compile_costs(dtype: str, threads: int) -> dict[str, Any]:
    """Seconds to the first result of each compiled variant in a fresh process: with the
    inductor caches empty, then warm (as a restart with a kept cache dir would find them)."""
    out: dict[str, Any] = {}
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(CACHE / dtype))
    for which in ("decode", "prefill", "mlp"):
        subprocess.run(["rm", "-rf", str(CACHE / dtype)], check=True)
        secs: list[float | None] = []
        for _ in ("cold", "warm"):
            proc = subprocess.run(
                [sys.executable, "-c", COMPILE_SNIPPET, str(ROOT), dtype, which, str(threads)],
                env=env, capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            if proc.returncode != 0:
                secs.append(None)
                out[f"{which}_error"] = proc.stderr.strip().splitlines()[-1][:300]
            else:
                secs.append(round(float(proc.stdout.strip().splitlines()[-1]), 2))
        out[which] = {"cold_s": secs[0], "warm_cache_s": secs[1]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu.has_bf16_hardware() else [])
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu.describe(),
        "threads": args.threads,
        "torch": torch.__version__,
        "dtypes": {},
    }
    with tqdm(total=4 * len(dtypes), desc="kernels") as bar:
        for dt in dtypes:
            name = str(dt).removeprefix("torch.")
            row: dict[str, Any] = {}
            for what, fn in (("decode_attention", decode_rows), ("prefill_attention", prefill_rows),
                             ("mlp", mlp_rows)):  # fmt: skip
                bar.set_postfix_str(f"{name} {what}")
                row[what] = fn(dt, args.reps)
                bar.update()
            bar.set_postfix_str(f"{name} decode step A/B")
            row["decode_step"] = engine_steps(dt, 3)
            bar.set_postfix_str(f"{name} prompt pass A/B")
            row["prefill_step"] = prefill_steps(dt, 3)
            bar.set_postfix_str(f"{name} compile costs")
            row["compile"] = compile_costs(name, args.threads)
            bar.update()
            result["dtypes"][name] = row
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
