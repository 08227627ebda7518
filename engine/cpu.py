"""What this CPU does in hardware, asked of torch's own capability queries.

Two questions decide a CPU path: may `--dtype auto` compute in bfloat16 (only where bf16
matmuls run in hardware: AVX512-BF16 or AMX; elsewhere torch emulates them and float32 is as
fast and exact), and may the packed oneDNN projections take bfloat16 weights (their weight
reorder needs AVX512 BW/VL/DQ or AVX-NE-CONVERT, which AVX2-only CPUs such as AMD Zen 2/3
lack). `PDSERVE_PORTABLE_CPU=1` answers no to both, so a test can force the portable path on
any machine.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


def portable_forced() -> bool:
    return os.environ.get("PDSERVE_PORTABLE_CPU", "") not in ("", "0")


def has_bf16_hardware() -> bool:
    """bf16 matmuls in hardware: AVX512-BF16 or AMX tiles."""
    if portable_forced():
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def onednn_bf16_supported() -> bool:
    """oneDNN can reorder (pack) and run bfloat16 linear weights on this CPU."""
    if portable_forced():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpuinfo() -> tuple[str, list[str]]:
    """The first CPU's model name and its sorted flags, from /proc/cpuinfo ("" and [] where
    there is none): what names a CPU in results and keys the kernel caches."""
    model, flags = "", list[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = sorted(value.split())
    return model, flags


def identity() -> str:
    """The CPU's model name and its vector / matrix extensions (what `lscpu` shows), for
    every benchmark result: a figure means nothing without the CPU it came from."""
    model, flags = cpuinfo()
    isa = sorted({f for f in flags if f.startswith(("avx", "amx"))})
    return f"{model or 'unknown CPU'} ({' '.join(isa) or 'no AVX'})"


def describe() -> str:
    """One line for logs: torch's vector ISA level and the bf16 answers above."""
    return (
        f"cpu {torch.backends.cpu.get_cpu_capability()}, "
        f"bf16 hardware {'yes' if has_bf16_hardware() else 'no'}, "
        f"oneDNN bf16 {'yes' if onednn_bf16_supported() else 'no'}"
    )
