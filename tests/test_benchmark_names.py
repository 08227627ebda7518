"""The benchmark scripts run as files, so Python puts `benchmarks/` first on `sys.path`: a
script named like an installed package shadows that package for every import made while it
runs. `benchmarks/kernels.py` did: transformers' `from kernels import ...` (the HF kernels
package) found it, and `make bench-peers` on a fresh clone died converting the model."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_benchmark_script_shadows_an_installed_module() -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    stems = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    assert "peers" in stems  # the glob found the scripts
    shadowed = []
    for stem in stems:
        spec = importlib.util.find_spec(stem)
        origin = spec.origin if spec is not None else None
        if origin and site in Path(origin).resolve().parents:
            shadowed.append(f"benchmarks/{stem}.py shadows {origin}")
    assert not shadowed, shadowed
