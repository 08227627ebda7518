#!/usr/bin/env bash
# The one GPU script: runs from the source tree with the machine's own python3 and torch
# (nothing installed), and must finish within 5 minutes on an H200. Writes a small JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PYTHONPATH=. timeout 290 python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json" "$@"
