"""Rotary position embeddings: the frequencies of each RoPE type, and the cos/sin tables.

Types (`engine.config.RopeScaling.rope_type`), each as transformers computes it
(`modeling_rope_utils`; tests/test_hf_parity.py checks the frequencies against its
functions):

- ``default``: ``1 / theta^(2i / D)``;
- ``linear``: divided by `factor`;
- ``llama3``: long wavelengths divided by `factor`, short kept, a smooth ramp between;
- ``yarn``: interpolated (divided by `factor`) below a band and extrapolated (kept) above
  it, a linear ramp between (`beta_fast`, `beta_slow` rotations over the original context),
  and cos/sin scaled by the attention factor (``0.1 ln(factor) + 1`` unless given);
- ``dynamic`` (NTK): the base raised for a sequence of `seq_len` tokens. transformers
  recomputes it on every forward for the longest position seen, so K/V already cached was
  rotated with other frequencies than later tokens; a server cannot do that, and like vLLM
  pdserve fixes it once for the whole served context (`original * factor` positions): the
  same as transformers for a sequence that fills the context, different for a shorter one.
"""

from __future__ import annotations

import math

import torch

from engine import native
from engine.config import RopeScaling


def inv_freq(dim: int, theta: float, s: RopeScaling, seq_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, cos/sin scale) of a `dim`-wide rotation.
    `seq_len`: the positions served (what `dynamic` scales for)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if s.rope_type == "dynamic":
        original = s.original_max_position_embeddings
        seq = max(seq_len, original)
        theta = theta * ((s.factor * seq / original) - (s.factor - 1)) ** (dim / (dim - 2))
    base = 1.0 / (theta**exponents)
    if s.rope_type == "linear":
        return base / s.factor, 1.0
    if s.rope_type == "llama3":
        return _llama3(base, s), 1.0
    if s.rope_type == "yarn":
        return _yarn(dim, theta, s)
    return base, 1.0


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    factor, original = s.factor, s.original_max_position_embeddings
    scale = s.attention_factor
    if scale is None:
        if s.mscale and s.mscale_all_dim:
            scale = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            scale = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(scale)


class Rotary:
    """cos/sin tables for one RoPE (a theta and a scaling), computed in float32 as HF does
    (scaled by the type's attention factor), then cast to the model dtype.

    HF rotates with ``x * cos + cat(-x2, x1) * sin``. The tables keep ``sin`` with its first
    half negated (`sin_signed`), so the rotation is ``x * cos + roll(x, D/2) * sin_signed``:
    the same products bit for bit (negation is exact), one fewer pass over ``x``.
    """

    def __init__(
        self,
        dim: int,
        theta: float,
        scaling: RopeScaling,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv, scale = inv_freq(dim, theta, scaling, max_positions)
        pos = torch.arange(max_positions, device=device).float()
        freqs = pos[:, None] * inv.to(device)[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)
        half = dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at `positions`, ``[T, 1, D]`` each (once per forward)."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (may be a strided view) -> rotated, contiguous [T, heads, D]."""
        swapped = x.roll(x.shape[-1] // 2, dims=-1)  # cat(x2, x1)
        swapped.mul_(sin_signed)
        return torch.mul(x, cos).add_(swapped)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated [T, heads, D]."""
        return self.rotate(x, *self.tables(positions))


def rope_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """A step's RoPE and K/V write, torch's form (the reference candidate): qk [T, H + Hkv, D]
    rotated (`Rotary.rotate`), its last Hkv heads and v [T, Hkv, D] stored at `slots` of the
    layer's K and V [num_slots, Hkv, D]; returns the rotated qk."""
    rotated = Rotary.rotate(qk, cos, sin_signed)
    k_slots.index_copy_(0, slots, rotated[:, rotated.shape[1] - v.shape[1] :])
    v_slots.index_copy_(0, slots, v)
    return rotated


class FusedRopeWrite:
    """`rope_write` in one C++ kernel (`engine/kernels/csrc/rope.cpp`): the same roundings,
    so the same bits, in one pass instead of six dispatches."""

    __name__ = "fused_rope_write"

    def __call__(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        out: torch.Tensor = native.ext().rope_write(qk, v, cos, sin_signed, k_slots, v_slots, slots)
        return out

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return native.runs(device, dtype)


fused_rope_write = FusedRopeWrite()
