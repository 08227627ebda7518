"""pdserve's own CPU kernels (``engine/kernels/csrc``), built once per machine and torch.

A leaf module (torch only): the kernels' Python side and the selection import it.

The C++ sources are compiled with `torch.utils.cpp_extension.load` (g++ and the `ninja`
package) into ``~/.cache/pdserve/kernels/build-<digest>`` (`default_cache_dir`), the digest
taken from the sources, the torch version, the CPU's flags and the compiler flags, so a
changed source or another CPU builds anew and a restart loads the built module at once.
`make install` builds it (``python -m engine.native``); otherwise the first worker to need
it does, under torch's own build lock (the container image has g++ for that: it is built
for the CPU it runs on, never for the image builder's).

Where it cannot be built (no compiler, no ninja, a failed build) or is switched off
(``PDSERVE_NATIVE_KERNELS=0``), `load()` returns None with the reason in `why_not()`, and the
torch kernels serve: the kernel selection then has fewer candidates, and its startup line
says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

from engine import cpu

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "kernels" / "csrc"
SOURCES = ("bindings.cpp", "gemm.cpp", "decode.cpp", "flash.cpp", "norm.cpp", "rope.cpp")
_why_not = ""


def enabled() -> bool:
    return os.environ.get("PDSERVE_NATIVE_KERNELS", "1") not in ("0", "", "off")


def default_cache_dir() -> Path:
    """The built extension and the kernel selections: ``$PDSERVE_KERNELS_DIR``, else
    ``~/.cache/pdserve/kernels``. Per machine, not per `$PDSERVE_HOME`: what is built and
    measured depends on the CPU, torch and the shapes (all in the keys), not on where the
    models live, so every server on the host shares them."""
    explicit = os.environ.get("PDSERVE_KERNELS_DIR")
    return Path(explicit) if explicit else Path.home() / ".cache" / "pdserve" / "kernels"


def cpu_identity() -> dict[str, str]:
    """The CPU's model name and a digest of its flags (`engine.cpu.cpuinfo`)."""
    model, flags = cpu.cpuinfo()
    return {
        "cpu_model": model,
        "cpu_flags": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16],
    }


def build_dir() -> Path:
    """Where this source, torch, CPU and compiler flags' build lives."""
    digest = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir()):
        digest.update(name.encode() + (CSRC / name).read_bytes())
    digest.update(torch.__version__.encode() + cpu_identity()["cpu_flags"].encode())
    digest.update(" ".join(_cflags()).encode())
    return default_cache_dir() / f"build-{digest.hexdigest()[:16]}"


def _cflags() -> list[str]:
    # OpenMP: at::parallel_for is header code, serial unless built with it
    # no FMA contraction: a kernel rounds where its torch counterpart rounds (fused = same bits)
    return ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-ffp-contract=off", *_vector_flags()]


@functools.cache
def load() -> ModuleType | None:
    """The extension module, built if need be; None where it cannot be had (`why_not`)."""
    global _why_not
    if not enabled():
        _why_not = "switched off (PDSERVE_NATIVE_KERNELS=0)"
        return None
    missing = [tool for tool in ("g++", "ninja") if _which(tool) is None]
    if missing:
        _why_not = f"no {' or '.join(missing)} on this machine"
        return None
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="pdserve_kernels",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=_cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            verbose=False,
        )
    except Exception as e:  # a compiler error, a missing header: serve with torch's kernels
        _why_not = f"build failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        log.warning("pdserve kernels: %s (in %s); torch's kernels serve", _why_not, out)
        return None


def _vector_flags() -> list[str]:
    """ATen's `Vectorized` is scalar code unless a CPU_CAPABILITY macro names the ISA: the
    one torch itself dispatches to on this CPU (AVX512 or AVX2)."""
    level = torch.backends.cpu.get_cpu_capability()
    if level.startswith("AVX512"):
        return ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    if level == "AVX2":
        return ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return []


def _which(tool: str) -> str | None:
    """`tool` on PATH or beside this interpreter (the venv's `ninja`)."""
    found = shutil.which(tool)
    if found is None and (Path(sys.executable).parent / tool).exists():
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        found = shutil.which(tool)
    return found


def why_not() -> str:
    """Why `load()` gave None ('' when it did not, or was not called)."""
    return _why_not


def ext() -> ModuleType:
    """The loaded extension, for a kernel that is running: its candidate's `applies` (`runs`)
    was checked before it was chosen, so a missing extension here is a bug, not a state."""
    mod = load()
    assert mod is not None, f"pdserve kernels: {why_not()}"
    return mod


def runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Our kernels serve `device` in `dtype`: a CPU, float32 or bf16, the extension built
    (a candidate's `applies`)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load() is not None


def brgemm_bf16() -> bool:
    """The extension is here and brgemm runs bf16 with packed (VNNI) weights on this CPU."""
    ext = load()
    return ext is not None and bool(ext.brgemm_packs_bf16())


if __name__ == "__main__":  # `make install`: build now, say how it went
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = load()
    print(f"pdserve kernels: {'built in ' + str(build_dir()) if mod else why_not()}")
    sys.exit(0)
