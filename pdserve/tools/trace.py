"""`pdserve trace`: the anatomy of one prefill and one decode step, against this machine's roofline.

For one prompt this runs the real engine (one request, greedy, two output tokens: a prefill
step, then a batch-1 decode step), once to warm up and a few more times to measure, and reports
for each phase what every layer does: tensor shapes, FLOPs, bytes read and written, arithmetic
intensity (FLOP/byte) and measured time. It also measures this machine's two roofs in the same
run (large matmuls in the engine's dtype; a large buffer copied and summed) and places each
phase under the roofline: attainable FLOP/s = min(peak, intensity * bandwidth).

What is timed
-------------
* **Phase time** (`time_ms`): wall time of `LlamaModel.forward` inside `engine.step()`, which
  `trace` wraps on the model instance. `step_time_ms` is the whole step (scheduling, input
  tensors, sampling) around it. The run with the median forward time is the one reported.
* **Per-layer time** (`layers[i].time_ms`): the interval that ends at layer ``i``'s
  `layer_hook` call, measured inside that same engine forward. The hook fires once per layer
  at the same point of every layer, so each interval is one layer's worth of work; the first
  interval starts when `forward` starts and also holds the embedding lookup, and the tail
  after the last hook is reported as the head (final norm + lm_head).
* **Per-op time** (`layer_ops[j].time_ms`): layer 0 re-run call by call outside the engine,
  on a scratch KV cache, making the very calls `LlamaModel._layer` makes, in its order, with
  its weights and shapes: the chosen RMSNorm (`model.norm`); the model's projection object
  `model.proj` (the chosen kernels, with fused epilogues) for qkv, for o_proj with its
  residual add and for the MLP with its residual add; the chosen RoPE with the K/V cache
  write (`rope_kv`: q and k rotated in one pass, the rotated K and V stored);
  `DecodeWorkspace.write`; the attention method
  `_layer` dispatches to. So each row times code the engine runs; a call that runs several
  logical ops is one timed row with the ops as its untimed parts. Whole passes (embedding,
  layer 0, head) are repeated after one warm-up and each call is timed in its place in the
  pass; the median per call is reported. What the engine pays between the calls (views,
  Python) is in the per-layer time but not in the per-op times; the rotary tables, looked
  up once per forward, are in `layers[0].time_ms` and in no per-op time.
* On CUDA every timestamp is taken after `torch.cuda.synchronize()`; on CPU torch is
  synchronous.

Counting
--------
FLOPs and bytes follow the conventions in `pdserve.tools.trace_counts` (per logical op, as
the unfused eager model would move them).

Roofs
-----
The matmul peak is the best of a few ``N^3`` matmuls in the engine's dtype (N grows from
2048 while a run is short); the memory bandwidth is the better of a copy of one 256 MiB
buffer (its bytes counted twice, read + write) and a read-only sum over it. The ridge is
peak / bandwidth; a phase whose intensity is above it is compute-bound, below it
memory-bound. Both roofs are measured once per run, on a machine that may be shared: when a
step beats a roof, the roof was measured low (contention) or, for memory, the operands sat
in cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.config import CacheConfig, ModelConfig, ceil_div
from engine.decode_workspace import DecodeWorkspace
from engine.kv_cache import PagedKVCache, dtype_name
from engine.model import AttentionMetadata, LlamaModel, PrefillSegment
from engine.sampling import SamplingParams
from pdserve.engine_load import load_engine
from pdserve.tools.trace_counts import OpCount, Totals, embed_ops, head_ops, layer_ops

if TYPE_CHECKING:
    from rich.table import Table

    from engine.engine import LLMEngine

# Measurement sizes (module constants so tests can shrink them).
PEAK_MATMUL_N = 2048  # first N of the N^3 matmul (x2 on CUDA)
PEAK_MATMUL_MAX_N = 4096  # largest N tried (x4 on CUDA)
PEAK_GROW_S = 0.25  # try the next N while one matmul takes less than this
PEAK_REPEATS = 3
BANDWIDTH_BYTES = 256 << 20
BANDWIDTH_REPEATS = 5
ENGINE_RUNS = 3  # timed engine runs after the warm-up (fewer if they exceed the budget)
ENGINE_BUDGET_S = 5.0
OP_MIN_REPEATS = 3  # timed passes over the embedding, layer 0 and the head, per phase
OP_MAX_REPEATS = 50
OP_BUDGET_S = 1.0  # all passes of a phase, once OP_MIN_REPEATS are done

# Below this fraction of the roofline the step is dominated by neither roof but by overhead.
OVERHEAD_FRACTION = 0.1

T = TypeVar("T")


# ---- the machine -------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """This machine's two roofs, measured in this run."""

    device: str
    threads: int
    dtype: str
    peak_flop_per_s: float
    matmul_n: int  # N of the N^3 matmul that reached the peak
    copy_byte_per_s: float  # a copy, read + written bytes
    read_byte_per_s: float  # a read-only reduction
    buffer_bytes: int
    cpu_count: int = 0
    load_average_1m: float | None = None  # at the start of the run (other processes' load)

    @property
    def contended(self) -> bool:
        """Other work kept the CPUs busy when the trace started: its timings are noisy."""
        return self.load_average_1m is not None and self.load_average_1m >= self.cpu_count

    @property
    def bandwidth_byte_per_s(self) -> float:
        """The memory roof: the better of the copy and the read-only measurement."""
        return max(self.copy_byte_per_s, self.read_byte_per_s)

    @property
    def ridge(self) -> float:
        """Intensity (FLOP/B) at which the memory roof meets the compute roof."""
        return self.peak_flop_per_s / self.bandwidth_byte_per_s

    def attainable(self, intensity: float) -> float:
        return min(self.peak_flop_per_s, intensity * self.bandwidth_byte_per_s)

    def bound(self, intensity: float) -> str:
        return "compute-bound" if intensity >= self.ridge else "memory-bound"


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Best wall time of `repeats` calls, after one warm-up call."""
    fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_machine(dtype: torch.dtype, device: torch.device) -> Machine:
    """This machine's roofs: best-of matmul FLOP/s in `dtype`, best-of memory bandwidth.

    Matmuls start at ``PEAK_MATMUL_N`` and double (up to ``PEAK_MATMUL_MAX_N``) while one
    takes under ``PEAK_GROW_S``: small ones understate a many-core or GPU peak. Bandwidth is
    measured twice on one ``BANDWIDTH_BYTES`` buffer, as a copy (bytes counted twice: read and
    written) and as a read-only reduction (`sum`); the roof is the better of the two, since
    write-allocate traffic makes a copy understate what a read-mostly step can stream.
    """
    sync = _sync_fn(device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cuda = device.type == "cuda"
    n, max_n = PEAK_MATMUL_N * (2 if cuda else 1), PEAK_MATMUL_MAX_N * (4 if cuda else 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    peak, peak_n = 0.0, n
    while True:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        w = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype, device=device)
        best = _best_time(partial(torch.matmul, a, w, out=out), PEAK_REPEATS, sync)
        if 2 * n**3 / best > peak:
            peak, peak_n = 2 * n**3 / best, n
        del a, w, out
        if best >= PEAK_GROW_S or 2 * n > max_n:
            break
        n *= 2

    src = torch.ones(BANDWIDTH_BYTES, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    copy_bw = 2 * BANDWIDTH_BYTES / _best_time(partial(dst.copy_, src), BANDWIDTH_REPEATS, sync)
    words = src.view(torch.float32)
    read_bw = BANDWIDTH_BYTES / _best_time(words.sum, BANDWIDTH_REPEATS, sync)
    del src, dst, words
    return Machine(
        device=str(device),
        threads=torch.get_num_threads(),
        dtype=dtype_name(dtype),
        peak_flop_per_s=peak,
        matmul_n=peak_n,
        copy_byte_per_s=copy_bw,
        read_byte_per_s=read_bw,
        buffer_bytes=BANDWIDTH_BYTES,
        cpu_count=os.cpu_count() or 1,
        load_average_1m=load,
    )


# ---- timing the engine ---------------------------------------------------------------------
@dataclass
class ForwardTiming:
    """Timestamps of one `LlamaModel.forward` call: start, each layer hook, end."""

    start: float = 0.0
    hooks: list[float] = field(default_factory=list)
    end: float = 0.0

    @property
    def total_s(self) -> float:
        return self.end - self.start

    def layer_s(self) -> list[float]:
        """Interval ending at each layer's hook (the first starts at `start`)."""
        marks = [self.start, *self.hooks]
        return [b - a for a, b in itertools.pairwise(marks)]

    @property
    def head_s(self) -> float:
        return self.end - (self.hooks[-1] if self.hooks else self.start)


@contextmanager
def instrument(model: LlamaModel, sync: Callable[[], None]) -> Iterator[list[ForwardTiming]]:
    """Wrap `model.forward` on this instance so every call records a `ForwardTiming`.

    The wrapper passes a `layer_hook` that timestamps each layer (chaining any hook the
    caller passed) and restores the class method on exit.
    """
    records: list[ForwardTiming] = []
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        rec = ForwardTiming()
        inner = args[4] if len(args) > 4 else kwargs.get("layer_hook")

        def hook(i: int) -> None:
            if inner is not None:
                inner(i)
            sync()
            rec.hooks.append(time.perf_counter())

        if len(args) > 4:
            args = (*args[:4], hook, *args[5:])
        else:
            kwargs["layer_hook"] = hook
        sync()
        rec.start = time.perf_counter()
        out = original(*args, **kwargs)
        sync()
        rec.end = time.perf_counter()
        records.append(rec)
        return out

    model.forward = forward  # type: ignore[method-assign]
    try:
        yield records
    finally:
        vars(model).pop("forward", None)


@dataclass
class StepRun:
    """One traced step: its forward timing (None if the forward was not seen) and wall time."""

    forward: ForwardTiming | None
    step_s: float

    @property
    def time_s(self) -> float:
        return self.forward.total_s if self.forward is not None else self.step_s


def _run_once(
    engine: LLMEngine,
    ids: list[int],
    tag: str,
    records: list[ForwardTiming],
    sync: Callable[[], None],
) -> tuple[StepRun, StepRun, int]:
    """Prefill + one decode step of a fresh request; returns both runs and the first token."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # A salt of its own per run: the prefix cache must not serve any of the prompt.
    req = engine.add_request(f"trace-{tag}", ids, params, cache_salt=f"pdserve-trace-{tag}")
    runs = []
    for phase in ("prefill", "decode"):
        records.clear()
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        step_s = time.perf_counter() - t0
        n_out = len(req.output_token_ids)
        expected = 1 if phase == "prefill" else 2
        if n_out != expected or (phase == "prefill" and req.num_cached_tokens):
            raise RuntimeError(f"trace: the {phase} step did not run as one step of this prompt")
        runs.append(StepRun(records[0] if len(records) == 1 else None, step_s))
    if engine.has_unfinished():
        raise RuntimeError("trace: the request did not finish after two tokens")
    return runs[0], runs[1], req.output_token_ids[0]


def _median_run(runs: list[StepRun]) -> StepRun:
    return sorted(runs, key=lambda r: r.time_s)[(len(runs) - 1) // 2]


@dataclass
class LayerInputs:
    """What `LlamaModel.forward` hands `_layer` for one step of the traced request.

    Built the way `ModelRunner` builds a step (one request, K/V in blocks ``0 .. n-1`` of a
    scratch cache, so slot == position), so that the calls `time_layer_ops` re-runs take the
    engine's paths: one prefill segment without a cached prefix, or a decode step of batch 1
    reading its context from a `DecodeWorkspace`.
    """

    input_ids: torch.Tensor  # [T]
    x: torch.Tensor  # [T, d]: the residual stream into layer 0 (the embedding rows)
    meta: AttentionMetadata
    cache: PagedKVCache
    rope: tuple[torch.Tensor, torch.Tensor]  # `Rotary.tables` at the step's positions
    keep: list[int] | None  # rows layer 0 carries on past its K/V write (None: all)


@torch.inference_mode()
def layer_inputs(
    model: LlamaModel, block_size: int, ids: list[int], ctx: int, decode: bool
) -> LayerInputs:
    """Layer 0's inputs for the tokens `ids` at positions ``ctx - len(ids) .. ctx - 1``.

    The scratch cache holds stand-in values of the right dtype for the decode context.
    """
    cfg, dev, t = model.cfg, model.device, len(ids)
    cache = PagedKVCache(cfg, CacheConfig(block_size, ceil_div(ctx, block_size)), model.dtype, dev)
    cache.data.normal_()
    positions = torch.arange(ctx - t, ctx, device=dev)
    keep = None
    if decode:
        lens = torch.tensor([ctx], device=dev)
        if model.kernels.decode_reads_pages:  # the kernel reads the pages where they lie
            tables = torch.arange(cache.num_blocks, device=dev)[None]
            meta = AttentionMetadata(
                positions, positions, decode_ctx_lens=lens, decode_block_tables=tables
            )
        else:
            ws = DecodeWorkspace(cache, 1 << 40)  # the context copied in once, as it joins
            ws.prepare([("trace", 0)], [ctx], [list(range(cache.num_blocks))])
            meta = AttentionMetadata(
                positions, positions, decode_ctx_lens=lens, decode_workspace=ws
            )
    else:
        blocks = torch.arange(cache.num_blocks, device=dev)
        segment = PrefillSegment(0, t, ctx, None if ctx == t else blocks, blocks)
        meta = AttentionMetadata(positions, positions, prefill=[segment], logit_rows=[t - 1])
        if cfg.num_layers == 1 and t > 1:  # layer 0 is the last: forward prunes it
            keep = [t - 1]
    input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
    x = model.w.embed[input_ids]
    return LayerInputs(input_ids, x, meta, cache, model.rotary.tables(positions), keep)


class CallTimer:
    """Times calls where they sit in a sequence: `timed(name, fn)` runs `fn`, appends its
    wall time to ``times[name]`` and returns its result, the input of the next call."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.times: dict[str, list[float]] = {}

    def __call__(self, name: str, fn: Callable[[], T]) -> T:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        self.times.setdefault(name, []).append(time.perf_counter() - t0)
        return out


def _attention_call(
    model: LlamaModel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inp: LayerInputs
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Layer 0's attention as `_layer` dispatches it -> ``(residual stream, o)``.

    A pruned layer (`inp.keep`) also picks its rows of the stream first, as `_layer` does;
    otherwise the stream is `inp.x` as it is. These are `LlamaModel`'s private methods on
    purpose: they are what `_layer` calls.
    """
    cache, meta, window = inp.cache, inp.meta, model.cfg.sliding_windows[0]
    segments, keep = meta.prefill, inp.keep
    if keep is not None:
        assert segments is not None
        rows = torch.tensor(keep, dtype=torch.long, device=inp.x.device)
        return lambda: (
            inp.x[rows],
            model._row_attention(0, q, k, v, keep, segments, cache, window),
        )
    if segments is not None:
        return lambda: (inp.x, model._prefill_attention(0, q, k, v, segments, cache, window))
    return lambda: (inp.x, model._decode_attention(0, q, meta, cache, window))


def _run_layer_ops(model: LlamaModel, inp: LayerInputs, timed: CallTimer) -> torch.Tensor:
    """Layer 0 call by call, exactly as `LlamaModel._layer` runs it; the stream out.

    Every row of `trace_counts.layer_ops` is one `timed` call here, under its name.
    """
    cfg, lw, proj, eps = model.cfg, model.w.layers[0], model.proj, model.cfg.rms_norm_eps
    cache, meta, x, t = inp.cache, inp.meta, inp.x, inp.x.shape[0]
    h = timed("input_norm", lambda: model.norm(x, lw.input_norm, eps))
    qkv = timed("qkv_proj", lambda: proj.qkv(0, h))
    qk_in = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, -1)
    v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, -1)
    slots = cache.layer_slots(0)
    qk = timed("rope_kv", lambda: model._rope_write(qk_in, v, *inp.rope, *slots, meta.slot_mapping))
    q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
    ws = meta.decode_workspace
    if ws is not None:
        timed("kv_append", lambda: ws.write(0, k, v))
    x, o = timed("attention", _attention_call(model, q, k, v, inp))
    # Untimed copy: the eager `o_residual` adds into the stream in place (`addmm_`), and
    # `inp.x` must enter every pass unchanged.
    x = x.clone()
    x = timed("o_residual", lambda: proj.o_residual(0, o, x))
    h = timed("post_norm", lambda: model.norm(x, lw.post_norm, eps))
    return timed("mlp_residual", lambda: proj.mlp_residual(0, h, x))


def _timed_pass(model: LlamaModel, inp: LayerInputs, timed: CallTimer) -> None:
    """The embedding, layer 0 and the head call by call, as `LlamaModel.forward` runs them
    (the head on the row that gives logits)."""
    timed("embed", lambda: model.w.embed[inp.input_ids])
    last = _run_layer_ops(model, inp, timed)[-1:]
    h = timed("final_norm", lambda: model.norm(last, model.w.norm, model.cfg.rms_norm_eps))
    timed("lm_head", lambda: model.proj.lm_head(h).float())


@torch.inference_mode()
def time_layer_ops(model: LlamaModel, inp: LayerInputs) -> dict[str, float]:
    """Median time of each call of the embedding, layer 0 and the head, by op row name.

    Whole passes are repeated (one warm-up, then at least `OP_MIN_REPEATS`, more while
    within `OP_BUDGET_S`, at most `OP_MAX_REPEATS`) and every call is timed in its place in
    the pass, not in a loop of its own: a call repeated back to back runs faster than
    between the others (warm caches and predictors), so its loop time would not describe
    the layer. The passes leave `inp` as they found it, apart from the K/V they write.
    """
    timer = CallTimer(_sync_fn(model.device))
    _timed_pass(model, inp, timer)
    timer.times.clear()
    start, passes = time.perf_counter(), 0
    while passes < OP_MAX_REPEATS and (
        passes < OP_MIN_REPEATS or time.perf_counter() - start < OP_BUDGET_S
    ):
        _timed_pass(model, inp, timer)
        passes += 1
    return {name: statistics.median(times) for name, times in timer.times.items()}


# ---- one phase -----------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    num_tokens: int
    context_len: int
    embed: list[OpCount]
    layers: list[list[OpCount]]  # counts per layer; layers[0] carries the per-op times
    head: list[OpCount]
    run: StepRun

    @property
    def all_ops(self) -> list[OpCount]:
        return self.embed + [o for ops in self.layers for o in ops] + self.head

    @property
    def totals(self) -> Totals:
        return Totals.of(self.all_ops)

    def layer_times(self) -> list[float | None]:
        fwd = self.run.forward
        if fwd is None or len(fwd.hooks) != len(self.layers):
            return [None] * len(self.layers)
        return list(fwd.layer_s())

    def head_time(self) -> float | None:
        fwd = self.run.forward
        return fwd.head_s if fwd is not None and len(fwd.hooks) == len(self.layers) else None


def _build_phase(
    name: str, cfg: ModelConfig, t: int, ctx: int, b: int, run: StepRun, op_times: dict[str, float]
) -> Phase:
    decode = name == "decode"
    last = cfg.num_layers - 1
    workspace = "kv_append" in op_times  # the timed run appended to a decode workspace
    layers = [
        layer_ops(cfg, i, t, ctx, b, decode, 1 if not decode and i == last else None, workspace)
        for i in range(cfg.num_layers)
    ]
    embed, head = embed_ops(cfg, t, b), head_ops(cfg, 1, b)
    for op in [*embed, *layers[0], *head]:
        op.time_s = op_times.get(op.name)
    return Phase(name, t, ctx, embed, layers, head, run)


# ---- output ------------------------------------------------------------------------------
def _si(x: float, unit: str, digits: int = 3) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}"


def _ms(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f}" if s < 0.1 else f"{s * 1e3:.1f}"


def _dur(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{_ms(s)} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.2g}%" if x < 0.1 else f"{100 * x:.0f}%"


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _rates(m: Machine, flops: int, nbytes: int, time_s: float | None) -> dict[str, Any]:
    intensity = flops / nbytes if nbytes else 0.0
    attainable = m.attainable(intensity)
    achieved = flops / time_s if time_s else None
    return {
        "intensity_flop_per_byte": intensity,
        "attainable_flop_per_s": attainable,
        "achieved_flop_per_s": achieved,
        "achieved_byte_per_s": nbytes / time_s if time_s else None,
        "fraction_of_peak": achieved / m.peak_flop_per_s if achieved is not None else None,
        "fraction_of_attainable": achieved / attainable if achieved and attainable else None,
        "bound": m.bound(intensity),
    }


def _op_json(op: OpCount, m: Machine) -> dict[str, Any]:
    return {
        "name": op.name,
        "kind": op.kind,
        "inputs": {k: list(s) for k, s in op.inputs.items()},
        "outputs": {k: list(s) for k, s in op.outputs.items()},
        "note": op.note,
        "flops": op.flops,
        "bytes_read": op.bytes_read,
        "bytes_written": op.bytes_written,
        "weight_bytes": op.weight_bytes,
        "kv_bytes_written": op.kv_bytes_written,
        "kv_bytes_read": op.kv_bytes_read,
        "time_ms": _round(op.time_s * 1e3 if op.time_s is not None else None),
        **_rates(m, op.flops, op.bytes_read + op.bytes_written, op.time_s),
        **({"parts": [_op_json(part, m) for part in op.parts]} if op.parts else {}),
    }


def _totals_json(tot: Totals, m: Machine, time_s: float | None) -> dict[str, Any]:
    return {
        "flops": tot.flops,
        "matmul_flops": tot.matmul_flops,
        "attention_flops": tot.attention_flops,
        "elementwise_flops": tot.elementwise_flops,
        "bytes_read": tot.bytes_read,
        "bytes_written": tot.bytes_written,
        "weight_bytes": tot.weight_bytes,
        "kv_bytes_written": tot.kv_bytes_written,
        "kv_bytes_read": tot.kv_bytes_read,
        "time_ms": _round(time_s * 1e3 if time_s is not None else None),
        **_rates(m, tot.flops, tot.bytes, time_s),
    }


def verdict(p: Phase, m: Machine) -> str:
    """One line: size, work, time, achieved rate against both roofs, and the bound."""
    tot, time_s = p.totals, p.run.time_s
    achieved = tot.flops / time_s
    intensity = tot.intensity
    bound = m.bound(intensity)
    attainable = m.attainable(intensity)
    what = (
        f"{p.num_tokens} token{'s' if p.num_tokens != 1 else ''}"
        if p.name == "prefill"
        else f"batch 1, 1 token at context {p.context_len}"
    )
    cmp = ">" if intensity >= m.ridge else "<"
    line = (
        f"{p.name}: {what}, {_si(tot.flops, 'FLOP')}, {_si(tot.bytes, 'B')} moved, "
        f"{_dur(time_s)}, {_si(achieved, 'FLOP/s')} = {_pct(achieved / m.peak_flop_per_s)} of "
        f"measured matmul peak; {bound} (intensity {intensity:.3g} FLOP/B {cmp} ridge "
        f"{m.ridge:.3g}); roofline allows {_si(attainable, 'FLOP/s')}, reached "
        f"{_pct(achieved / attainable)}"
    )
    if bound == "memory-bound":
        bw = tot.bytes / time_s
        line += (
            f"; {_si(bw, 'B/s')} = {_pct(bw / m.bandwidth_byte_per_s)} of measured memory bandwidth"
        )
    if achieved > attainable:
        line += (
            " (above the measured roof: the roof was measured low under contention, or the "
            "operands sat in cache)"
        )
    elif achieved / attainable < OVERHEAD_FRACTION:
        line += " (far under both roofs: per-op overhead, not FLOPs or bytes, sets the time)"
    return line


def _phase_json(p: Phase, m: Machine) -> dict[str, Any]:
    layer_times = p.layer_times()
    layers = []
    for i, (ops, t) in enumerate(zip(p.layers, layer_times, strict=True)):
        layers.append({"layer": i, **_totals_json(Totals.of(ops), m, t)})
    return {
        "num_tokens": p.num_tokens,
        "context_len": p.context_len,
        **_totals_json(p.totals, m, p.run.time_s),
        "step_time_ms": _round(p.run.step_s * 1e3),
        "fraction_of_bandwidth": p.totals.bytes / p.run.time_s / m.bandwidth_byte_per_s,
        "verdict": verdict(p, m),
        "embed": {
            **_totals_json(Totals.of(p.embed), m, None),
            "time_note": "inside layers[0].time_ms",
        },
        "layers": layers,
        "head": _totals_json(Totals.of(p.head), m, p.head_time()),
        "layer_ops": [_op_json(o, m) for o in [*p.embed, *p.layers[0], *p.head]],
    }


TIMING_NOTES = {
    "time_ms": "wall time of LlamaModel.forward in engine.step(); median of the timed runs",
    "step_time_ms": "the whole engine.step() of that run (scheduling, inputs, sampling)",
    "layers.time_ms": "interval ending at the layer's layer_hook call, same forward; "
    "layers[0] includes the embedding lookup",
    "head.time_ms": "last layer_hook to the end of forward (final norm, lm_head)",
    "layer_ops.time_ms": "the engine's own calls of layer 0 (plus embed and head) re-run one "
    "by one in _layer's order, same weights and shapes; median of repeats; a fused call's "
    "parts run inside it and have no time of their own",
}


def to_json(
    prompt: str,
    ids: list[int],
    model_path: str,
    cfg: ModelConfig,
    m: Machine,
    phases: list[Phase],
    b: int,
    runs: int,
) -> dict[str, Any]:
    return {
        "model": {
            "path": model_path,
            "architecture": cfg.architecture,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "params": cfg.num_params(),
            "dtype": m.dtype,
            "dtype_bytes": b,
        },
        "machine": {
            "device": m.device,
            "torch_threads": m.threads,
            "matmul_peak_flop_per_s": m.peak_flop_per_s,
            "matmul_n": m.matmul_n,
            "memory_bandwidth_byte_per_s": m.bandwidth_byte_per_s,
            "copy_bandwidth_byte_per_s": m.copy_byte_per_s,
            "read_bandwidth_byte_per_s": m.read_byte_per_s,
            "bandwidth_buffer_bytes": m.buffer_bytes,
            "ridge_flop_per_byte": m.ridge,
            "cpu_count": m.cpu_count,
            "load_average_1m": m.load_average_1m,
        },
        "prompt": {"text": prompt, "num_tokens": len(ids), "token_ids": ids},
        "timed_runs": runs,
        "timing": TIMING_NOTES,
        **{p.name: _phase_json(p, m) for p in phases},
    }


def _rate_cells(m: Machine, flops: int, nbytes: int, time_s: float | None) -> list[str]:
    intensity = flops / nbytes if nbytes else 0.0
    if not time_s:
        return ["-", "-", m.bound(intensity).removesuffix("-bound")]
    achieved = flops / time_s
    attainable = m.attainable(intensity)
    frac = _pct(achieved / attainable) if attainable else "-"
    return [_si(achieved, "FLOP/s"), frac, m.bound(intensity).removesuffix("-bound")]


def _op_row(table: Table, m: Machine, label: str, op: OpCount, end_section: bool) -> None:
    nbytes = op.bytes_read + op.bytes_written
    table.add_row(
        label,
        op.shape_text,
        _si(op.flops, ""),
        _si(op.bytes_read, "B"),
        _si(op.bytes_written, "B"),
        f"{op.flops / nbytes:.3g}",
        _ms(op.time_s),
        *_rate_cells(m, op.flops, nbytes, op.time_s),
        end_section=end_section,
    )


def _layer_row(
    table: Table, m: Machine, label: str, tot: Totals, t: float | None, **kw: Any
) -> None:
    table.add_row(
        label,
        _si(tot.flops, ""),
        _si(tot.bytes_read, "B"),
        _si(tot.bytes_written, "B"),
        _si(tot.kv_bytes_written, "B"),
        f"{tot.intensity:.3g}",
        _ms(t),
        *_rate_cells(m, tot.flops, tot.bytes, t),
        **kw,
    )


def render(
    prompt: str,
    ids: list[int],
    model_path: str,
    cfg: ModelConfig,
    m: Machine,
    phases: list[Phase],
    runs: int,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(
        f"[bold]model[/] {model_path}: {cfg.architecture}, {cfg.num_layers} layers, "
        f"d={cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} kv × {cfg.head_dim}, "
        f"ffn {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
        f"{cfg.num_params() / 1e6:.2f}M params, {m.dtype}"
    )
    console.print(
        f"[bold]machine[/] {m.device}, {m.threads} threads: matmul peak "
        f"{_si(m.peak_flop_per_s, 'FLOP/s')} ({m.matmul_n}³ {m.dtype}, best of {PEAK_REPEATS}), "
        f"memory bandwidth {_si(m.bandwidth_byte_per_s, 'B/s')} (best of {BANDWIDTH_REPEATS} "
        f"over {m.buffer_bytes >> 20} MiB: copy {_si(m.copy_byte_per_s, 'B/s')} counting read + "
        f"written, read-only sum {_si(m.read_byte_per_s, 'B/s')}), ridge {m.ridge:.3g} FLOP/B"
    )
    short = prompt if len(prompt) <= 80 else prompt[:77] + "..."
    if m.contended:
        console.print(
            f"[yellow]warning[/]: load average {m.load_average_1m:.1f} on {m.cpu_count} CPUs "
            "when the trace started: other processes share the cores, timings are inflated"
        )
    console.print(
        f"[bold]prompt[/] {short!r}: {len(ids)} tokens; {runs} timed runs after 1 warm-up"
    )
    heads = ["FLOP", "read", "written", "FLOP/B", "time ms", "FLOP/s", "% roof", "bound"]
    for p in phases:
        ops_t = Table(
            title=f"{p.name}: one layer op by op (T={p.num_tokens}, S={p.context_len}); "
            "layer 0's engine calls re-run one by one, same weights, median time",
            title_justify="left",
        )
        ops_t.add_column("op")
        ops_t.add_column("shapes", overflow="fold")
        for c in heads:
            ops_t.add_column(c, justify="right")
        for op in [*p.embed, *p.layers[0], *p.head]:
            rows = [(op.name, op), *((f"  ↳ {part.name}", part) for part in op.parts)]
            for i, (label, row) in enumerate(rows):
                ends = i == len(rows) - 1 and (op is p.layers[0][-1] or op is p.embed[-1])
                _op_row(ops_t, m, label, row, end_section=ends)
        lt = Totals.of(p.layers[0])
        lt_s = sum(o.time_s or 0.0 for o in p.layers[0])
        ops_t.add_row(
            "layer 0 total",
            "sum of its ops",
            _si(lt.flops, ""),
            _si(lt.bytes_read, "B"),
            _si(lt.bytes_written, "B"),
            f"{lt.intensity:.3g}",
            _ms(lt_s),
            *_rate_cells(m, lt.flops, lt.bytes, lt_s),
            style="bold",
        )
        ops_t.caption = (
            "% roof = achieved / min(peak, FLOP/B × bandwidth). ↳ rows run inside the call "
            "above them, timed with it. Each call is re-run on the same tensors, so operands "
            "that fit in cache come from cache: over 100% of a memory roof means DRAM was not "
            "the limit"
        )
        console.print(ops_t)

        lay_t = Table(
            title=f"{p.name}: per layer, timed in the engine forward between layer_hook calls",
            title_justify="left",
        )
        lay_t.add_column("layer")
        for c in heads[:3]:
            lay_t.add_column(c, justify="right")
        lay_t.add_column("KV written", justify="right")
        for c in heads[3:]:
            lay_t.add_column(c, justify="right")

        _layer_row(lay_t, m, "embed", Totals.of(p.embed), None)
        for i, (ops, t) in enumerate(zip(p.layers, p.layer_times(), strict=True)):
            _layer_row(lay_t, m, f"{i}{' (+embed)' if i == 0 else ''}", Totals.of(ops), t)
        _layer_row(lay_t, m, "head", Totals.of(p.head), p.head_time(), end_section=True)
        _layer_row(lay_t, m, "total (forward)", p.totals, p.run.time_s, style="bold")
        lay_t.caption = (
            f"engine step {_ms(p.run.step_s)} ms (forward + scheduling, inputs, sampling); "
            f"weights read {_si(p.totals.weight_bytes, 'B')}, KV read "
            f"{_si(p.totals.kv_bytes_read, 'B')}"
        )
        console.print(lay_t)
    console.print("[bold]roofline[/]")
    for p in phases:
        console.print(verdict(p, m), highlight=False, soft_wrap=True)


# ---- entry point -------------------------------------------------------------------------
def _check_traceable(mcfg: ModelConfig, model: str) -> None:
    """The per-op table (`trace_counts.layer_ops`) is Llama's block: refuse other blocks
    rather than time a layer that is not the one the engine runs."""
    if mcfg.qk_norm or mcfg.gemma_norms or "none" in mcfg.layer_rope:
        raise ValueError(
            f"--model {model!r}: trace's per-op table times Llama's block, and "
            f"{mcfg.architecture}'s has other pieces (q/k norms, Gemma 3's norms, NoPE "
            "layers); trace a Llama, Mistral or Qwen2 checkpoint"
        )


def run_trace(args: argparse.Namespace) -> int:
    """`pdserve trace`: measure the roofs, trace prefill and one decode step, print."""
    engine = load_engine(
        args.model, args.dtype, args.weights_seed, args.chat_template, args.revision
    )
    if engine.tokenizer is None:
        raise ValueError(f"--model {args.model!r}: trace needs a checkpoint with tokenizer.json")
    _check_traceable(engine.model_config, args.model)
    ids = engine.tokenizer.encode(args.prompt)
    budget = engine.scheduler_config.max_num_batched_tokens
    if len(ids) > budget:
        raise ValueError(
            f"prompt: {len(ids)} tokens; trace measures one prefill step and the chunk budget "
            f"(max_num_batched_tokens) is {budget}"
        )
    model = engine.runner.model
    cfg = engine.model_config
    b = torch.empty((), dtype=model.dtype).element_size()
    sync = _sync_fn(model.device)

    machine = measure_machine(model.dtype, model.device)
    prefills: list[StepRun] = []
    decodes: list[StepRun] = []
    with instrument(model, sync) as records:
        _, _, first_token = _run_once(engine, ids, "warmup", records, sync)
        start = time.perf_counter()
        for i in range(ENGINE_RUNS):
            if i and time.perf_counter() - start > ENGINE_BUDGET_S:
                break
            pre, dec, _ = _run_once(engine, ids, f"run{i}", records, sync)
            prefills.append(pre)
            decodes.append(dec)
    t = len(ids)
    bs = engine.cache_config.block_size
    phases = [
        _build_phase(
            "prefill",
            cfg,
            t,
            t,
            b,
            _median_run(prefills),
            time_layer_ops(model, layer_inputs(model, bs, ids, t, decode=False)),
        ),
        _build_phase(
            "decode",
            cfg,
            1,
            t + 1,
            b,
            _median_run(decodes),
            time_layer_ops(model, layer_inputs(model, bs, [first_token], t + 1, decode=True)),
        ),
    ]
    model_path = args.model
    if args.json:
        record = to_json(args.prompt, ids, model_path, cfg, machine, phases, b, len(prefills))
        print(json.dumps(record))
    else:
        render(args.prompt, ids, model_path, cfg, machine, phases, len(prefills))
    sys.stdout.flush()
    return 0
