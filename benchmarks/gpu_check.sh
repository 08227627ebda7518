#!/usr/bin/env bash
# The one GPU script: runs from the source tree with the machine's own python3 and torch
# (nothing installed), and must finish within 5 minutes on an H200. Writes a small JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
# As a module from the repository root: run as a file, its own folder would come first on
# sys.path and `import engine` would find benchmarks/engine.py instead of the package.
PYTHONPATH=. timeout 290 "${PYTHON:-python3}" -m benchmarks.gpu_check --out "$OUT/gpu_check.json" "$@"
