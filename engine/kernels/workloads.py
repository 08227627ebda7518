"""The kernel selection's workloads: each op's inputs at the model's own shapes, its float64
reference and its invariance probe (`engine.kernels.select` times and checks with them;
`make bench-kernels` re-times with them).

What must hold: a workload times what the engine would run for that op (the paged decode
kernel on pages laid out as the cache holds them), and a probe compares bits, never a
tolerance: batch invariance means the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import PagedDecode, PagedPrefill, as_pages
from engine.config import ModelConfig
from engine.kernels import Candidate, candidate
from engine.model_weights import LayerWeights, ModelWeights

PROMPT_ROWS, DECODE_BATCH, DECODE_CTX = 512, 8, 512
"""The shapes timed: a 512-token prompt pass and an 8-request decode step over 512 keys.
The projections' cost weighs one prompt pass against 8 decode steps: a 512-in / 64-out
request decoded in a batch of 8 (the load `make bench-peers` serves)."""
DECODE_STEPS_PER_PROMPT = 8


@dataclass
class Bench:
    """An op's workload at the model's shapes.

    `run(candidate, floors)`: a callable computing its outputs (one tensor per shape timed);
    `reference()`: those outputs in float64; `probe(candidate)`: None when a row's result
    is independent of its batch, else why not, plus the row floors it needs (projections).
    """

    run: Callable[[Candidate, dict[str, int]], Callable[[], list[torch.Tensor]]]
    reference: Callable[[], list[torch.Tensor]]
    probe: Callable[[Candidate], tuple[str | None, dict[str, int]]]


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal values held in float64 for the references, drawn in float32: torch's
    float64 `randn` is not vectorized (7x slower here), and these are every input of the
    selection's probes. Each value is exact in float64, so a reference sees the inputs the
    candidates see."""
    return torch.randn(*shape, generator=gen, dtype=torch.float32).double()


PROBE_SPANS = (64, 700, 2048)
"""Decode contexts the invariance probe tries (a batch of 8 below each, against alone)."""
PROBE_PROMPT = 600
"""The prefill probe's prompt; its tails and 16-row chunks are compared with it."""


def _decode_bench(
    cfg: ModelConfig, w: ModelWeights, dtype: torch.dtype, dev: torch.device, gen: Any
) -> Bench:
    b, h, hkv, d, s = DECODE_BATCH, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, DECODE_CTX
    q64, k64, v64 = _rand(gen, b, h, d), _rand(gen, b, hkv, s, d), _rand(gen, b, hkv, s, d)
    lens = torch.linspace(s // 2, s, b).long()
    mask = (torch.arange(s)[None, :] < lens[:, None]).view(b, 1, 1, s)
    scale = d**-0.5
    q, k, v = (t.to(dev, dtype) for t in (q64, k64, v64))
    dmask = mask.to(dev)

    def run(c: Candidate, floors: dict[str, int]) -> Callable[[], list[torch.Tensor]]:
        if isinstance(c.impl, PagedDecode):  # the pages laid out once, as the cache holds them
            (kp, tables), (vp, _) = as_pages(k), as_pages(v)
            dlens = lens.to(dev)
            return lambda: [c.impl(q, kp, vp, tables, dlens, None, scale)]
        return lambda: [c.impl(q, k, v, dmask, scale)]

    def reference() -> list[torch.Tensor]:
        g = h // hkv
        kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)  # [B, H, S, D]
        sc = torch.einsum("bhd,bhsd->bhs", q64, kk) * scale
        sc = sc.masked_fill(~mask.view(b, 1, s), float("-inf"))
        return [torch.einsum("bhs,bhsd->bhd", sc.softmax(-1), vv).reshape(b, -1)]

    def probe(c: Candidate) -> tuple[str | None, dict[str, int]]:
        for span in PROBE_SPANS:
            qs = _rand(gen, b, h, d).to(dev, dtype)
            ks, vs = (_rand(gen, b, hkv, span, d).to(dev, dtype) for _ in range(2))
            lens = torch.randint(1, span + 1, (b,), generator=gen)
            lens[0] = span
            m = (torch.arange(span)[None, :] < lens[:, None]).view(b, 1, 1, span).to(dev)
            batch = _decode_call(c, qs, ks, vs, m, scale)
            for i, n in enumerate(lens.tolist()):
                one = (qs[i : i + 1], ks[i : i + 1, :, :n], vs[i : i + 1, :, :n])
                alone = _decode_call(c, *one, None, scale)
                if not torch.equal(alone, batch[i : i + 1]):
                    return f"batch-variant at {span} keys", {}
        return None, {}

    return Bench(run, reference, probe)


def _decode_call(
    c: Candidate,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Candidate `c` on a gathered context (mask [B, 1, 1, S] or None), paged if it reads
    pages."""
    if not isinstance(c.impl, PagedDecode):
        out: torch.Tensor = c.impl(q, k, v, mask, scale)
        return out
    lens = torch.full((q.shape[0],), k.shape[2]) if mask is None else mask.flatten(1).sum(1)
    (kp, tables), (vp, _) = as_pages(k), as_pages(v)
    return c.impl(q, kp, vp, tables, lens.to(q.device), None, scale)


def _prefill_bench(
    cfg: ModelConfig, w: ModelWeights, dtype: torch.dtype, dev: torch.device, gen: Any
) -> Bench:
    t, h, hkv, d = PROMPT_ROWS, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    window = cfg.sliding_windows[0]
    q64, k64, v64 = _rand(gen, t, h, d), _rand(gen, t, hkv, d), _rand(gen, t, hkv, d)
    scale = d**-0.5
    q, k, v = (x.to(dev, dtype) for x in (q64, k64, v64))

    def run(c: Candidate, floors: dict[str, int]) -> Callable[[], list[torch.Tensor]]:
        if isinstance(c.impl, PagedPrefill):  # the pages laid out once, as the cache holds them
            (kp, tables), (vp, _) = (as_pages(x.transpose(0, 1)[None]) for x in (k, v))
            starts, lens = torch.tensor([0, t]), torch.tensor([t])
            return lambda: [c.impl.paged(q, kp, vp, tables, starts, lens, window, scale)]
        return lambda: [c.impl(q, k, v, window, scale)]

    def reference() -> list[torch.Tensor]:
        g = h // hkv
        kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)  # [T, H, D]
        sc = torch.einsum("qhd,khd->hqk", q64, kk) * scale
        pos = torch.arange(t)
        keep = pos[None, :] <= pos[:, None]
        if window is not None:
            keep &= pos[None, :] > pos[:, None] - window
        sc = sc.masked_fill(~keep, float("-inf"))
        return [torch.einsum("hqk,khd->qhd", sc.softmax(-1), vv).reshape(t, -1)]

    def probe(c: Candidate) -> tuple[str | None, dict[str, int]]:
        n = PROBE_PROMPT
        qp, kp, vp = (_rand(gen, n, x, d).to(dev, dtype) for x in (h, hkv, hkv))
        whole = c.impl(qp, kp, vp, window, scale)
        for s in (1, 16, 100, 128, 300, n - 1):  # a tail after a cached prefix of s tokens
            if not torch.equal(c.impl(qp[s:], kp, vp, window, scale), whole[s:]):
                return f"differs after a {s}-token prefix", {}
        for s in (0, 112, 224, 512, 576):  # a 16-token chunk
            e = s + 16
            if not torch.equal(c.impl(qp[s:e], kp[:e], vp[:e], window, scale), whole[s:e]):
                return f"differs in the chunk at {s}", {}
        return None, {}

    return Bench(run, reference, probe)


FLOOR_ROWS = (
    1,
    2,
    3,
    4,
    8,
    16,
    31,
    32,
    33,
    48,
    64,
    65,
    96,
    128,
    129,
    200,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
)
"""Row counts the projections' probe compares; a GEMM row's bits must not change from the
floor up to the largest (a step's prompt chunks; `lm_head` sees at most `HEAD_ROWS`)."""
HEAD_ROWS = 256
FLOOR_LIMIT = 256
PROBE_ROWS = 48
"""Rows each row count's windows cover in the projections' probe (`_row_floor`)."""
"""A floor above this costs a decode step too much: the candidate is not invariant."""


def _projection_bench(
    cfg: ModelConfig, w: ModelWeights, dtype: torch.dtype, dev: torch.device, gen: Any
) -> Bench:
    """One layer's qkv, o + residual and MLP + residual, on a prompt's rows and on
    `DECODE_STEPS_PER_PROMPT` decode steps' (one output tensor per shape)."""
    lw = w.layers[0]
    one = ModelWeights(embed=w.embed, layers=[lw], norm=w.norm, lm_head=w.lm_head)
    xs64 = [_rand(gen, PROMPT_ROWS, cfg.hidden_size), _rand(gen, DECODE_BATCH, cfg.hidden_size)]
    os64 = [_rand(gen, x.shape[0], cfg.q_size) for x in xs64]
    xs = [x.to(dev, dtype) for x in xs64]
    os_ = [o.to(dev, dtype) for o in os64]

    def layer(p: Any, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        qkv = p.qkv(0, x)
        res = p.o_residual(0, o, x.clone())
        res = p.mlp_residual(0, x, res)
        return torch.cat((qkv.flatten(), res.flatten()))

    def run(c: Candidate, floors: dict[str, int]) -> Callable[[], list[torch.Tensor]]:
        p = c.impl(one, cfg.hidden_act, floors)

        def go() -> list[torch.Tensor]:
            out = [layer(p, xs[0], os_[0])]
            out += [layer(p, xs[1], os_[1]) for _ in range(DECODE_STEPS_PER_PROMPT)]
            return out[:2]

        return go

    def reference() -> list[torch.Tensor]:
        w64 = ModelWeights(
            embed=w.embed[:1].double(),
            layers=[_double_layer(lw)],
            norm=w.norm.double(),
            lm_head=w.lm_head[:1].double(),
        )
        p = candidate("projections", "plain").impl(w64, cfg.hidden_act)
        return [layer(p, x, o) for x, o in zip(xs64, os64, strict=True)]

    def probe(c: Candidate) -> tuple[str | None, dict[str, int]]:
        p = c.impl(one, cfg.hidden_act)
        floors = {}
        for kind in _kinds(cfg):
            floor = _row_floor(_kind_fn(p, kind), cfg, dtype, dev, gen, kind)
            if floor is None:
                return f"{kind} batch-variant above {FLOOR_LIMIT} rows", {}
            if floor > 1:
                floors[kind] = floor
        return None, floors

    return Bench(run, reference, probe)


def _kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The projection methods the model calls (Gemma 3 norms sublayer outputs first)."""
    if cfg.gemma_norms:
        return ("qkv", "o", "mlp", "lm_head")
    return ("qkv", "o_residual", "mlp_residual", "lm_head")


def _kind_fn(p: Any, kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """kind's product as fn(h [T, d], o [T, q]) on layer 0."""
    return {
        "qkv": lambda h, o: p.qkv(0, h),
        "o_residual": lambda h, o: p.o_residual(0, o, h.clone()),
        "mlp_residual": lambda h, o: p.mlp_residual(0, h, h.clone()),
        "o": lambda h, o: p.o(0, o),
        "mlp": lambda h, o: p.mlp(0, h),
        "lm_head": lambda h, o: p.lm_head(h),
    }[kind]


def _row_floor(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    cfg: ModelConfig,
    dtype: torch.dtype,
    dev: torch.device,
    gen: Any,
    kind: str,
) -> int | None:
    """The least row count in `FLOOR_ROWS` from which fn's rows equal those of its largest
    call bit for bit (None: none up to `FLOOR_LIMIT`).

    Each row count is tried on `PROBE_ROWS` rows' worth of windows, not on one: a GEMM path
    that sums in another order at some row count (a GEMV for one row) gives another
    rounding on a fraction of the rows only (one row in five or six at the default model's
    MLP on an AMD EPYC without bf16 brgemm), so a single row passes by luck."""
    rows = [r for r in FLOOR_ROWS if r <= (HEAD_ROWS if kind == "lm_head" else FLOOR_ROWS[-1])]
    h = _rand(gen, rows[-1], cfg.hidden_size).to(dev, dtype)
    o = _rand(gen, rows[-1], cfg.q_size).to(dev, dtype)
    full = fn(h, o)
    floor = None
    for r in reversed(rows[:-1]):
        windows = range(0, min(PROBE_ROWS, rows[-1] - r + 1), r)
        if not all(torch.equal(fn(h[k : k + r], o[k : k + r]), full[k : k + r]) for k in windows):
            break
        floor = r
    return floor if floor is not None and floor <= FLOOR_LIMIT else None


def _double_layer(lw: LayerWeights) -> LayerWeights:
    values = {
        k: (v.double().cpu() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in vars(lw).items()
    }
    return LayerWeights(**values)


def _norm_bench(
    cfg: ModelConfig, w: ModelWeights, dtype: torch.dtype, dev: torch.device, gen: Any
) -> Bench:
    """The model's RMSNorm (layer 0's input norm) on a prompt's rows and on a decode batch,
    weighed as the projections are (one prompt pass to `DECODE_STEPS_PER_PROMPT` steps)."""
    weight, eps, one_plus = w.layers[0].input_norm, cfg.rms_norm_eps, cfg.gemma_norms
    xs64 = [_rand(gen, PROMPT_ROWS, cfg.hidden_size), _rand(gen, DECODE_BATCH, cfg.hidden_size)]
    xs = [x.to(dev, dtype) for x in xs64]

    def run(c: Candidate, floors: dict[str, int]) -> Callable[[], list[torch.Tensor]]:
        def go() -> list[torch.Tensor]:
            out = [c.impl(xs[0], weight, eps, one_plus)]
            out += [c.impl(xs[1], weight, eps, one_plus) for _ in range(DECODE_STEPS_PER_PROMPT)]
            return out[:2]

        return go

    def reference() -> list[torch.Tensor]:
        w64 = weight.double().cpu()
        return [x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w64 for x in xs64]

    def probe(c: Candidate) -> tuple[str | None, dict[str, int]]:
        x = _rand(gen, 600, cfg.hidden_size).to(dev, dtype)
        whole = c.impl(x, weight, eps, one_plus)
        for r in (1, 3, 8, 33, 512):
            if not torch.equal(c.impl(x[:r], weight, eps, one_plus), whole[:r]):
                return f"batch-variant at {r} rows", {}
        return None, {}

    return Bench(run, reference, probe)


def _rope_bench(
    cfg: ModelConfig, w: ModelWeights, dtype: torch.dtype, dev: torch.device, gen: Any
) -> Bench:
    """RoPE on a step's query and key heads with the K/V cache write, on a prompt's rows and
    on a decode batch (weighed as the projections are), into a cache of the step's size."""
    heads, kv, d = cfg.num_heads + cfg.num_kv_heads, cfg.num_kv_heads, cfg.head_dim
    rows = (PROMPT_ROWS, DECODE_BATCH)
    qk64 = [_rand(gen, t, heads, d) for t in rows]
    v64 = [_rand(gen, t, kv, d) for t in rows]
    ang64 = [_rand(gen, t, 1, d // 2) for t in rows]
    cos64 = [torch.cat((a, a), -1).cos() for a in ang64]
    sin64 = [torch.cat((-a.sin(), a.sin()), -1) for a in ang64]  # `Rotary`'s signed sin
    qk, v, cos, sin = ([x.to(dev, dtype) for x in xs] for xs in (qk64, v64, cos64, sin64))
    slots = [torch.randperm(PROMPT_ROWS, generator=gen)[:t].to(dev) for t in rows]
    k_slots, v_slots = (torch.zeros(PROMPT_ROWS, kv, d, dtype=dtype, device=dev) for _ in "kv")

    def call(c: Candidate, i: int) -> torch.Tensor:
        out: torch.Tensor = c.impl(qk[i], v[i], cos[i], sin[i], k_slots, v_slots, slots[i])
        return out

    def run(c: Candidate, floors: dict[str, int]) -> Callable[[], list[torch.Tensor]]:
        def go() -> list[torch.Tensor]:
            out = [call(c, 0)]
            out += [call(c, 1) for _ in range(DECODE_STEPS_PER_PROMPT)]
            return out[:2]

        return go

    def reference() -> list[torch.Tensor]:
        return [x * c + x.roll(d // 2, -1) * s for x, c, s in zip(qk64, cos64, sin64, strict=True)]

    def probe(c: Candidate) -> tuple[str | None, dict[str, int]]:
        whole = call(c, 0)
        for r in (1, 8, 33):
            ins = (x[0][:r] for x in (qk, v, cos, sin))
            part = c.impl(*ins, k_slots, v_slots, slots[0][:r])
            if not torch.equal(part, whole[:r]):
                return f"batch-variant at {r} rows", {}
        return None, {}

    return Bench(run, reference, probe)


BENCHES: dict[str, Callable[..., Bench]] = {
    "decode_attention": _decode_bench,
    "prefill_attention": _prefill_bench,
    "projections": _projection_bench,
    "norm": _norm_bench,
    "rope_kv": _rope_bench,
}
