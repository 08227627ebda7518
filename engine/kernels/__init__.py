"""The model's swappable kernels: what each op may run, and which one this machine chose.

An op (`OPS`) has candidates, simplest first: torch's own kernel (SDPA, plain `F.linear`)
leads, the engine's alternatives follow. `engine.kernels.select` times the candidates that
apply on the serving machine at the model's shapes and caches the choice; the model asks a
`KernelSet` for its callables and never names a CPU. The simplest candidate of each op is
the reference the others are checked against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine import kernel_spec
from engine.attention import (
    PagedDecode,
    PagedPrefill,
    aligned,
    blocked_prefill_attention,
    matmul_attention,
    paged_decode_attention,
    paged_decode_dpbf16_attention,
    paged_flash_attention,
    paged_flash_dpbf16_attention,
    paged_flash_f32_attention,
    sdpa_attention,
    sdpa_prefill_attention,
)
from engine.norms import FusedNorm, fused_rms_norm, torch_norm
from engine.projections import BrgemmProjections, OneDnnProjections, Projections
from engine.rope import FusedRopeWrite, fused_rope_write, rope_write

DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor
]
RopeWrite = Callable[..., torch.Tensor]
"""(qk, v, cos, sin_signed, k_slots, v_slots, slots) -> rotated qk (`engine.rope.rope_write`)."""
PrefillAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int | None, float], torch.Tensor
]


def _cpu(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu"


def _anywhere(device: torch.device, dtype: torch.dtype) -> bool:
    return True


@dataclass(frozen=True)
class Candidate:
    """One way to run an op. `impl`: the attention function, or the projections class.

    `invariance`: "probe" (whether a row's result depends on the batch around it is found
    by trying, on the serving machine), "never" (its tiling follows the call's shape by
    design: not offered when batch invariance is on) or "only" (built for invariance,
    slower otherwise: offered only when it is on)."""

    name: str
    impl: Any
    applies: Callable[[torch.device, torch.dtype], bool]
    invariance: str = "probe"

    def offered(self, invariant: bool) -> bool:
        return self.invariance == "probe" or (self.invariance == "only") == invariant


OPS: dict[str, tuple[Candidate, ...]] = {
    "decode_attention": (
        Candidate("sdpa", sdpa_attention, _anywhere),
        # not offered with batch invariance on: it passes the probe (batch size), but the
        # census found it changing tokens chunked, disaggregated and preempted (prompt 12 of
        # 16, 2026-12-07), and the selection took it whenever load made it tie with `paged`
        Candidate("matmul", matmul_attention, _cpu, "never"),
        Candidate("paged", paged_decode_attention, paged_decode_attention.available),
        Candidate(
            "paged-dpbf16",
            paged_decode_dpbf16_attention,
            paged_decode_dpbf16_attention.available,
        ),
    ),
    "prefill_attention": (
        Candidate("sdpa", sdpa_prefill_attention, _anywhere, "never"),
        Candidate("blocked", blocked_prefill_attention, _cpu, "never"),
        Candidate("sdpa-aligned", aligned(sdpa_prefill_attention), _anywhere, "only"),
        Candidate("blocked-aligned", aligned(blocked_prefill_attention), _cpu, "only"),
        Candidate("flash", paged_flash_attention, paged_flash_attention.available),
        Candidate("flash-f32", paged_flash_f32_attention, paged_flash_f32_attention.available),
        Candidate(
            "flash-dpbf16", paged_flash_dpbf16_attention, paged_flash_dpbf16_attention.available
        ),
    ),
    "projections": (
        Candidate("plain", Projections, _anywhere),
        Candidate("packed", OneDnnProjections, OneDnnProjections.available),
        Candidate("brgemm", BrgemmProjections, BrgemmProjections.available),
    ),
    "norm": (
        Candidate("torch", torch_norm, _anywhere),
        Candidate("fused", fused_rms_norm, FusedNorm.available),
    ),
    "rope_kv": (
        Candidate("torch", rope_write, _anywhere),
        Candidate("fused", fused_rope_write, FusedRopeWrite.available),
    ),
}
"""Every op's candidates, simplest (the reference) first."""
assert {op: tuple(c.name for c in cs) for op, cs in OPS.items()} == kernel_spec.NAMES, (
    "engine.kernel_spec.NAMES lists every candidate, in this order"
)


def candidates(
    op: str, device: torch.device, dtype: torch.dtype, invariant: bool = False
) -> list[Candidate]:
    """`op`'s candidates that run on `device` in `dtype`, and are offered with batch
    invariance on or off, simplest first."""
    return [c for c in OPS[op] if c.applies(device, dtype) and c.offered(invariant)]


def candidate(op: str, name: str) -> Candidate:
    for c in OPS[op]:
        if c.name == name:
            return c
    raise ValueError(f"kernels: {op} has no candidate {name!r} (choose from {names(op)})")


def names(op: str) -> list[str]:
    return [c.name for c in OPS[op]]


@dataclass(frozen=True)
class KernelSet:
    """The chosen candidate of every op, by name (what is cached and printed)."""

    decode_attention: str = "sdpa"
    prefill_attention: str = "sdpa"
    projections: str = "plain"
    norm: str = "torch"
    rope_kv: str = "torch"  # RoPE with the K/V cache write
    # the projections' row floors (`Projections.row_floors`), as (kind, rows) pairs
    row_floors: tuple[tuple[str, int], ...] = ()
    batch_invariant: bool = False  # every op's choice passed its invariance probe

    @classmethod
    def reference(cls, invariant: bool = False) -> KernelSet:
        """The simplest candidate of every op offered (torch's own kernels)."""
        return cls.of(
            {op: next(c.name for c in cands if c.offered(invariant)) for op, cands in OPS.items()}
        )

    @classmethod
    def of(
        cls,
        choice: dict[str, str],
        row_floors: dict[str, int] | None = None,
        batch_invariant: bool = False,
    ) -> KernelSet:
        for op, name in choice.items():
            candidate(op, name)  # raises for an unknown name
        floors = tuple(sorted((row_floors or {}).items()))
        default = cls()
        return cls(
            decode_attention=choice.get("decode_attention", default.decode_attention),
            prefill_attention=choice.get("prefill_attention", default.prefill_attention),
            projections=choice.get("projections", default.projections),
            norm=choice.get("norm", default.norm),
            rope_kv=choice.get("rope_kv", default.rope_kv),
            row_floors=floors,
            batch_invariant=batch_invariant,
        )

    def as_dict(self) -> dict[str, str]:
        return {op: getattr(self, op) for op in OPS}

    @property
    def decode_reads_pages(self) -> bool:
        """Decode attention reads the paged cache in place (no workspace, no gather)."""
        return self.paged_decode() is not None

    @property
    def prefill_reads_pages(self) -> bool:
        """Prefill attention reads the paged cache in place (`PagedPrefill`, one call a step)."""
        return self.paged_prefill() is not None

    def paged_decode(self) -> PagedDecode | None:
        """The chosen decode kernel when it is a form of the paged decode kernel."""
        impl = candidate("decode_attention", self.decode_attention).impl
        return impl if isinstance(impl, PagedDecode) else None

    def paged_prefill(self) -> PagedPrefill | None:
        """The chosen prefill kernel when it is a form of the flash kernel on the pages."""
        impl = candidate("prefill_attention", self.prefill_attention).impl
        return impl if isinstance(impl, PagedPrefill) else None

    def decode_fn(self) -> DecodeAttention:
        fn: DecodeAttention = candidate("decode_attention", self.decode_attention).impl
        return fn

    def prefill_fn(self) -> PrefillAttention:
        fn: PrefillAttention = candidate("prefill_attention", self.prefill_attention).impl
        return fn

    def rope_kv_fn(self) -> RopeWrite:
        fn: RopeWrite = candidate("rope_kv", self.rope_kv).impl
        return fn

    def make_projections(self, weights: Any, act: str) -> Projections:
        cls: type[Projections] = candidate("projections", self.projections).impl
        return cls(weights, act, dict(self.row_floors))

    def text(self) -> str:
        return ", ".join(f"{op}={name}" for op, name in self.as_dict().items())


def check_applies(kernels: KernelSet, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError when a named kernel cannot run on `device` in `dtype`."""
    for op, name in kernels.as_dict().items():
        if not candidate(op, name).applies(device, dtype):
            raise ValueError(
                f"kernels: {op}={name} does not run on {device} in "
                f"{str(dtype).removeprefix('torch.')}"
            )


__all__: Sequence[str] = [
    "OPS",
    "Candidate",
    "KernelSet",
    "candidate",
    "candidates",
    "check_applies",
    "names",
]
