#!/usr/bin/env bash
# Regenerate the committed Python modules beside the .proto files (run from anywhere).
# `-I .` from the repository root makes them import as protos.pdserve.v1.*_pb2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-.}
"$PY" -m grpc_tools.protoc -I . --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  protos/pdserve/v1/*.proto
