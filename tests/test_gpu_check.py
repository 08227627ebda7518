"""benchmarks/gpu_check.sh, dry-run on CPU (--small): the script a GPU machine runs.

That machine has python3 and torch and nothing else, and its time is short, so the script
must start from the source tree as it is, import nothing beyond torch, and produce its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOT_ON_THE_GPU_BOX = ("ray", "grpc", "redis", "safetensors", "tokenizers", "google.protobuf")


def test_gpu_check_script_runs_from_the_source_tree(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--small"],
        cwd=tmp_path,  # the script finds the repository itself
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out["small"] is True
    assert out["kv_pages_device_copy"]["bit_exact"] is True
    for batch in (1, 32):
        d = out[f"decode_b{batch}"]
        # The engine's decode path (the workspace) and gathering pages agree (on CPU exactly).
        assert d["max_logit_diff_workspace_vs_gather"] == 0.0
        assert d["workspace_bytes"] > 0 and d["seconds_per_step"] > 0
    assert out["prefill"]["tflops"] > 0


def test_gpu_check_imports_only_torch() -> None:
    code = (
        "import sys\n"
        "import benchmarks.gpu_check\n"
        f"banned = {NOT_ON_THE_GPU_BOX!r}\n"
        "print(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') "
        "for b in banned)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_without_a_gpu_says_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
