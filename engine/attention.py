"""Decode attention: one query per request against its context, by the kernel that is fast
for the dtype.

Why not always `F.scaled_dot_product_attention`: torch's CPU flash kernel is tiled for long
query blocks. For a decode step (one query row per request) in bfloat16 it runs ~9x slower
than in float32 on an AVX512-BF16 CPU without AMX (batch 8, 520 keys, 9 heads: 1.7 ms a
layer against 0.19 ms; docs/benchmarks.md, "Decode attention in bf16"), which made a batch-8
bf16 decode step 65 ms where the matmuls take 9. The same attention as two batched matmuls
(scores in float32, softmax in float32, probabilities rounded to the value dtype for the
second product) runs in 0.22 ms there with the flash kernel's accuracy. float32 keeps SDPA:
its kernel is as fast as the matmuls in float32, and exact to HF's.

What must hold: the output equals softmax(q k^T * scale + mask) v per head, with query head
h reading KV head h // (H / Hkv) (torch's `enable_gqa` grouping, HF's `repeat_kv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [B, H, D], k and v [B, Hkv, S, D], mask [B, 1, 1, S] bool (True: attend) or None
    -> [B, H * D]: `matmul_attention` in bf16, `sdpa_attention` otherwise."""
    kernel = matmul_attention if q.dtype == torch.bfloat16 else sdpa_attention
    return kernel(q, k, v, mask, scale)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`decode_attention` by torch's SDPA (its CPU flash kernel)."""
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, 1, D]
    return o.view(q.shape[0], -1)


def matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`decode_attention` as two batched matmuls: scores and softmax in float32, the
    probabilities rounded to the value dtype for the product with V."""
    batch, heads, dim = q.shape
    kv_heads, span = k.shape[1], k.shape[2]
    qg = q.view(batch, kv_heads, heads // kv_heads, dim).float()  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, S]
    if mask is not None:
        scores.masked_fill_(~mask.view(batch, 1, 1, span), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, -1)  # [B, Hkv, G, D] -> [B, H * D]
