"""Choose each op's kernel by timing its candidates on the machine that serves.

Why: which kernel is fastest depends on the CPU (AMX, AVX512-BF16, AVX2), the torch build,
the dtype, the thread count and the model's shapes; a choice measured on one CPU is a guess
on another (docs/benchmarks.md, "Kernels chosen by measurement"). So at start-up each op's
candidates (`engine.kernels.OPS`) run on random inputs of the model's own shapes:

- each is first checked against a float64 evaluation of the same math; a candidate whose
  relative error exceeds its dtype's tolerance is never chosen;
- then timed in alternating rounds (A B A B ...), medians compared (one beaten beyond any
  noise after a few rounds is timed no more); a candidate wins only
  by more than twice the standard error of the difference plus `MARGIN`, else the simpler
  one (listed first) stays;
- the measurement holds a host-wide lock (`fcntl.flock`), so workers starting together do
  not time each other's load, and is cached on disk under ``~/.cache/pdserve/kernels``
  (``$PDSERVE_KERNELS_DIR``), keyed
  by CPU model and flags, torch version, dtype, device, thread count and shapes: a restart
  reads the file and measures nothing;
- a measurement taken on a busy host (other processes' load, which the lock cannot keep
  out) is noisy: an op whose medians' standard error exceeds `NOISY` of the fastest median,
  and whose fastest candidate does not win beyond that noise, is timed for longer, and if
  it stays so its fastest median wins (a tie "within the noise" would then hand the op to
  the simplest candidate, 2-3x slower: the suite's parallel workers cached such choices).
  Such a choice is cached for `PROVISIONAL_S` only (the workers of one deployment starting
  together share it), then measured again. A fastest candidate that wins beyond the noise
  is a settled choice, however busy the host.

With batch invariance on (the default), a candidate must also pass an invariance probe
before it is timed: a row's bits may not depend on the rows computed with it (a batch's
other requests, a chunk's or a cached prefix's boundaries). Attention rows are compared
bit for bit between a whole prompt and its tails and chunks, and a decode row between a
batch and alone; for the projections the probe finds, per GEMM, the row count from which a
row's result no longer changes (`Projections.row_floors`), and smaller calls are padded to
it. An op without an invariant candidate falls back to the fastest, and the selection says
that invariance is off.

What must hold: the choice is one of the candidates that apply (`Candidate.applies`), and a
single applicable candidate is taken without timing (a GPU has one of each today).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import kernel_spec
from engine.config import ModelConfig
from engine.host_lock import host_lock
from engine.kernels import OPS, Candidate, KernelSet, candidate, candidates
from engine.kernels.workloads import BENCHES, Bench
from engine.model_weights import ModelWeights
from engine.native import build_dir, cpu_identity, default_cache_dir

log = logging.getLogger(__name__)

MARGIN = 0.02
"""A faster candidate must win by this fraction (plus the noise) to displace a simpler one."""
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Relative error (Frobenius norm) a candidate may show against float64."""
BUDGET_S = 0.6
"""Timing time per op, after the warm-up; `MIN_ROUNDS` rounds are run whatever it costs."""
MIN_ROUNDS, MAX_ROUNDS = 7, 25
DECIDE_ROUNDS, DECISIVE = 3, 1.5
"""After `DECIDE_ROUNDS` rounds, a candidate whose fastest round is `DECISIVE` times another's
median round is dropped from the timing (`_beaten`)."""
NOISY = 0.10
"""An op whose largest median standard error exceeds this fraction of the fastest median was
measured on a busy host: its fastest median wins, and the choice is provisional."""
NOISY_BUDGET_S, NOISY_MAX_ROUNDS = 2.0, 60
"""A noisy op is timed on up to this long in all, this many rounds, to quieten."""
PROVISIONAL_S = 600.0
"""How long a noisy choice is read from the cache before the next start measures again."""
WARMUP = 3
CACHE_VERSION = 4  # 4: noisy choices are provisional (older files may hold noisy ones)


@dataclass
class OpTiming:
    """One op's measurement: each candidate's median ms (None: not eligible, `why` says)."""

    chosen: str
    median_ms: dict[str, float | None] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)  # relative error vs float64
    why: dict[str, str] = field(default_factory=dict)  # why a candidate was not eligible
    noise_ms: float = 0.0  # the largest standard error of a candidate's median
    row_floors: dict[str, int] = field(default_factory=dict)  # the chosen's (projections)
    invariant: bool = False  # the chosen passed its invariance probe
    noisy: bool = False  # measured on a busy host (`NOISY`): the fastest median won

    @property
    def noise_fraction(self) -> float:
        """The noise against the fastest median (0 with fewer than two timed)."""
        timed = [ms for ms in self.median_ms.values() if ms is not None]
        return self.noise_ms / min(timed) if len(timed) > 1 and min(timed) > 0 else 0.0


@dataclass
class Selection:
    """What `select` decided, and how (`source`: measured | cache | named | single)."""

    kernels: KernelSet
    source: str
    timings: dict[str, OpTiming] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""  # what limited the choice (no invariant kernel, no pdserve kernels)
    written: float = 0.0  # when it was cached (time.time()), for a provisional choice's age

    @property
    def noisy(self) -> bool:
        """Some op was measured on a busy host: the choice is provisional (`PROVISIONAL_S`)."""
        return any(t.noisy for t in self.timings.values())

    def line(self) -> str:
        """One line for the startup log: each op's choice and every candidate's time."""
        parts = []
        for op, name in self.kernels.as_dict().items():
            t = self.timings.get(op)
            if t is None or len(t.median_ms) < 2:
                parts.append(f"{op}={name}")
                continue
            times = ", ".join(
                f"{c} {t.why.get(c, 'ineligible') if ms is None else f'{ms:.2f} ms'}"
                for c, ms in t.median_ms.items()
            )
            parts.append(f"{op}={name} ({times})")
        how = {"measured": f"measured in {self.seconds:.1f} s", "cache": "from the cache"}
        inv = "batch-invariant" if self.kernels.batch_invariant else "not batch-invariant"
        notes = [self.note] if self.note else []
        if self.noisy:
            worst = max(t.noise_fraction for t in self.timings.values())
            notes.append(
                f"measured on a busy host, noise up to {worst:.0%} of a median: the fastest "
                f"medians taken, measured again after {PROVISIONAL_S / 60:.0f} min"
            )
        note = f" ({'; '.join(notes)})" if notes else ""
        return f"kernels {how.get(self.source, self.source)}, {inv}{note}: " + "; ".join(parts)


# ---- the spec a user gives ----------------------------------------------------------------
def parse_spec(spec: str, invariant: bool = False) -> dict[str, str]:
    """`engine.kernel_spec.parse_spec`, with ``reference`` resolved to the simplest
    candidate of every op offered with invariance on or off."""
    fixed = kernel_spec.parse_spec(spec)
    return KernelSet.reference(invariant).as_dict() if fixed is None else fixed


# ---- the selection ------------------------------------------------------------------------
def select(
    cfg: ModelConfig,
    weights: ModelWeights,
    spec: str = "auto",
    invariant: bool = True,
    cache_dir: Path | None = None,
) -> Selection:
    """Each op's kernel for this model on this machine (module docstring). A named kernel
    (`spec`) is taken as named; with invariance on it is still probed. Where some op has no
    invariant candidate, the selection is made again with invariance off (nothing would buy
    it), and its line says why. Off the CPU, invariance is not offered (no GPU kernel of
    ours keeps it yet)."""
    device, dtype = weights.embed.device, weights.embed.dtype
    invariant = invariant and device.type == "cpu"
    fixed = parse_spec(spec, invariant)
    for op, name in fixed.items():
        if not candidate(op, name).applies(device, dtype):
            raise ValueError(
                f"kernels: {op}={name} does not run on {device} in "
                f"{str(dtype).removeprefix('torch.')} (choose from "
                f"{[c.name for c in candidates(op, device, dtype, invariant)]})"
            )
    pools = _pools(fixed, device, dtype, invariant)
    if device.type != "cpu" or not any(len(p) > 1 or invariant for p in pools.values()):
        single = {op: pool[0].name for op, pool in pools.items()}  # nothing to choose
        return Selection(KernelSet.of(single), "named" if fixed else "single")
    names = {op: [c.name for c in pool] for op, pool in pools.items()}
    key = cache_key(cfg, device, dtype, names, invariant)
    path = (cache_dir or default_cache_dir()) / f"{_digest(key)}.json"
    cached = _read(path, key)
    if cached is None:
        with host_lock(path.parent / ".lock"):
            cached = _read(path, key)  # another worker may have measured while we waited
            if cached is None:
                cached = _measure(cfg, weights, pools, invariant)
                if invariant and not cached.kernels.batch_invariant:
                    lacking = [op for op, t in cached.timings.items() if not t.invariant]
                    cached = _measure(cfg, weights, _pools(fixed, device, dtype, False), False)
                    why = f"no batch-invariant {' or '.join(lacking)} on this machine"
                    cached.note = "; ".join(filter(None, (why, cached.note)))
                _write(path, key, cached)
    return cached


def _pools(
    fixed: dict[str, str], device: torch.device, dtype: torch.dtype, invariant: bool
) -> dict[str, list[Candidate]]:
    """Each op's candidates to choose from: the named one, or all that are offered."""
    return {
        op: [candidate(op, fixed[op])] if op in fixed else candidates(op, device, dtype, invariant)
        for op in OPS
    }


def _measure(
    cfg: ModelConfig, weights: ModelWeights, pools: dict[str, list[Candidate]], invariant: bool
) -> Selection:
    start = time.perf_counter()
    device, dtype = weights.embed.device, weights.embed.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    timings = {}
    for op, pool in pools.items():
        bench = BENCHES[op](cfg, weights, dtype, device, gen)
        timings[op] = _time_op(pool, bench, dtype, invariant)
    kernels = KernelSet.of(
        {op: t.chosen for op, t in timings.items()},
        timings["projections"].row_floors,
        batch_invariant=invariant and all(t.invariant for t in timings.values()),
    )
    note = _native_note() if dtype == torch.bfloat16 else ""  # they are bf16 kernels
    return Selection(kernels, "measured", timings, time.perf_counter() - start, note)


def _native_note() -> str:
    """Why pdserve's own kernels are not among the candidates ('' when they are)."""
    from engine import native

    return "" if native.load() is not None else f"pdserve kernels unavailable: {native.why_not()}"


def _time_op(pool: list[Candidate], bench: Bench, dtype: torch.dtype, invariant: bool) -> OpTiming:
    want = bench.reference()
    fns, errors, why, floors, probed = {}, {}, {}, {}, {}
    for c in pool:
        problem, floors[c.name] = bench.probe(c) if invariant else (None, {})
        probed[c.name] = problem is None
        if problem is not None and len(pool) > 1:
            why[c.name] = problem
            continue
        fn = bench.run(c, floors[c.name])
        got = fn()  # also the first warm-up
        errors[c.name] = max(_rel_error(g, w) for g, w in zip(got, want, strict=True))
        if errors[c.name] > TOLERANCE.get(dtype, 1e-4) and len(pool) > 1:
            why[c.name] = f"error {errors[c.name]:.1e}"
            continue
        fns[c.name] = fn
        for _ in range(WARMUP):  # first calls fault in fresh buffers and JIT brgemm kernels
            fn()
    if not fns:  # nothing invariant: the fastest of all, and the selection says so
        log.warning("kernels: no batch-invariant candidate passed (%s)", why)
        return _time_op(pool, bench, dtype, False)
    medians, errors_ms = _alternate(fns)
    chosen, noisy = _choose([c.name for c in pool if c.name in medians], medians, errors_ms)
    return OpTiming(
        chosen=chosen,
        median_ms={c.name: medians.get(c.name) for c in pool},
        error=errors,
        why=why,
        noise_ms=max(errors_ms.values()),
        row_floors=floors[chosen],
        invariant=invariant and probed[chosen],
        noisy=noisy,
    )


def _alternate(fns: dict[str, Callable[[], Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """Each callable's median ms over alternating rounds, and that median's standard error
    (`median_error`): how far it may sit from the true median. A candidate beaten beyond
    any noise (`_beaten`) stops being timed; the others go on."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    timed = dict(fns)
    rounds = MIN_ROUNDS if len(fns) == 1 else MAX_ROUNDS
    start = time.perf_counter()
    for r in range(NOISY_MAX_ROUNDS):
        if r >= MIN_ROUNDS and len(timed) == 1:
            break
        if r >= rounds or (r >= MIN_ROUNDS and time.perf_counter() > start + BUDGET_S):
            # done, unless a busy host's noise leaves the choice open: then on, to
            # NOISY_BUDGET_S, while it does
            medians = {n: statistics.median(samples[n]) for n in timed}
            settled = not _noisy(list(timed), medians, {n: median_error(samples[n]) for n in timed})
            if settled or time.perf_counter() > start + NOISY_BUDGET_S:
                break
        for name, fn in timed.items():
            t = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t) * 1e3)
        if r + 1 >= DECIDE_ROUNDS:
            timed = {n: fn for n, fn in timed.items() if not _beaten(n, timed, samples)}
    medians = {name: statistics.median(s) for name, s in samples.items()}
    return medians, {name: median_error(s) for name, s in samples.items()}


def _beaten(name: str, timed: dict[str, Any], samples: dict[str, list[float]]) -> bool:
    """Whether `name`'s fastest round is more than `DECISIVE` times another timed
    candidate's median round: no noise this machine makes turns that around, so more
    rounds would only spend start-up time. (Against the other's slowest round, one round
    that a busy host stretched kept a 10x slower candidate in the timing to the busy-host
    budget.)"""
    best = min(samples[name])
    return any(n != name and best > DECISIVE * statistics.median(samples[n]) for n in timed)


def _choose(
    order: list[str], medians: dict[str, float], errors_ms: dict[str, float]
) -> tuple[str, bool]:
    """(the choice, whether the host was busy): the simplest candidate within noise of the
    fastest (`_pick`), or on a busy host (`_noisy`) the fastest median."""
    if _noisy(order, medians, errors_ms):
        return min(order, key=medians.__getitem__), True
    return _pick(order, medians, errors_ms), False


def _noisy(order: list[str], medians: dict[str, float], errors_ms: dict[str, float]) -> bool:
    """Two or more candidates timed, some median's standard error beyond `NOISY` of the
    fastest median, and that noise is what keeps the fastest from winning (`_pick` would
    take a simpler one "within the noise"): a busy host's measurement, whose ties mean
    nothing. A fastest candidate that wins beyond the noise is a settled choice however
    busy the host (timing it on would only delay the start)."""
    timed = [n for n in order if n in medians]
    if len(timed) < 2:
        return False
    fastest = min(timed, key=medians.__getitem__)
    if max(errors_ms[n] for n in timed) <= NOISY * medians[fastest]:
        return False
    return _pick(timed, medians, errors_ms) != fastest


def _pick(order: list[str], medians: dict[str, float], errors_ms: dict[str, float]) -> str:
    """The simplest candidate (earliest in `order`) whose median is within noise of the
    fastest's: two standard errors of the difference, plus `MARGIN`."""
    assert order, "at least one candidate is timed"
    best = min(order, key=lambda n: medians[n])

    def tied(n: str) -> bool:
        noise = 2 * math.hypot(errors_ms[n], errors_ms[best])
        return medians[n] - medians[best] <= noise + MARGIN * medians[best]

    return next(n for n in order if tied(n))


def median_error(samples: list[float]) -> float:
    """Standard error of a sample median: 1.2533 sigma / sqrt(n), sigma from the IQR
    (robust to the outliers a shared machine throws in)."""
    if len(samples) < 4:
        return 0.0
    q = statistics.quantiles(samples, n=4)
    return 1.2533 * (q[2] - q[0]) / 1.349 / math.sqrt(len(samples))


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = got.double() - want
    return float(diff.norm() / want.norm().clamp_min(1e-30))


# ---- the on-disk cache and the host lock --------------------------------------------------
def cache_key(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    pools: dict[str, list[str]],
    invariant: bool,
) -> dict[str, Any]:
    return {
        "version": CACHE_VERSION,
        "native": build_dir().name,  # our kernels' sources and flags: changed code, new timing
        **cpu_identity(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "device": str(device),
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "pools": pools,
        "invariant": invariant,
        "shapes": [
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.sliding_windows[0],
            cfg.hidden_act,
            cfg.attention_bias,
        ],
    }


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _read(path: Path, key: dict[str, Any]) -> Selection | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("key") != key:
        return None
    written = float(raw.get("written", 0.0))
    try:
        timings = {op: OpTiming(**t) for op, t in raw["timings"].items()}
        kernels = KernelSet.of(
            raw["kernels"], raw["row_floors"], batch_invariant=bool(raw["batch_invariant"])
        )
    except (TypeError, ValueError, KeyError):
        return None
    sel = Selection(
        kernels, "cache", timings, float(raw.get("seconds", 0.0)), raw.get("note", ""), written
    )
    if sel.noisy and not 0 <= time.time() - written <= PROVISIONAL_S:
        return None  # a busy host's provisional choice, too old: measure again
    return sel


def _write(path: Path, key: dict[str, Any], sel: Selection) -> None:
    body = {
        "key": key,
        "kernels": sel.kernels.as_dict(),
        "row_floors": dict(sel.kernels.row_floors),
        "batch_invariant": sel.kernels.batch_invariant,
        "timings": {op: asdict(t) for op, t in sel.timings.items()},
        "seconds": sel.seconds,
        "note": sel.note,
        "written": time.time(),
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(path)  # atomic: a reader sees the old file or the whole new one
    except OSError as e:  # a read-only home measures again next time; it still serves
        log.warning("kernels: could not cache the choice in %s (%s)", path, e)
