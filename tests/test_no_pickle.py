"""No pickle on any wire pdserve owns: KV frames and the public APIs are protobuf/JSON.

Ray's own actor calls pickle inside the cluster (its business); this scans the code that
builds or parses what crosses *our* wires (KV transfer, the protos, the router's gRPC/HTTP
APIs, the prefill and decode workers that feed the transports, and `pdserve`: client, CLI,
checkpoint loading), so a `pickle.loads` (vLLM CVE-2025-47277's class of bug) cannot creep in.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WIRE_PACKAGES = (
    "kv_transfer",
    "router",
    "protos",
    "engine",
    "prefill_workers",
    "decode_workers",
    "pdserve",
)
MUST_SCAN = (
    "kv_transfer/transports/torch_dist.py",
    "kv_transfer/transports/grpc_stream.py",
    "kv_transfer/auth.py",
    "router/http.py",
    "prefill_workers/worker.py",
    "decode_workers/worker.py",
)
FORBIDDEN = re.compile(
    r"\b(import\s+(c?pickle|dill|cloudpickle|marshal|shelve)|from\s+(c?pickle|dill|cloudpickle)"
    r"\s+import|pickle\.|torch\.(load|save)\(|numpy\.load\(|np\.load\(|allow_pickle)"
)


# A checkpoint loader may read `pytorch_model.bin` with torch's weights-only unpickler, which
# refuses every global outside tensors and plain containers (no code runs).
WEIGHTS_ONLY = re.compile(r"torch\.load\([^#]*weights_only=True")


def forbidden(line: str) -> bool:
    if line.lstrip().startswith("#") or not FORBIDDEN.search(line):
        return False
    return not (WEIGHTS_ONLY.search(line) and len(FORBIDDEN.findall(line)) == 1)


def wire_sources() -> list[Path]:
    files = [p for pkg in WIRE_PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 20, "the scan must see the wire code"
    missed = [m for m in MUST_SCAN if ROOT / m not in files]
    assert not missed, f"the scan misses {missed}"
    return files


@pytest.mark.parametrize("path", wire_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_in_wire_code(path: Path) -> None:
    hits = [
        f"{i}: {line.strip()}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden(line)
    ]
    assert not hits, f"{path.relative_to(ROOT)} deserializes with pickle-like code: {hits}"


def test_scanner_allows_only_weights_only_torch_load() -> None:
    assert not forbidden('state = torch.load(file, map_location="cpu", weights_only=True)')
    assert forbidden('state = torch.load(file, map_location="cpu")')
    assert forbidden("torch.load(f, weights_only=False)")
    assert forbidden("x = torch.load(f, weights_only=True); pickle.loads(b)")


def test_scanner_catches_pickle() -> None:
    assert FORBIDDEN.search("import pickle")
    assert FORBIDDEN.search("    obj = pickle.loads(data)")
    assert FORBIDDEN.search("t = torch.load(buf)")
    assert not FORBIDDEN.search("header = pb.KVFrameHeader.FromString(raw)")
