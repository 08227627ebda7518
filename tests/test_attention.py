"""Attention kernels (`engine.attention`): the bf16 matmul formulations against float32 SDPA
and an eager float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import (
    blocked_prefill_attention,
    matmul_attention,
    sdpa_attention,
    sdpa_prefill_attention,
)


def _case(seed: int, batch: int, window: int | None) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, span = 9, 3, 64, 300
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(batch, kv_heads, span, dim, generator=g)
    v = torch.randn(batch, kv_heads, span, dim, generator=g)
    lens = torch.randint(1, span + 1, (batch,), generator=g)
    lens[0] = span
    pos = torch.arange(span)[None, :]
    mask = pos < lens[:, None]
    if window is not None:
        mask &= pos > lens[:, None] - 1 - window
    return q, k, v, mask.view(batch, 1, 1, span)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """HF's eager attention in float64: K/V repeated per query head, masked softmax."""
    groups = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(groups, dim=1)  # [B, H, S, D]
    vr = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), kr) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[:, :, 0], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, -1), vr).flatten(1)


@pytest.mark.parametrize("window", [None, 40], ids=["full", "window"])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_attention_matches_eager_attention(batch: int, window: int | None) -> None:
    """float32 (SDPA) within float32 noise of an eager float64 reference; bfloat16 (scores in
    float32, two matmuls) no further from it than torch's own bf16 SDPA kernel is, within a
    margin: the grouping of query heads onto KV heads, the mask and the window are right."""
    q, k, v, mask = _case(batch * 10 + (window or 0), batch, window)
    want = _reference(q, k, v, mask)
    got32 = sdpa_attention(q, k, v, mask, q.shape[-1] ** -0.5)
    assert float((got32.double() - want).abs().max()) < 1e-5
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got16 = matmul_attention(qb, kb, vb, mask, q.shape[-1] ** -0.5)
    assert got16.dtype == torch.bfloat16 and got16.shape == (batch, q.shape[1] * q.shape[2])
    sdpa16 = F.scaled_dot_product_attention(
        qb.unsqueeze(2), kb, vb, attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True
    ).flatten(1)
    # Both from the same bf16-rounded inputs: compare each to the reference of those inputs.
    want16 = _reference(qb.float(), kb.float(), vb.float(), mask)
    err, sdpa_err = (float((x.double() - want16).abs().max()) for x in (got16, sdpa16))
    assert err <= 2 * sdpa_err + 2e-3, (err, sdpa_err)


def _prefill_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Eager float64 causal attention of q [Tq, H, D] (the last Tq of k's positions)."""
    q_len, ctx, groups = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(groups, dim=1)  # [ctx, H, D]
    vr = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kr) * q.shape[-1] ** -0.5
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vr).flatten(1)


@pytest.mark.parametrize(
    ("q_len", "ctx", "window", "magnitude"),
    [
        (300, 300, None, 1.0),  # a whole prompt, the last block partial
        (200, 333, None, 1.0),  # a chunk after a cached prefix
        (200, 333, 40, 1.0),  # a sliding window inside a chunk
        (300, 300, 150, 1.0),  # a window wider than a block
        (200, 333, 333, 1.0),  # a window as wide as the context: the plain causal path
        (300, 300, None, 6.0),  # large scores: where bf16 scores without the shift fail
    ],
    ids=["prompt", "chunk", "window", "wide-window", "context-window", "large-scores"],
)
def test_prefill_attention_matches_eager_attention(
    q_len: int, ctx: int, window: int | None, magnitude: float
) -> None:
    """Prefill attention against an eager float64 reference: float32 (SDPA) within float32
    noise; bfloat16 (blocked matmuls, shifted bf16 scores) within 2x torch's bf16 SDPA
    error, max and mean, from the same bf16 inputs: causal blocks, prefix, windows, GQA."""
    g = torch.Generator().manual_seed(q_len + ctx + (window or 0))
    q = torch.randn(q_len, 9, 64, generator=g) * magnitude
    k, v = (torch.randn(ctx, 3, 64, generator=g) for _ in range(2))
    scale = 64**-0.5
    got32 = sdpa_prefill_attention(q, k, v, window, scale)
    assert float((got32.double() - _prefill_reference(q, k, v, window)).abs().max()) < 1e-5
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got16 = blocked_prefill_attention(qb, kb, vb, window, scale)
    sdpa16 = sdpa_prefill_attention(qb, kb, vb, window, scale)
    want16 = _prefill_reference(qb.float(), kb.float(), vb.float(), window)
    (err, mean), (sdpa_err, sdpa_mean) = (
        (float(d.max()), float(d.mean()))
        for d in ((x.double() - want16).abs() for x in (got16, sdpa16))
    )
    assert got16.shape == (q_len, 9 * 64)
    assert err <= 2 * sdpa_err + 2e-3, (err, sdpa_err)
    assert mean <= 2 * sdpa_mean, (mean, sdpa_mean)
