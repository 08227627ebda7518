"""`pdserve profile`: this machine's costs for one model, measured, fitted and written as JSON.

For each worker size (threads, pinned to that many cores) it times the real engine on a
grid of batch shapes (`pdserve.plan.measure`) and fits the step-time model
(`pdserve.plan.stepmodel`) on the `FIT` grid alone; the `HELD_OUT` grid, fixed here in
advance and never fitted, scores it (validation lane A: the mean absolute percentage error,
MAPE, with n). A residual plot per worker size goes beside the JSON.

The profile also carries what the simulator needs besides step times: the KV bytes per block
(what a transfer moves), the block size, and the KV pool of one worker as `pdserve serve`
sizes it.

What must hold: the held-out shapes differ from every fitted one, so lane A's error is an
error on shapes the fit never saw; both grids are measured in one interleaved run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from pdserve.plan.measure import Driver, Sample, Scenario, measure, pinned
from pdserve.plan.stepmodel import StepModel, ape, fit, mape
from pdserve.plan.transfer import FIT as TR_FIT
from pdserve.plan.transfer import HELD_OUT as TR_HELD
from pdserve.plan.transfer import QUICK_FIT as QUICK_TR_FIT
from pdserve.plan.transfer import QUICK_HELD_OUT as QUICK_TR_HELD
from pdserve.plan.transfer import REPEATS_PER_STEP_REPEAT as TR_REPEATS
from pdserve.plan.transfer import profile_transfer

PROFILE_VERSION = 1


def _prefill(*chunks: tuple[int, int]) -> Scenario:
    return Scenario("prefill", chunks=chunks)


def _decode(batch: int, ctx: int) -> Scenario:
    return Scenario("decode", batch=batch, ctx=ctx, steps=5)


def _mixed(batch: int, ctx: int, chunk: int) -> Scenario:
    return Scenario("mixed", batch=batch, ctx=ctx, chunk=chunk)


FIT: tuple[Scenario, ...] = (
    *(_prefill((n, 0)) for n in (32, 128, 512, 1024, 2048)),
    *(_prefill((n, c)) for n in (64, 512) for c in (512, 1536)),
    _prefill(*[(256, 0)] * 4),
    _prefill(*[(128, 0)] * 8),
    *(_decode(b, c) for b in (1, 4, 16, 32) for c in (128, 1024)),
    *(_mixed(b, 512, n) for b in (4, 16) for n in (256, 1024)),
)
"""The shapes the step-time model is fitted on."""

HELD_OUT: tuple[Scenario, ...] = (
    *(_prefill((n, 0)) for n in (64, 256, 768, 1536)),
    _prefill((256, 1024)),
    _prefill((1024, 512)),
    _prefill(*[(512, 0)] * 2),
    _prefill(*[(64, 0)] * 6),
    *(_decode(b, c) for b in (2, 8, 24) for c in (256, 768)),
    _mixed(8, 256, 512),
    _mixed(24, 768, 128),
)
"""The shapes that score it (lane A), fixed before any fit: never fitted."""

QUICK_FIT: tuple[Scenario, ...] = (
    *(_prefill((n, 0)) for n in (32, 256, 1024)),
    _prefill((64, 512)),
    _prefill(*[(128, 0)] * 4),
    *(_decode(b, c) for b in (1, 8) for c in (128, 768)),
    _mixed(4, 256, 256),
)
"""`--quick`: a smaller grid (tests, a first look); its errors are reported the same way."""

QUICK_HELD_OUT: tuple[Scenario, ...] = (
    _prefill((512, 0)),
    _prefill((128, 256)),
    _decode(4, 384),
    _mixed(2, 128, 512),
)


def worker_sizes(arg: str | None) -> list[int]:
    """`--threads 1,2`; default: 1 and every core this process may use (a split worker and
    a whole-host one)."""
    if arg:
        sizes = sorted({int(x) for x in arg.split(",") if x.strip()})
        if not sizes or sizes[0] < 1:
            raise ValueError("--threads: positive integers, e.g. 1,2")
        return sizes
    cores = len(os.sched_getaffinity(0))
    return sorted({1, cores})


def _engine(model_dir: str, dtype: str, threads: int, budget: int, blocks: int) -> Any:
    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine.from_config(
        EngineConfig(
            model=model_dir,
            dtype=dtype,
            num_threads=threads,
            cache=CacheConfig(num_blocks=blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64),
        )
    )


def _serving_pool_blocks() -> int:
    """The KV blocks one worker of `pdserve serve` gets with its default settings."""
    from pdserve.config import ServeConfig

    return int(ServeConfig.load().cache.num_blocks)


def transports_to_time(arg: str | None) -> list[str]:
    """`--transports`: the ones named (the first is the one the plan uses); default: the
    serving config's transport, then the other cross-process ones; "none": none."""
    from kv_transfer.registry import TRANSPORT_NAMES
    from pdserve.config import ServeConfig
    from pdserve.plan.transfer import TRANSPORTS

    if arg is None:
        served = str(ServeConfig.load().transfer.transport)
        return [served, *(t for t in TRANSPORTS if t != served)]
    if arg.strip() == "none":
        return []
    names = [x.strip() for x in arg.split(",") if x.strip()]
    bad = [n for n in names if n not in TRANSPORT_NAMES or n == "local"]
    if bad or not names:
        raise ValueError(f"--transports: {bad or arg!r}: choose from {', '.join(TRANSPORTS)}")
    return list(dict.fromkeys(names))


def _samples_json(samples: list[Sample], model: StepModel) -> list[dict[str, Any]]:
    return [
        {
            **x.shape.to_json(),
            "scenario": x.scenario,
            "kind": x.shape.kind,
            "measured_ms": round(x.seconds * 1e3, 3),
            "spread_pct": round(x.spread * 100, 1),
            "predicted_ms": round(model.predict(x.shape) * 1e3, 3),
        }
        for x in samples
    ]


def _errors(samples: list[Sample], model: StepModel) -> dict[str, Any]:
    predicted = [model.predict(x.shape) for x in samples]
    errs = ape(predicted, [x.seconds for x in samples])
    by_kind: dict[str, list[float]] = {}
    for x, e in zip(samples, errs, strict=True):
        by_kind.setdefault(x.shape.kind, []).append(e)
    return {
        "n": len(samples),
        "mape": round(
            mape([model.predict(x.shape) for x in samples], [x.seconds for x in samples]), 2
        ),
        "max_ape": round(max(errs), 2) if errs else None,
        # the machine's own noise on these shapes (repeats' IQR / median, mean over shapes):
        # no model of step time can be reliably more accurate than this
        "noise_pct": round(100 * sum(x.spread for x in samples) / len(samples), 2)
        if samples
        else None,
        "by_kind": {
            k: {"n": len(v), "mape": round(sum(v) / len(v), 2)} for k, v in by_kind.items()
        },
    }


def profile_worker(
    model_dir: str, dtype: str, threads: int, quick: bool, repeats: int, progress: Any
) -> dict[str, Any]:
    """Fit and score the step-time model for a worker of `threads` threads."""
    fit_grid, held_grid = (QUICK_FIT, QUICK_HELD_OUT) if quick else (FIT, HELD_OUT)
    with pinned(threads) as cores:
        engine = _engine(model_dir, dtype, threads, budget=4096, blocks=4096)
        driver = Driver(engine, seed=threads)
        measure(driver, fit_grid[:3], 1)  # warm-up: the first steps of a process are slow
        # both grids in one interleaved run: a drift of the machine's speed (these hosts
        # drift by 20 %) falls on fitted and held-out shapes alike
        samples = measure(driver, fit_grid + held_grid, repeats, progress)
        held_labels = {s.label for s in held_grid}
        fitted = [x for x in samples if x.scenario not in held_labels]
        held = [x for x in samples if x.scenario in held_labels]
        info = {
            "block_size": engine.cache_config.block_size,
            "kv_bytes_per_block": engine.stats().kv_bytes_per_block,
            "kv_dtype": engine.cache.spec.dtype,
            "kernels": engine.kernel_selection.line(),
        }
        del driver, engine
        gc.collect()
    model = fit([x.shape for x in fitted], [x.seconds for x in fitted])
    return {
        "threads": threads,
        "cores": cores,
        **info,
        "step_model": model.to_json(),
        "fit": _errors(fitted, model),
        "held_out": _errors(held, model),
        "samples": {"fit": _samples_json(fitted, model), "held_out": _samples_json(held, model)},
    }


def plot_residuals(profile: dict[str, Any], path: Path) -> None:
    """Measured against predicted step time, per worker size, fit and held-out apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = profile["workers"]
    transfer = (profile.get("transfer") or {}).get("transports") or {}
    panels = len(workers) + (1 if transfer else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.8), squeeze=False)
    for ax, (size, w) in zip(axes[0], workers.items(), strict=False):
        for split, marker in (("fit", "o"), ("held_out", "x")):
            for kind, color in (("prefill", "C0"), ("decode", "C1"), ("mixed", "C2")):
                rows = [s for s in w["samples"][split] if s["kind"] == kind]
                if rows:
                    _residuals(ax, rows, marker, color, f"{kind} ({split.replace('_', '-')})")
        ho = w["held_out"]
        _axes(ax, "step", f"{size} thread(s): held-out MAPE {ho['mape']}% (n={ho['n']})")
    if transfer:
        ax = axes[0][-1]
        for i, (name, t) in enumerate(transfer.items()):
            for split, marker in (("fit", "o"), ("held_out", "x")):
                label = f"{name} ({split.replace('_', '-')})"
                _residuals(ax, t["samples"][split], marker, f"C{i + 3}", label)
        _axes(
            ax,
            "transfer",
            "KV transfer, held-out MAPE "
            + ", ".join(f"{n} {t['held_out']['mape']}%" for n, t in transfer.items()),
        )
    fig.suptitle(f"{profile['model_name']} {profile['dtype']}, {profile['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _residuals(ax: Any, rows: list[dict[str, Any]], marker: str, color: str, label: str) -> None:
    ax.scatter(
        [r["measured_ms"] for r in rows],
        [(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] * 100 for r in rows],
        marker=marker,
        color=color,
        label=label,
    )


def _axes(ax: Any, what: str, title: str) -> None:
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(f"measured {what} time (ms)")
    ax.set_ylabel("predicted - measured (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def write_device_profile(args: argparse.Namespace) -> int:
    """`pdserve profile --device D`: an unmeasured extrapolation (`pdserve.plan.device`)."""
    from engine.config import ModelConfig
    from pdserve.models import resolve_model
    from pdserve.plan.device import GEOMETRIES, device_profile

    config = None
    if args.model not in GEOMETRIES:
        config = ModelConfig.from_hf(resolve_model(args.model, seed=args.weights_seed))
    profile = device_profile(args.device, args.model, config)
    profile["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(
        f"pdserve: wrote {out}: {profile['cpu']}, {args.model}, extrapolated from the published "
        f"roofline (unmeasured; assumptions in the file)"
    )
    return 0


def run_profile(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from engine.config import ModelConfig
    from engine.cpu import identity
    from pdserve.models import require_tokenizer, resolve_model

    if args.device:
        return write_device_profile(args)
    path = resolve_model(args.model, seed=args.weights_seed, revision=args.revision)
    require_tokenizer(path, args.model)
    sizes = worker_sizes(args.threads)
    transports = transports_to_time(args.transports)
    grids = (QUICK_FIT + QUICK_HELD_OUT) if args.quick else (FIT + HELD_OUT)
    tr_sizes = len(QUICK_TR_FIT + QUICK_TR_HELD) if args.quick else len(TR_FIT + TR_HELD)
    bar = tqdm(
        total=(len(grids) * len(sizes) + tr_sizes * len(transports) * TR_REPEATS) * args.repeats,
        desc="profile",
        file=sys.stderr,
    )

    def progress(what: str) -> None:
        bar.set_postfix_str(what[:40])
        bar.update()

    workers = {}
    for t in sizes:
        workers[str(t)] = profile_worker(
            str(path), args.dtype, t, args.quick, args.repeats, progress
        )
    first = next(iter(workers.values()))
    transfer = profile_transfer(
        ModelConfig.from_hf(path),
        first["kv_dtype"],
        first["block_size"],
        first["kv_bytes_per_block"],
        transports,
        args.quick,
        args.repeats * TR_REPEATS,
        progress,
    )
    bar.close()
    profile: dict[str, Any] = {
        "version": PROFILE_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": str(path),
        "model_name": args.model,
        "dtype": args.dtype,
        "cpu": identity(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "cpu",
        "measured": True,
        "block_size": first["block_size"],
        "kv_bytes_per_block": first["kv_bytes_per_block"],
        "pool_blocks": _serving_pool_blocks(),
        "workers": workers,
        "transfer": {
            "transports": transfer,
            # what the plan uses: the first transport timed (the serving config's by default)
            "chosen": {"transport": transports[0], **transfer[transports[0]]}
            if transports
            else None,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    plot = out.with_suffix(".png")
    plot_residuals(profile, plot)
    for size, w in workers.items():
        f, h = w["fit"], w["held_out"]
        print(
            f"{size} thread(s): fit MAPE {f['mape']}% (n={f['n']}), "
            f"held-out MAPE {h['mape']}% (n={h['n']}, max {h['max_ape']}%); "
            f"the machine's noise on them {h['noise_pct']}%"
        )
    for name, r in transfer.items():
        h = r["held_out"]
        print(
            f"transfer {name}: α {r['alpha_s'] * 1e3:.2f} ms, "
            f"β {r['beta_bytes_per_s'] / 1e9:.2f} GB/s; "
            f"held-out MAPE {h['mape']}% (n={h['n']}, max {h['max_ape']}%); "
            f"the machine's noise on them {h['noise_pct']}%"
        )
    print(f"pdserve: wrote {out} and {plot}")
    return 0
