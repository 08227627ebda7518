"""The folder tree is the architecture: who may import whom, checked on the source.

Rules (docs/architecture.md, "Rooms"):
- `engine` imports no other pdserve package;
- `kv_transfer` moves KV and nothing else: it never imports the router, the workers, the
  shared protocol package or the CLI;
- `pool_api` (what the router and workers both speak) never imports the router, a worker
  package or the CLI;
- `worker_common` (what both worker packages share) never imports the router, a worker
  package or the CLI;
- the router never imports a worker package, nor the workers' shared code;
- a worker package never imports the router, the other worker package or the CLI;
- no import cycle among pdserve's modules (imports under TYPE_CHECKING count too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "engine", "kv_transfer", "pool_api", "worker_common", "prefill_workers", "decode_workers",
    "router", "pdserve", "protos",
)  # fmt: skip
WORKERS = {"prefill_workers", "decode_workers"}
FORBIDDEN: dict[str, set[str]] = {
    "engine": set(PACKAGES) - {"engine"},
    "kv_transfer": {"router", "pool_api", "pdserve", *WORKERS},
    "pool_api": {"router", "pdserve", "worker_common", *WORKERS},
    "worker_common": {"router", "pdserve", *WORKERS},
    "router": {"pdserve", "worker_common", *WORKERS},
    "prefill_workers": {"router", "pdserve", "decode_workers"},
    "decode_workers": {"router", "pdserve", "prefill_workers"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if not path.name.endswith("_pb2.py") and not path.name.endswith("_pb2_grpc.py"):
                mods[module_name(path)] = path
    return mods


def imports_of(path: Path, mods: dict[str, Path]) -> Iterator[str]:
    """Every pdserve module `path` imports, anywhere in the file (functions included)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports the module pkg.mod when there is one
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name:
                yield name


def graph() -> dict[str, set[str]]:
    mods = source_modules()
    return {m: set(imports_of(p, mods)) - {m} for m, p in mods.items()}


def violations(g: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in g.items():
        rules = FORBIDDEN.get(mod.split(".")[0], set())
        for dep in deps:
            if any(dep == r or dep.startswith(r + ".") for r in rules):
                out.append(f"{mod} imports {dep}")
    return sorted(out)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_upward_import() -> None:
    assert violations(graph()) == []


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


@pytest.mark.parametrize(
    ("module", "added", "expected"),
    [
        ("engine.model", "router.core", "engine.model imports router.core"),
        ("router.core", "decode_workers.worker", "router.core imports decode_workers.worker"),
        ("kv_transfer.sender", "router.pools", "kv_transfer.sender imports router.pools"),
        ("router.flow", "worker_common", "router.flow imports worker_common"),
    ],
)
def test_the_rules_catch_an_upward_import(module: str, added: str, expected: str) -> None:
    """The checks are live: one upward import added to the real graph is reported."""
    g = graph()
    g[module] = g[module] | {added}
    assert expected in violations(g)


def test_the_cycle_check_catches_a_cycle() -> None:
    g = graph()
    g["router.pools"] = g["router.pools"] | {"router.core"}  # core imports pools already
    assert any({"router.core", "router.pools"} <= set(c) for c in cycles(g))


SIZED = ("engine", "kv_transfer", "pool_api", "prefill_workers", "decode_workers", "router")
MAX_FUNCTION_LINES, MAX_FILE_LINES = 60, 600


def test_functions_and_files_stay_small() -> None:
    """No function over 60 lines (def line to last line) and no file over 600 lines in the
    product packages: a long one is where a new small manager belongs."""
    long_functions, long_files = [], []
    for mod, path in source_modules().items():
        if mod.split(".")[0] not in SIZED:
            continue
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(mod)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{mod}.{node.name}: {n} lines")
    assert long_functions == [] and long_files == [], (long_functions, long_files)
