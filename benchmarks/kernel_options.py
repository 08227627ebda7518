#!/usr/bin/env python
"""Which kernels this machine chooses, whether the choice is right, and what it buys.

Run: ``.venv/bin/python benchmarks/kernel_options.py`` (``make bench-kernels``). On this CPU
(named, with its flags, in every result), in float32 and, where the CPU does bf16 in
hardware, bfloat16, with every core:

* **the selection** (`engine.kernels.select`) made fresh, with batch invariance on and off:
  each op's candidates with their times at the model's shapes, and the choice;
* **the check**: every candidate the selection could choose is timed again, alternated, for
  `CHECK_S` seconds per op; the run **exits 1** when an automatic choice is more than
  `MAX_LOSS` (10%) slower than the fastest candidate beyond the check's own noise (two
  standard errors of the difference of the medians: a near-tie the check cannot resolve
  on a noisy machine is reported, not failed);
* **the A/Bs on the real model** (SmolLM2-135M): the prompt pass (a 512- and a 2048-token
  prompt) and the decode step (batch 1 / 8 / 32 over 512-token prompts), alternated in one
  process between the kernel sets: `invariant` (the automatic choice with batch invariance
  on, the default), `fast` (the automatic choice with it off) and `reference` (torch's own
  kernels: SDPA and plain `F.linear`).

Results: ``benchmarks/results/kernels-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine import native  # noqa: E402
from engine.kernels import (  # noqa: E402
    KernelSet,
    candidate,
    workloads,
)
from engine.kernels import select as selection  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "kernels-latest.json"
CHECK_S = 3.0
MAX_LOSS = 0.10


def _engine(dtype: torch.dtype, num_blocks: int, invariant: bool) -> Any:
    """The real default model in an engine of `num_blocks` KV blocks, kernels chosen here."""
    from engine.config import CacheConfig
    from engine.engine import EngineConfig, LLMEngine
    from pdserve.models import DEFAULT_MODEL, resolve_model

    name = str(dtype).removeprefix("torch.")
    model = str(resolve_model(DEFAULT_MODEL, dtype="float32"))
    cfg = EngineConfig(
        model=model,
        dtype=name,
        cache=CacheConfig(num_blocks=num_blocks),
        batch_invariant=invariant,
        keep_plain_weights=True,  # every kernel set's projections are built from them
    )
    return LLMEngine.from_config(cfg)


def fresh_selection(eng: Any, invariant: bool) -> selection.Selection:
    """The selection made now, in an empty cache (never a cached file)."""
    with tempfile.TemporaryDirectory() as d:
        return selection.select(
            eng.model_config, eng.runner.model.w, "auto", invariant, cache_dir=Path(d)
        )


def check_choice(eng: Any, sel: selection.Selection, invariant: bool) -> dict[str, Any]:
    """Every candidate the selection could choose, timed again for `CHECK_S` per op; the
    choice's loss against the fastest."""
    cfg, w = eng.model_config, eng.runner.model.w
    dtype, dev = w.embed.dtype, w.embed.device
    out: dict[str, Any] = {}
    for op, timing in sel.timings.items():
        eligible = [n for n, ms in timing.median_ms.items() if ms is not None]
        if len(eligible) < 2:
            continue
        bench = workloads.BENCHES[op](cfg, w, dtype, dev, torch.Generator().manual_seed(1))
        floors = {n: bench.probe(candidate(op, n))[1] if invariant else {} for n in eligible}
        fns = {n: bench.run(candidate(op, n), floors[n]) for n in eligible}
        samples: dict[str, list[float]] = {n: [] for n in fns}
        deadline = time.perf_counter() + CHECK_S
        while time.perf_counter() < deadline or len(samples[eligible[0]]) < 10:
            for n, fn in fns.items():
                t = time.perf_counter()
                fn()
                samples[n].append((time.perf_counter() - t) * 1e3)
        med = {n: statistics.median(s) for n, s in samples.items()}
        fastest = min(med, key=lambda n: med[n])
        loss = med[timing.chosen] / med[fastest] - 1
        err = selection.median_error
        noise = 2 * math.hypot(err(samples[timing.chosen]), err(samples[fastest])) / med[fastest]
        out[op] = {"chosen": timing.chosen, "fastest": fastest, "median_ms": med, "loss": loss,
                   "noise": noise, "wrong": loss - noise > MAX_LOSS}  # fmt: skip
    return out


def _alternated(
    eng: Any, variants: dict[str, tuple[KernelSet, Any]], measure: Callable[[], float], rounds: int
) -> dict[str, float]:
    """`measure` under each kernel set in turn (A B C A B C ..., `rounds` times): medians."""
    model = eng.runner.model
    original = (model.kernels, model.proj)
    times: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for _ in range(rounds):
            for v, (ks, proj) in variants.items():
                model.set_kernels(ks, proj)
                times[v].append(measure())
    finally:
        model.set_kernels(*original)
    return {v: statistics.median(t) for v, t in times.items()}


def timed(fn: Callable[[], Any], reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def prompt_passes(eng: Any, variants: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Time to the first token of a fresh 512- and 2048-token prompt (no cache hit)."""
    from engine.sampling import SamplingParams

    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    out = {}
    for length in (512, 2048):

        def first_token(length: int = length) -> None:
            ids = torch.randint(100, vocab - 100, (length,), generator=g).tolist()
            eng.add_request(f"p{length}-{time.monotonic_ns()}", ids, params)
            while eng.has_unfinished():
                eng.step()

        measure: Callable[[], float] = partial(timed, first_token, 2)
        out[f"prompt{length}"] = _alternated(eng, variants, measure, rounds)
    return out


def decode_steps(eng: Any, variants: dict[str, Any], rounds: int) -> dict[str, Any]:
    """One decode step of a batch of 1 / 8 / 32 requests with 512-token prompts."""
    from engine.sampling import SamplingParams

    vocab = eng.model_config.vocab_size
    out = {}
    for batch in (1, 8, 32):
        g = torch.Generator().manual_seed(batch)
        steps = rounds * len(variants) * 12 + 8
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            ids = torch.randint(100, vocab - 100, (512,), generator=g).tolist()
            eng.add_request(f"b{batch}-{i}", ids, params)
        while eng.scheduler.waiting:
            eng.step()
        out[f"decode_b{batch}"] = _alternated(eng, variants, lambda: timed(eng.step, 10), rounds)
        assert eng.scheduler.num_preemptions == 0, "the batch did not fit: steps were mixed"
        for r in list(eng.requests):
            eng.abort(r)
    return out


def run_dtype(dtype: torch.dtype, rounds: int, bar: tqdm) -> dict[str, Any]:
    name = str(dtype).removeprefix("torch.")
    eng = _engine(dtype, num_blocks=2048, invariant=True)
    row: dict[str, Any] = {"startup": eng.kernel_selection.line()}
    sets: dict[str, KernelSet] = {}
    for invariant, label in ((True, "invariant"), (False, "fast")):
        bar.set_postfix_str(f"{name}: selection, {label}")
        sel = fresh_selection(eng, invariant)
        sets[label] = sel.kernels
        row[f"selection_{label}"] = {"line": sel.line(), "seconds": sel.seconds,
                                     "kernels": sel.kernels.as_dict()}  # fmt: skip
        bar.set_postfix_str(f"{name}: check, {label}")
        row[f"check_{label}"] = check_choice(eng, sel, invariant)
        bar.update()
    sets["reference"] = KernelSet.reference()
    w, act = eng.runner.model.w, eng.model_config.hidden_act
    variants = {k: (ks, ks.make_projections(w, act)) for k, ks in sets.items()}
    bar.set_postfix_str(f"{name}: prompt pass A/B")
    row["ab"] = prompt_passes(eng, variants, rounds)
    bar.update()
    bar.set_postfix_str(f"{name}: decode step A/B")
    row["ab"].update(decode_steps(eng, variants, rounds))
    bar.update()
    return row


def report(result: dict[str, Any]) -> list[str]:
    """The tables people read, and the failures (an automatic choice > MAX_LOSS slower)."""
    failures = []
    print(f"\nCPU: {result['cpu']}, {result['threads']} threads, torch {result['torch']}")
    for name, row in result["dtypes"].items():
        print(f"\n{name}: {row['startup']}")
        for label in ("invariant", "fast"):
            print(f"  selection ({label}): {row[f'selection_{label}']['line']}")
            for op, c in row[f"check_{label}"].items():
                verdict = "WRONG" if c["wrong"] else "ok"
                loss = f"{100 * c['loss']:+.1f}% +- {100 * c['noise']:.1f}%"
                print(f"    check {op}: chose {c['chosen']}, fastest {c['fastest']}, "
                      f"loss {loss} {verdict}")  # fmt: skip
                if c["wrong"]:
                    failures.append(f"{name} {label} {op}: {c}")
        labels = ("invariant", "fast", "reference")
        print(f"  {'A/B (ms)':<14}" + "".join(f"{v:>12}" for v in labels))
        for what, ms in row["ab"].items():
            cells = "".join(f"{ms[v]:>12.1f}" for v in ("invariant", "fast", "reference"))
            print(f"  {what:<14}{cells}   invariant/fast {ms['invariant'] / ms['fast']:.2f}x")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine import cpu

    dtypes = [torch.float32] + ([torch.bfloat16] if cpu.has_bf16_hardware() else [])
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu.identity(),
        "capability": cpu.describe(),
        "threads": args.threads,
        "torch": torch.__version__,
        "native_kernels": "built" if native.load() else native.why_not(),
        "dtypes": {},
    }
    with tqdm(total=4 * len(dtypes), desc="kernels") as bar:
        for dt in dtypes:
            result["dtypes"][str(dt).removeprefix("torch.")] = run_dtype(dt, args.rounds, bar)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    failures = report(result)
    for f in failures:
        print(f"FAIL: an automatic choice is more than {MAX_LOSS:.0%} slower than the fastest, "
              f"beyond the noise: {f}")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
