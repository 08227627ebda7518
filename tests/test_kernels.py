"""pdserve's own kernels (`engine/kernels/csrc`), the batch-invariant attention, and the kernel
selection (`engine.kernels.select`): against float64 references, bit for bit across batch
shapes, and the selection's rules (tolerance, invariance probe, cache, names, fallback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine import native
from engine.attention import (
    PrefillKernel,
    aligned,
    blocked_prefill_attention,
    sdpa_prefill_attention,
)
from engine.config import ModelConfig
from engine.kernels import OPS, Candidate, KernelSet, workloads
from engine.kernels import select as selection
from engine.model_weights import ModelWeights
from engine.weights import load_weights
from pdserve.models import resolve_model
from tests.test_attention import _prefill_reference

needs_brgemm = pytest.mark.skipif(
    not native.brgemm_bf16(),
    reason=f"no bf16 brgemm here ({native.why_not() or 'this CPU packs no bf16 for brgemm'})",
)
ROOT = Path(__file__).resolve().parents[1]


# ---- the brgemm linear kernel ---------------------------------------------------------------
def _linear_case(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    res = torch.randn(m, n, generator=g).bfloat16()
    return x, w, bias, res


@needs_brgemm
@pytest.mark.parametrize(("m", "n", "k"), [(1, 960, 576), (33, 100, 640), (300, 1536, 576)])
def test_packed_linear_matches_float64(m: int, n: int, k: int) -> None:
    """x @ W^T + bias + residual against float64 from the same bf16 inputs: one bf16
    rounding of the float32 sum (N need not fill whole 64-column panels)."""
    ext = native.load()
    assert ext is not None
    x, w, bias, res = _linear_case(m, n, k)
    got = ext.packed_linear(x, ext.pack_linear_weight(w), n, bias, res)
    want = x.double() @ w.double().t() + bias.double() + res.double()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < 4e-3, rel  # bf16 rounds at 2^-9 relative; float32 sums add far less
    plain = torch.nn.functional.linear(x, w, bias) + res  # torch's path, rounded twice
    assert float((got.double() - plain.double()).abs().max()) < 0.1


@needs_brgemm
def test_packed_linear_rows_do_not_depend_on_the_batch() -> None:
    """A row's bits are the same alone, in any batch, at any position and on 1 or 2
    threads: what batch invariance rests on (oneDNN's matmul fails this)."""
    ext = native.load()
    assert ext is not None
    x, w, bias, res = _linear_case(1500, 960, 576)
    panels = ext.pack_linear_weight(w)
    full = ext.packed_linear(x, panels, 960, bias, res)
    for m in (1, 2, 17, 32, 33, 100, 512):
        assert torch.equal(ext.packed_linear(x[:m], panels, 960, bias, res[:m]), full[:m]), m
    for start in (1, 13, 40):
        part = ext.packed_linear(x[start : start + 50], panels, 960, bias, res[start : start + 50])
        assert torch.equal(part, full[start : start + 50]), start
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ext.packed_linear(x[:64], panels, 960, bias, res[:64]), full[:64])
    finally:
        torch.set_num_threads(threads)


# ---- the aligned (batch-invariant) prefill attention ---------------------------------------
ALIGNED = [aligned(sdpa_prefill_attention), aligned(blocked_prefill_attention)]


@pytest.mark.parametrize("kernel", ALIGNED, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("q_len", "ctx", "window"),
    [(300, 300, None), (200, 333, None), (16, 256, None), (200, 333, 40), (129, 129, 150)],
    ids=["prompt", "tail", "chunk-at-boundary", "window", "wide-window"],
)
def test_aligned_prefill_matches_float64(
    kernel: PrefillKernel, q_len: int, ctx: int, window: int | None
) -> None:
    """float32 within float32 noise of an eager float64 reference; bf16 within bf16's:
    causal masks, windows, GQA (9 query heads on 3), prefixes and block boundaries."""
    g = torch.Generator().manual_seed(q_len + ctx)
    q = torch.randn(q_len, 9, 64, generator=g)
    k, v = (torch.randn(ctx, 3, 64, generator=g) for _ in range(2))
    fn = kernel
    got = fn(q, k, v, window, 0.125)
    assert got.shape == (q_len, 9 * 64)
    assert float((got.double() - _prefill_reference(q, k, v, window)).abs().max()) < 1e-5
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    want16 = _prefill_reference(qb.float(), kb.float(), vb.float(), window)
    got16 = fn(qb, kb, vb, window, 0.125)
    assert float((got16.double() - want16).abs().max()) < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ALIGNED, ids=lambda f: f.__name__)
def test_aligned_prefill_rows_do_not_depend_on_chunks(
    kernel: PrefillKernel, dtype: torch.dtype
) -> None:
    """A query row's bits are the same in the whole prompt, in a tail after any cached
    prefix and in any 16-token chunk (with and without a sliding window)."""
    g = torch.Generator().manual_seed(5)
    n = 420
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    k, v = (torch.randn(n, 3, 64, generator=g).to(dtype) for _ in range(2))
    fn = kernel
    for window in (None, 100):
        whole = fn(q, k, v, window, 0.125)
        for s in (1, 100, 128, 255, 419):
            assert torch.equal(fn(q[s:], k, v, window, 0.125), whole[s:]), (window, s)
        for s in range(0, n, 48):
            e = min(n, s + 16)
            part = fn(q[s:e], k[:e], v[:e], window, 0.125)
            assert torch.equal(part, whole[s:e]), (window, s)


# ---- the selection --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, ModelWeights]:
    path = resolve_model("tiny")
    cfg = ModelConfig.from_hf(path)
    return cfg, load_weights(path, cfg, torch.float32, "cpu")


def test_selection_is_cached_and_read_back(
    tiny: tuple[ModelConfig, ModelWeights], tmp_path: Path
) -> None:
    """The first start measures and writes the choice, keyed by the CPU, torch, dtype,
    threads and shapes; the second reads it and measures nothing."""
    cfg, w = tiny
    first = selection.select(cfg, w, "auto", False, cache_dir=tmp_path)
    assert first.source == "measured" and first.seconds > 0
    (path,) = tmp_path.glob("*.json")
    key = json.loads(path.read_text())["key"]
    assert key["torch"] == torch.__version__ and key["threads"] == torch.get_num_threads()
    assert key["cpu_model"] == selection.cpu_identity()["cpu_model"]
    second = selection.select(cfg, w, "auto", False, cache_dir=tmp_path)
    assert second.source == "cache" and second.kernels == first.kernels
    assert "from the cache" in second.line()
    for op, name in first.kernels.as_dict().items():  # the line names every op's choice
        assert f"{op}={name}" in first.line()


def test_named_kernels_and_bad_names(
    tiny: tuple[ModelConfig, ModelWeights], tmp_path: Path
) -> None:
    cfg, w = tiny
    sel = selection.select(cfg, w, "reference", False, cache_dir=tmp_path)
    assert sel.kernels == KernelSet.reference() and sel.source == "named"
    sel = selection.select(
        cfg, w, "projections=plain,decode_attention=matmul", False, cache_dir=tmp_path
    )
    assert sel.kernels.projections == "plain" and sel.kernels.decode_attention == "matmul"
    with pytest.raises(ValueError, match="decode_attention has no kernel 'fast'"):
        selection.select(cfg, w, "decode_attention=fast", False, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="not auto, reference or OP=NAME"):
        selection.select(cfg, w, "whatever", False, cache_dir=tmp_path)


def _wrong(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)  # fast and wrong


def _batch_variant(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Right to 1e-6, but a row's value depends on whether others share its batch."""
    return _rowwise(q, k, v, mask, scale) * (1 + 1e-6 * (q.shape[0] > 1))


def _rowwise(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Each row alone over its own keys: batch-invariant by construction."""
    from engine.attention import sdpa_attention

    lens = [k.shape[2]] * q.shape[0] if mask is None else mask.view(q.shape[0], -1).sum(1).tolist()
    rows = [
        sdpa_attention(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], None, scale)
        for i, n in enumerate(lens)
    ]
    return torch.cat(rows)


def test_a_wrong_or_batch_variant_candidate_is_never_chosen(
    tiny: tuple[ModelConfig, ModelWeights], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A candidate outside its dtype's tolerance against float64 is not timed, however fast;
    with invariance on, one whose row changes with the batch is not either."""
    cfg, w = tiny
    ops = dict(OPS)
    ops["decode_attention"] = (
        Candidate("rowwise", _rowwise, lambda d, t: True),
        Candidate("wrong", _wrong, lambda d, t: True),
        Candidate("variant", _batch_variant, lambda d, t: True),
    )
    monkeypatch.setattr(selection, "OPS", ops)
    monkeypatch.setattr("engine.kernels.OPS", ops)
    pools = selection._pools({}, torch.device("cpu"), torch.float32, True)
    bench = workloads._decode_bench(cfg, w, torch.float32, torch.device("cpu"), torch.Generator())
    timing = selection._time_op(pools["decode_attention"], bench, torch.float32, True)
    assert timing.median_ms["wrong"] is None and "error" in timing.why["wrong"]
    assert timing.median_ms["variant"] is None and "batch-variant" in timing.why["variant"]
    assert timing.chosen == "rowwise" and timing.invariant


def test_the_row_floor_probe_finds_a_path_that_rounds_some_rows_otherwise(
    tiny: tuple[ModelConfig, ModelWeights],
) -> None:
    """A GEMM whose one-row calls sum in another order (a GEMV path) changes only the rows
    whose sum lands near a rounding boundary: about one in five on the default model on an
    AMD EPYC without bf16 brgemm, where the census then found batched requests' tokens
    changed. Here a one-row call perturbs rows with a positive first input (half of them),
    so one row tried alone passes half the time: the probe must try many rows, find it,
    and pad one-row calls to two."""
    cfg, _ = tiny

    def invariant(h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return h[:, :8].float() * 2  # row by row, whatever the call (no reduction at all)

    def gemv_differs(h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        out = invariant(h, o)
        if h.shape[0] == 1 and h[0, 0] > 0:
            out = out + 1e-3
        return out

    floors = {}
    for name, fn in (("gemv", gemv_differs), ("rowwise", invariant)):
        # a fresh generator each time: the probe's rows are what they would be at start-up
        gen = torch.Generator().manual_seed(0)
        floors[name] = workloads._row_floor(fn, cfg, torch.float32, torch.device("cpu"), gen, "qkv")
    assert floors == {"gemv": 2, "rowwise": 1}


class _Clock:
    """A clock the timed callables advance, so a timing test depends on no machine's load."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: dict[str, int] = {}

    def work(self, name: str, ms: float, *more_ms: float) -> Callable[[], None]:
        """A callable taking `ms`, then each of `more_ms` in turn, round and round."""
        cycle = (ms, *more_ms)

        def fn() -> None:
            n = self.calls.get(name, 0)
            self.calls[name] = n + 1
            self.now += cycle[n % len(cycle)] / 1e3

        return fn


def test_a_candidate_beaten_beyond_noise_is_timed_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """After `DECIDE_ROUNDS` rounds a candidate whose fastest round is `DECISIVE` times
    another's slowest stops being timed; close ones go on to `MIN_ROUNDS` at least, and the
    medians are each candidate's own."""
    clock = _Clock()
    monkeypatch.setattr(selection, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(selection, "BUDGET_S", 0.0)  # stop at MIN_ROUNDS
    fns = {
        "fast": clock.work("fast", 10.0),
        "close": clock.work("close", 1.4 * 10.0),
        "slow": clock.work("slow", 1.6 * 10.0),
    }
    medians, _ = selection._alternate(fns)
    assert clock.calls == {
        "fast": selection.MIN_ROUNDS,
        "close": selection.MIN_ROUNDS,
        "slow": selection.DECIDE_ROUNDS,
    }
    assert medians == pytest.approx({"fast": 10.0, "close": 14.0, "slow": 16.0})
    quiet = dict.fromkeys(medians, 0.0)
    assert selection._pick(["slow", "close", "fast"], medians, quiet) == "fast"


def test_one_stretched_round_keeps_no_far_slower_candidate_in_the_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy host stretches one of the fast candidate's first rounds to 8 ms (its others 1
    ms); the slow one runs 10 ms every round: it is dropped after `DECIDE_ROUNDS` all the
    same (a 64-wide model's flash prefill, 0.34 ms against SDPA's 3.7, was timed on to the
    busy-host budget by such a round)."""
    clock = _Clock()
    monkeypatch.setattr(selection, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(selection, "BUDGET_S", 0.0)
    fns = {"slow": clock.work("slow", 10.0), "fast": clock.work("fast", 8.0, 1.0, 1.0, 1.0)}
    selection._alternate(fns)
    assert clock.calls["slow"] == selection.DECIDE_ROUNDS


def test_a_busy_hosts_measurement_takes_the_fastest_and_is_provisional(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rounds that swing by 40 ms (other processes' load) make every tie mean nothing: the
    op is timed past its budget, its fastest median wins where a tie "within the noise"
    would have kept the simpler (slower) candidate, and the choice is cached only for
    `PROVISIONAL_S`; a quiet choice of the same age is still read."""
    clock = _Clock()
    fake_time = SimpleNamespace(perf_counter=lambda: clock.now, time=lambda: clock.now)
    monkeypatch.setattr(selection, "time", fake_time)
    monkeypatch.setattr(selection, "BUDGET_S", 0.0)
    fns = {"simple": clock.work("simple", 14.0, 60.0), "fast": clock.work("fast", 10.0, 50.0)}
    medians, errors = selection._alternate(fns)
    assert clock.calls["fast"] > selection.MIN_ROUNDS  # timed on, past the budget
    order = ["simple", "fast"]
    assert selection._pick(order, medians, errors) == "simple"  # the tie the noise makes
    assert selection._choose(order, medians, errors) == ("fast", True)

    def timing(noisy: bool) -> selection.OpTiming:
        return selection.OpTiming("fast", {"simple": 40.0, "fast": 30.0}, noisy=noisy)

    key = {"k": 1}
    for noisy in (True, False):
        path = tmp_path / f"{noisy}.json"
        sel = selection.Selection(KernelSet(), "measured", {"prefill_attention": timing(noisy)})
        selection._write(path, key, sel)
        read = selection._read(path, key)
        assert read is not None and read.noisy == noisy
        assert noisy == ("busy host" in read.line())
        clock.now += selection.PROVISIONAL_S + 1
        assert (selection._read(path, key) is None) == noisy


def test_a_busy_host_does_not_hold_up_a_choice_the_noise_cannot_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rounds that swing (10 or 13 ms, 14.5 or 19.5 ms) beyond `NOISY` of the fastest
    median, but the fast candidate wins beyond that noise: timing stops at `MIN_ROUNDS`
    (the budget), the fastest is taken and the choice is not provisional (the suite's
    workers spent 10 s on a tiny model's clear choices, timed on to the busy-host budget)."""
    clock = _Clock()
    monkeypatch.setattr(selection, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(selection, "BUDGET_S", 0.0)
    fns = {"simple": clock.work("simple", 14.5, 19.5), "fast": clock.work("fast", 10.0, 13.0)}
    medians, errors = selection._alternate(fns)
    assert clock.calls == dict.fromkeys(fns, selection.MIN_ROUNDS)
    order = ["simple", "fast"]
    assert max(errors.values()) > selection.NOISY * medians["fast"]  # a busy host's swings
    assert selection._choose(order, medians, errors) == ("fast", False)


def test_without_pdserve_kernels_torch_serves_and_says_so(tmp_path: Path) -> None:
    """PDSERVE_NATIVE_KERNELS=0 (as a machine without a compiler): the engine starts on
    torch's kernels, and the startup line says why ours are missing."""
    code = (
        "import torch, sys\n"
        "from engine.engine import EngineConfig, LLMEngine\n"
        "from pdserve.models import resolve_model\n"
        "e = LLMEngine.from_config(EngineConfig(model=str(resolve_model('tiny')), "
        "dtype='bfloat16'))\n"
        "print(e.kernel_selection.line())\n"
        "print(type(e.runner.model.proj).__name__)\n"
    )
    env = {**os.environ, "PDSERVE_NATIVE_KERNELS": "0", "PDSERVE_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert "pdserve kernels unavailable: switched off" in out[-2], out
    assert out[-1] != "BrgemmProjections"


# ---- decode attention on the pages ----------------------------------------------------------
needs_native = pytest.mark.skipif(
    native.load() is None, reason=f"no pdserve kernels: {native.why_not()}"
)


@needs_native
@pytest.mark.parametrize(
    ("dtype", "form"),
    [(torch.float32, "paged"), (torch.bfloat16, "paged"), (torch.bfloat16, "paged-dpbf16")],
)
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dim", [64, 48])
def test_paged_decode_matches_float64_and_ignores_the_batch(
    dtype: torch.dtype, form: str, window: int | None, dim: int
) -> None:
    """Each row against eager float64 attention over its own keys (GQA, windows, lengths at
    and around the 256-key partitions, the 16-key groups of the dpbf16 scores and the
    16-token pages, a head_dim whose last 16 elements the dpbf16 scores load masked,
    scattered pages); then bit for bit the same alone, in the batch, on one
    thread and from pages with loose rows."""
    from engine.kernels import candidate
    from engine.kernels.workloads import as_pages

    paged_decode_attention = candidate("decode_attention", form).impl
    if not paged_decode_attention.available(torch.device("cpu"), dtype):
        pytest.skip(f"{form} in {dtype}: not on this CPU (AVX512-BF16)")

    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 17, 255, 256, 257, 600, 1040, 513, 270, 31])
    b, span = len(lens), int(lens.max())
    q = torch.randn(b, 9, dim, generator=g).to(dtype)
    k, v = (torch.randn(b, 3, span, dim, generator=g).to(dtype) for _ in range(2))
    (kp, tables), (vp, _) = as_pages(k), as_pages(v)
    perm = torch.randperm(kp.shape[0], generator=g)  # pages anywhere in the cache
    kp, vp = kp[perm].contiguous(), vp[perm].contiguous()
    tables = torch.argsort(perm)[tables]
    out = paged_decode_attention(q, kp, vp, tables, lens, window, 0.125)
    assert out.shape == (b, 9 * dim) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, n in enumerate(lens.tolist()):
        lo = 0 if window is None else max(0, n - window)
        kk = k[i, :, lo:n].double().repeat_interleave(3, 0)  # [H, n, D]
        vv = v[i, :, lo:n].double().repeat_interleave(3, 0)
        probs = (torch.einsum("hd,hsd->hs", q[i].double(), kk) * 0.125).softmax(-1)
        want = torch.einsum("hs,hsd->hd", probs, vv).reshape(-1)
        assert float((out[i].double() - want).abs().max()) < tol, (i, n)
        alone = paged_decode_attention(
            q[i : i + 1], kp, vp, tables[i : i + 1], lens[i : i + 1], window, 0.125
        )
        assert torch.equal(alone, out[i : i + 1]), (i, n)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(paged_decode_attention(q, kp, vp, tables, lens, window, 0.125), out)
    finally:
        torch.set_num_threads(threads)
    # pages whose token rows are not packed (a row stride beyond the heads) are copied row
    # by row: the same bits
    kpad, vpad = (torch.zeros(*p.shape[:2], 4, dim, dtype=dtype) for p in (kp, vp))
    kpad[:, :, :3], vpad[:, :, :3] = kp, vp
    loose = paged_decode_attention(q, kpad[:, :, :3], vpad[:, :, :3], tables, lens, window, 0.125)
    assert torch.equal(loose, out)


# ---- prefill attention on the pages (flash) ---------------------------------------------------
def _paged_requests(
    lens: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """Requests of (query rows, context) in one cache, their pages scattered: the per-request
    (q, k, v) and the kernel's inputs (q, k_pages, v_pages, tables, starts, lens)."""
    from engine.attention import as_pages

    g = torch.Generator().manual_seed(seed)
    reqs = [
        (
            torch.randn(ql, heads, dim, generator=g).to(dtype),
            torch.randn(n, kv_heads, dim, generator=g).to(dtype),
            torch.randn(n, kv_heads, dim, generator=g).to(dtype),
        )
        for ql, n in lens
    ]
    width = max(-(-n // 16) for _, n in lens)
    kps, vps, tables, base = [], [], [], 0
    for _, k, v in reqs:
        (kp, t), (vp, _) = (as_pages(x.transpose(0, 1)[None]) for x in (k, v))
        row = torch.zeros(width, dtype=torch.long)
        row[: t.shape[1]] = t[0] + base
        kps.append(kp), vps.append(vp), tables.append(row)
        base += kp.shape[0]
    perm = torch.randperm(base, generator=g)  # pages anywhere in the cache
    kp, vp = torch.cat(kps)[perm].contiguous(), torch.cat(vps)[perm].contiguous()
    table = torch.argsort(perm)[torch.stack(tables)]
    starts = torch.tensor([0] + [ql for ql, _ in lens]).cumsum(0)
    q = torch.cat([r[0] for r in reqs])
    return reqs, (q, kp, vp, table, starts, torch.tensor([n for _, n in lens]))


FLASH_CASES = [
    pytest.param(9, 3, 64, None, id="gqa"),
    pytest.param(9, 3, 64, 100, id="gqa-window"),
    pytest.param(8, 8, 128, None, id="mha-d128"),
    pytest.param(32, 1, 64, 50, id="mqa-window"),
]
# (query rows, context): whole prompts, tails after a prefix, decode-like single rows, and
# lengths at and around the 256-key parts and the 16-token pages
FLASH_LENS = [(300, 300), (37, 700), (1, 1), (1, 256), (2, 257), (513, 1025), (16, 528)]
# the flash kernel's forms in each dtype: bf16 products (brgemm's VNNI pairs, or AVX512-BF16
# dot products) and float32 ones
FLASH_FORMS = [
    (torch.float32, "flash"),
    (torch.bfloat16, "flash"),
    (torch.bfloat16, "flash-f32"),
    (torch.bfloat16, "flash-dpbf16"),
]


def _flash(form: str, dtype: torch.dtype) -> Any:
    """The flash kernel's `form`, or a skip naming why it cannot run here."""
    from engine.kernels import candidate

    impl = candidate("prefill_attention", form).impl
    if not impl.available(torch.device("cpu"), dtype):
        pytest.skip(f"{form} in {dtype}: not on this CPU (bf16 brgemm or AVX512-BF16)")
    return impl


@needs_native
@pytest.mark.parametrize(("dtype", "form"), FLASH_FORMS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window"), FLASH_CASES)
def test_flash_prefill_matches_float64(
    dtype: torch.dtype, form: str, heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    """Several requests in one call against eager float64 attention, each over its own keys:
    causal masks, windows, GQA / MHA / MQA, part and page boundaries, scattered pages."""
    paged_flash_attention = _flash(form, dtype)
    reqs, args = _paged_requests(FLASH_LENS, heads, kv_heads, dim, dtype, seed=heads + dim)
    out = paged_flash_attention.paged(*args, window, dim**-0.5)
    starts = args[4].tolist()
    assert out.shape == (starts[-1], heads * dim) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (q, k, v) in enumerate(reqs):
        want = _prefill_reference(q.float(), k.float(), v.float(), window)
        got = out[starts[i] : starts[i + 1]].double()
        assert float((got - want).abs().max()) < tol, (i, FLASH_LENS[i])


@needs_native
@pytest.mark.parametrize(("dtype", "form"), FLASH_FORMS)
@pytest.mark.parametrize("window", [None, 100])
def test_flash_prefill_rows_do_not_depend_on_the_call(
    dtype: torch.dtype, form: str, window: int | None
) -> None:
    """A row's bits are the same in the whole prompt, beside other requests, in a tail after
    any cached prefix, in any 16-token chunk, alone as a decode-like single row, and on one
    thread: batch invariance by construction, no aligned padding."""
    paged_flash_attention = _flash(form, dtype)
    n = 600
    _, (q, kp, vp, table, starts, lens) = _paged_requests(
        [(n, n), (40, 900), (1, 77)], 9, 3, 64, dtype, seed=7
    )
    both = paged_flash_attention.paged(q, kp, vp, table, starts, lens, window, 0.125)
    one = table[:1]

    def rows(lo: int, hi: int) -> torch.Tensor:  # the first request's rows lo .. hi-1
        s, c = torch.tensor([0, hi - lo]), torch.tensor([hi])
        return paged_flash_attention.paged(q[lo:hi], kp, vp, one, s, c, window, 0.125)

    whole = rows(0, n)
    assert torch.equal(whole, both[:n])
    for s in (1, 100, 255, 256, 599):
        assert torch.equal(rows(s, n), whole[s:]), ("tail", s)
    for s in range(0, n, 112):
        assert torch.equal(rows(s, s + 16), whole[s : s + 16]), ("chunk", s)
    for p in (0, 255, 256, 431):
        assert torch.equal(rows(p, p + 1), whole[p : p + 1]), ("row", p)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        again = paged_flash_attention.paged(q, kp, vp, table, starts, lens, window, 0.125)
        assert torch.equal(again, both)
    finally:
        torch.set_num_threads(threads)


# ---- fused elementwise kernels: RMSNorm, RoPE with the K/V write ------------------------------
@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_plus", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("width", [576, 100])
def test_fused_norm_matches_torch_and_ignores_the_batch(
    dtype: torch.dtype, one_plus: bool, width: int
) -> None:
    """The one-kernel RMSNorm against torch's form (HF's roundings: Llama's two, Gemma's
    one), against float64, and a row's bits alone equal to its bits among 300."""
    from engine.norms import fused_rms_norm, torch_norm

    g = torch.Generator().manual_seed(width)
    x = (torch.randn(300, width, generator=g) * 3).to(dtype)
    w = torch.rand(width, generator=g) + 0.5
    w = w if one_plus else w.to(dtype)
    got, want = fused_rms_norm(x, w, 1e-6, one_plus), torch_norm(x, w, 1e-6, one_plus)
    assert got.shape == x.shape and got.dtype == dtype
    # float32: the sum of squares' order differs from torch's; bf16: at most one step
    step = 1e-6 if dtype == torch.float32 else torch.finfo(torch.bfloat16).eps

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a.double() - b.double()) / b.double().abs().clamp_min(1)).abs().max())

    assert rel(got, want) <= step
    x64 = x.double()
    ref = x64 * (x64.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * w.double()
    assert rel(got, ref) < 3 * step
    for r in (1, 7, 33):
        assert torch.equal(fused_rms_norm(x[:r], w, 1e-6, one_plus), got[:r])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128), (2, 1, 80)])
def test_fused_rope_write_gives_torchs_bits(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """RoPE fused with the K/V write: the rotated q and k, and the cache rows written at the
    slots, bit for bit those of torch's form (`engine.rope.rope_write`), on q/k/v taken as
    strided views of one qkv product as the model does."""
    from engine.rope import fused_rope_write, rope_write

    g = torch.Generator().manual_seed(dim)
    t = 37
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    ang = torch.randn(t, 1, dim // 2, generator=g) * 10
    cos = torch.cat((ang, ang), -1).cos().to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin()), -1).to(dtype)
    slots = torch.randperm(100, generator=g)[:t]
    caches = [torch.zeros(100, kv_heads, dim, dtype=dtype) for _ in range(4)]
    want = rope_write(qk, v, cos, sin, caches[0], caches[1], slots)
    got = fused_rope_write(qk, v, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert torch.equal(caches[2][slots], got[:, heads:])  # the rotated keys were stored
