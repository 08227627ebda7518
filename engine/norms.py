"""RMSNorm, the model's candidates for it: torch's elementwise form (the reference) and
pdserve's one-kernel form (`engine/kernels/csrc/norm.cpp`). Which one runs is measured on the
serving machine (`engine.kernels.select`).

Why a kernel of our own: torch's form is five elementwise ops (cast, square, mean, rsqrt,
scale), each a dispatch and a pass over the rows, and a layer runs two or four norms: on a
decode step's few rows the dispatches, not the arithmetic, are the cost.

What must hold: HF's rounding. Llama's ``weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype)``
rounds twice; Gemma 3's ``(xf * rstd * (1 + w)).to(dtype)`` once, with ``1 + w`` kept in
float32 (`engine.weights`). A row's bits depend on that row alone.
"""

from __future__ import annotations

import torch

from engine import native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in float32, scale applied in the input dtype.

    Bit for bit HF's ``weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype)``, with the cast
    folded into the multiply's output (one rounding either way) and no other temporaries.
    """
    xf = x.float()
    rstd = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [T, 1]
    normed = torch.mul(xf, rstd, out=torch.empty_like(x))  # rounded once to x.dtype
    return normed.mul_(weight)


def gemma_rms_norm(x: torch.Tensor, weight1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 3's RMSNorm: ``(xf * rsqrt(mean(xf^2) + eps) * (1 + w)).to(dtype)``, all in
    float32 and rounded once; `weight1` is ``1 + w`` in float32 (`engine.weights`)."""
    xf = x.float()
    rstd = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (xf * rstd).mul_(weight1).to(x.dtype)


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """The reference candidate: `gemma_rms_norm` when `one_plus` (Gemma 3), else `rms_norm`."""
    return (gemma_rms_norm if one_plus else rms_norm)(x, weight, eps)


class FusedNorm:
    """RMSNorm in one C++ kernel (module docstring): one pass for the sum of squares, one
    for the store."""

    __name__ = "fused_rms_norm"

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool
    ) -> torch.Tensor:
        out: torch.Tensor = native.ext().rms_norm(x, weight, eps, one_plus)
        return out

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return native.runs(device, dtype)


fused_rms_norm = FusedNorm()
