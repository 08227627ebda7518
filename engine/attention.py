"""Attention kernels, the candidates `engine.kernels.select` times for decode (one query per
request against its context) and prefill (a prompt chunk's queries, causal, against its
context). Which one runs is measured on the serving machine, never assumed from its CPU:
torch's SDPA won on an AMX Xeon and lost to the matmul forms on an AVX512-BF16 EPYC
(docs/benchmarks.md, "Kernels chosen by measurement").

- `sdpa_attention`, `sdpa_prefill_attention`: torch's SDPA (its CPU flash kernel computes
  in float32 in small tiles whatever the input dtype); the reference candidates;
- `matmul_attention` (decode): two batched matmuls, scores and softmax in float32, which
  oneDNN runs on the CPU's bf16 instructions;
- `blocked_prefill_attention`: per block of query rows, the keys up to the block's last
  position only (causal: half the work of the full square) and scores in bfloat16, made
  precise by a shift: a first product gives each row's max m, a second one computes
  ``scale * (q k - m)`` with the subtraction inside the matmul's float32 accumulator
  (`baddbmm`'s epilogue), so the scores that carry the probability mass are small numbers
  and their bf16 rounding is small. Softmax is shift-invariant; m only buys precision.

What must hold: the output equals softmax(q k^T * scale + mask) v per head, with query head
h reading KV head h // (H / Hkv) (torch's `enable_gqa` grouping, HF's `repeat_kv`); a
prefill query at position p sees keys ``(p - window, p]`` (all of ``[0, p]`` without one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine import native

PrefillKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int | None, float], torch.Tensor
]
"""q [Tq, H, D] (the last Tq positions), k and v [ctx, Hkv, D], window, scale -> [Tq, H * D]."""

PREFILL_BLOCK = 128
"""Query rows per block of `blocked_prefill_attention` (x the GQA group in one matmul)."""


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [B, H, D], k and v [B, Hkv, S, D], mask [B, 1, 1, S] bool (True: attend) or None
    -> [B, H * D], by torch's SDPA (its CPU flash kernel)."""
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, 1, D]
    return o.view(q.shape[0], -1)


def matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`sdpa_attention` as two batched matmuls: scores and softmax in float32, the
    probabilities rounded to the value dtype for the product with V."""
    batch, heads, dim = q.shape
    kv_heads, span = k.shape[1], k.shape[2]
    qg = q.view(batch, kv_heads, heads // kv_heads, dim).float()  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, S]
    if mask is not None:
        scores.masked_fill_(~mask.view(batch, 1, 1, span), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, -1)  # [B, Hkv, G, D] -> [B, H * D]


class PagedDecode:
    """Decode attention that reads K/V from the paged cache in place: pdserve's own kernel
    (`engine/kernels/csrc/decode.cpp`), fixed key partitions counted from position 0 and one
    thread per (request, KV head, partition), so a row's bits depend on its own context only.
    The model hands it the pages and block tables instead of a gathered context.

    `form` (`FORMS`): "float", both products in float32, for any dtype; "dpbf16", bf16 only,
    the scores on AVX512-BF16 dot products where the extension was built for them (P V
    stays in float32)."""

    FORMS = ("float", "dpbf16")

    def __init__(self, form: str = "float") -> None:
        assert form in self.FORMS, form
        self.form = form
        self.__name__ = {
            "float": "paged_decode_attention",
            "dpbf16": "paged_decode_dpbf16_attention",
        }[form]

    def __call__(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """q [B, H, D]; pages [num_blocks, block_size, Hkv, D]; block_tables [B, nb];
        ctx_lens [B] (this token included) -> [B, H * D]."""
        out: torch.Tensor = native.ext().paged_decode_attention(
            q, k_pages, v_pages, block_tables, ctx_lens, window or 0, scale,
            self.FORMS.index(self.form),
        )  # fmt: skip
        return out

    def available(self, device: torch.device, dtype: torch.dtype) -> bool:
        """float: anywhere our kernels built. dpbf16: bf16 where the extension was built for
        AVX512-BF16 (an even head_dim is checked by the kernel)."""
        if not native.runs(device, dtype):
            return False
        return self.form == "float" or (dtype == torch.bfloat16 and native.ext().has_dpbf16())


paged_decode_attention = PagedDecode()
paged_decode_dpbf16_attention = PagedDecode("dpbf16")


class PagedPrefill:
    """Prefill attention that reads K/V from the paged cache in place: pdserve's flash kernel
    (`engine/kernels/csrc/flash.cpp`, online softmax in float32). Its key parts start at fixed
    absolute positions and a row's arithmetic never depends on the rows computed beside it,
    so a prompt row gets the same bits whole, after a cached prefix or in any chunk, by
    construction (no padding to aligned blocks). One call serves every prompt chunk of a
    step; the model hands it the pages and block tables.

    `form` (`FORMS`), how the two products run:
    - "brgemm": torch's brgemm in the input dtype (bf16 where brgemm has it: AMX);
    - "float": bf16 inputs multiplied in float32 on brgemm, for bf16 anywhere (in float32 it
      is the brgemm form, so not offered there);
    - "dpbf16": bf16 on our own AVX512-BF16 dot product tiles (`dpbf16.h`), where the
      extension was built for AVX512-BF16 (an AVX512-BF16 CPU without AMX, where brgemm has
      no bf16; an AMX CPU measures it against brgemm).

    Called as a `PrefillKernel` (a gathered context) it pages the keys first: for tests and
    the selection's probes; the engine calls `paged`."""

    FORMS = ("brgemm", "float", "dpbf16")

    def __init__(self, form: str = "brgemm") -> None:
        assert form in self.FORMS, form
        self.form = form
        self.__name__ = {
            "brgemm": "paged_flash_attention",
            "float": "paged_flash_f32_attention",
            "dpbf16": "paged_flash_dpbf16_attention",
        }[form]

    def paged(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        ctx_lens: torch.Tensor,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, D]: request r's rows ``q_starts[r] .. q_starts[r + 1] - 1`` are its last
        positions before ``ctx_lens[r]``; pages [num_blocks, block_size, Hkv, D];
        block_tables [R, nb] -> [T, H * D]."""
        out: torch.Tensor = native.ext().paged_flash_attention(
            q, k_pages, v_pages, block_tables, q_starts, ctx_lens, window or 0, scale,
            self.FORMS.index(self.form),
        )  # fmt: skip
        return out

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float
    ) -> torch.Tensor:
        """The `PrefillKernel` form: k and v [ctx, Hkv, D] laid out as pages first."""
        (kp, tables), (vp, _) = (as_pages(x.transpose(0, 1)[None]) for x in (k, v))
        starts = torch.tensor([0, q.shape[0]])
        return self.paged(q, kp, vp, tables, starts, torch.tensor([k.shape[0]]), window, scale)

    def available(self, device: torch.device, dtype: torch.dtype) -> bool:
        """brgemm: float32 anywhere our kernels built, bf16 where brgemm runs it (VNNI
        pairs). float: bf16 anywhere our kernels built. dpbf16: bf16 where the extension
        was built for AVX512-BF16."""
        if not native.runs(device, dtype):
            return False
        if self.form == "float":
            return dtype == torch.bfloat16
        if self.form == "dpbf16":
            return dtype == torch.bfloat16 and native.ext().has_dpbf16()
        return dtype != torch.bfloat16 or native.brgemm_bf16()


paged_flash_attention = PagedPrefill()
paged_flash_f32_attention = PagedPrefill("float")
paged_flash_dpbf16_attention = PagedPrefill("dpbf16")


def as_pages(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, S, D] -> pages [B * ceil(S / block), block, Hkv, D] (zero-padded), block
    tables [B, ceil(S / block)]: request b's keys in its own run of pages."""
    b, hkv, span, d = x.shape
    nb = -(-span // block)
    padded = x.new_zeros(b, hkv, nb * block, d)
    padded[:, :, :span] = x
    pages = padded.permute(0, 2, 1, 3).reshape(b * nb, block, hkv, d).contiguous()
    return pages, torch.arange(b * nb, device=x.device).view(b, nb)


def sdpa_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """q [Tq, H, D], the queries of positions ``ctx - Tq .. ctx - 1``; k and v [ctx, Hkv, D],
    the keys of positions ``0 .. ctx - 1`` -> [Tq, H * D], by torch's SDPA."""
    q_len, ctx = q.shape[0], k.shape[0]
    plain = q_len == ctx and (window is None or window >= ctx)
    mask = None if plain else _prefill_mask(q_len, ctx, ctx - q_len, window, q.dtype, q.device)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Tq, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, ctx, D]
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=plain,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).reshape(q_len, -1)  # [Tq, H * D]


def blocked_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """`sdpa_prefill_attention` as matmuls over blocks of `PREFILL_BLOCK` query rows (module
    docstring): each block reads keys ``[lo, hi)``, the span its rows can see, and only its
    masked columns are masked (the diagonal square, and with a window its left edge)."""
    q_len, heads, dim = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    start = ctx - q_len  # position of query row 0
    if window is not None and window >= ctx:  # no key is out of any row's window
        window = None
    qh = q.view(q_len, kv_heads, group, dim).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
    kt = k.permute(1, 2, 0)  # [Hkv, D, ctx]
    vh = v.transpose(0, 1)  # [Hkv, ctx, D]
    out = torch.empty(kv_heads, group, q_len, dim, dtype=q.dtype, device=q.device)
    for s in range(0, q_len, PREFILL_BLOCK):
        e = min(q_len, s + PREFILL_BLOCK)
        n, first = e - s, start + s  # rows, position of the block's first row
        lo = 0 if window is None else max(0, first + 1 - window)
        hi = start + e  # keys [lo, hi)
        if window is None:  # only the diagonal square masks: the same for every block
            mask = _block_mask(n, n, 0, None, q.dtype, q.device)
        else:  # the block's whole key span
            mask = _block_mask(n, hi - lo, first - lo, window, q.dtype, q.device)
        qb = qh[:, :, s:e].reshape(kv_heads, group * n, dim)
        kb = kt[:, :, lo:hi]
        scores = torch.bmm(qb, kb)  # [Hkv, G * n, hi - lo]
        _add_mask(scores, mask, group, n)
        peak = scores.amax(-1, keepdim=True)
        torch.baddbmm(peak, qb, kb, beta=-scale, alpha=scale, out=scores)
        _add_mask(scores, mask, group, n)
        probs = torch.softmax(scores, dim=-1)
        out[:, :, s:e] = torch.bmm(probs, vh[:, lo:hi]).view(kv_heads, group, n, dim)
    return out.permute(2, 0, 1, 3).reshape(q_len, heads * dim)


ALIGN = 128
"""Query rows per block of `aligned`: blocks start at multiples of it in absolute position."""


def aligned(kernel: PrefillKernel) -> PrefillKernel:
    """`kernel` made batch-invariant: a query row's output depends on its position and
    context only, never on where its chunk starts or ends.

    Why: a prompt tail after a cached prefix, a 16-token chunk and a whole prompt put the
    same row into differently shaped calls, and a kernel's tiling (SDPA's query and key
    splits, oneDNN's GEMM blocking) follows the call's shape, so the row's reductions run
    in another order and its bf16 result can move by a rounding step: at a near-tie that
    flips a greedy token. Here every call has a shape fixed by the row's absolute position:
    the queries of positions ``[b * ALIGN, (b + 1) * ALIGN)`` (zero rows padding what the
    chunk lacks) against the keys ``[0, (b + 1) * ALIGN)`` (zero keys past the context, which
    no real row can see: they lie after it). The padding rows' outputs are dropped.
    """

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float
    ) -> torch.Tensor:
        q_len, heads, dim = q.shape
        ctx = k.shape[0]
        start = ctx - q_len  # absolute position of q's row 0
        first = start - start % ALIGN  # the first block's first position
        end = -(-ctx // ALIGN) * ALIGN  # past the last block
        qp = q.new_zeros(end - first, heads, dim)
        qp[start - first : ctx - first] = q
        if end > ctx:
            pad = k.new_zeros(end - ctx, *k.shape[1:])
            k, v = torch.cat((k, pad)), torch.cat((v, pad))
        outs = [
            kernel(qp[b - first : b - first + ALIGN], k[: b + ALIGN], v[: b + ALIGN], window, scale)
            for b in range(first, end, ALIGN)
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [end - first, H * D]
        return out[start - first : ctx - first]

    run.__name__ = f"aligned_{kernel.__name__}"
    return run


def _add_mask(scores: torch.Tensor, mask: torch.Tensor, group: int, n: int) -> None:
    """Add the additive `mask` [n, w] to the last w columns of each group's [n, *] block."""
    w = mask.shape[1]
    rows = scores.view(scores.shape[0], group, n, -1)
    rows[..., rows.shape[-1] - w :] += mask


def _additive_mask(
    n: int, cols: int, offset: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[n, cols] additive mask (0 / -inf): query row i, at key column ``offset + i``, sees
    columns ``(offset + i - window, offset + i]`` (all up to its own without a window).
    Additive, in the query dtype: SDPA would otherwise turn a bool mask into this on every
    call (one `where` over the mask per layer)."""
    q_pos = offset + torch.arange(n, device=device)[:, None]
    k_pos = torch.arange(cols, device=device)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    return torch.zeros(n, cols, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))


# Every layer of a step asks for the same masks, so each is built once. SDPA's cover a whole
# [q_len, ctx] segment (megabytes: keep few); a block's are at most 128 rows.
_prefill_mask = functools.lru_cache(maxsize=4)(_additive_mask)
_block_mask = functools.lru_cache(maxsize=64)(_additive_mask)
