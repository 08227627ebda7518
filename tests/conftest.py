"""Settings for every test and the processes it starts.

- The debug checks that worker state is touched only by its owning thread
  (`worker_common.check_owner`) are on.
- One kernel build and selection cache for the whole run (`engine.native`): a test that
  gives a server or a Ray head another HOME must not rebuild the C++ extension (about 90 s
  on 2 cores) under it. A test that means to build afresh sets PDSERVE_KERNELS_DIR itself.
- The test process gives freed memory back. A serving process keeps its peak heap
  (`engine.model.keep_freed_memory`: it reuses it on every step, without page faults); the
  test process hosts one module's engines after another's, and kept, each module's peak
  stacked on the last (13 GB RSS by the end of the suite). So the tuning is skipped here
  (workers in Ray and `pdserve serve` children still apply it), and after each module the
  freed memory is trimmed.
- The longest modules are collected first: `make test` runs the suite on two workers
  (`pytest -n 2 --dist loadfile`), and a long module handed out last would run alone on one
  core at the end.
- Under `--dist loadfile`, each module runs whole on one worker, except that the modules of
  `SHARED_SERVERS` run together: one after another, on one worker, sharing one server
  (tests/serve_proc.py `shared_server`), stopped after their last test. (xdist's own
  `loadgroup` cannot say this: with pytest 9 it reads marks onto a node id that pytest no
  longer keeps, and hands the tests out one by one.)
"""

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import engine.model
from tests.serve_proc import stop_shared_server

os.environ.setdefault("PDSERVE_CHECK_OWNERS", "1")
os.environ.setdefault("PDSERVE_KERNELS_DIR", str(Path.home() / ".cache" / "pdserve" / "kernels"))
engine.model._malloc_tuned = True  # keep_freed_memory() is then a no-op in this process


# By each module's time in a serial run (`--durations`, docs/benchmarks.md), longest first;
# the rest keep their order after these.
_LONGEST_FIRST = (
    "test_serve_cli.py",
    "test_reliability.py",
    "test_tools.py",
    "test_structured.py",
    "test_determinism.py",
    "test_real_model.py",
    "test_gemma3_real.py",
    "test_service.py",
    "test_choices_service.py",
    "test_multinode.py",
    "test_self_healing.py",
    "test_pool_admin.py",
    "test_membership.py",
    "test_bench.py",
    "test_prompt_logprobs.py",
    "test_prefix_routing.py",
)


# group name -> the modules that share its server (tests/serve_proc.py `_SHARED_STARTS`)
SHARED_SERVERS = {
    "tiny-server": (
        "test_http.py",
        "test_edge_limits.py",
        "test_vllm_endpoints.py",
        "test_bench.py",
    ),
    "default-model-server": ("test_real_model.py", "test_prompt_logprobs.py"),
}
_GROUP_OF = {module: group for group, modules in SHARED_SERVERS.items() for module in modules}


def group_of(item: pytest.Item) -> str:
    return _GROUP_OF.get(item.path.name, item.path.name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(group_of(item), i)

    def key(item: pytest.Item) -> tuple[int, int]:
        """A group ranks as its first-ranked module; the sort being stable, its modules stay
        together in their collection order."""
        group = group_of(item)
        modules = SHARED_SERVERS.get(group, (group,))
        return min(rank.get(m, len(rank)) for m in modules), first_seen[group]

    items.sort(key=key)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with each `SHARED_SERVERS` group handed out as one file."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _GROUP_OF.get(Path(path).name, path)

    return SharedServerScheduling(config, log)


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    group = group_of(item)
    if group in SHARED_SERVERS and (nextitem is None or group_of(nextitem) != group):
        stop_shared_server(group)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With PDSERVE_TEST_TIMELINE=FILE, each phase of each test is appended to FILE as a JSON
    line (worker, phase, start and stop): with a CPU sampler beside it, this shows when a core
    sat idle and what each worker was doing then (docs/benchmarks.md, the suite's cost)."""
    path = os.environ.get("PDSERVE_TEST_TIMELINE")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes it alone
        return
    node = getattr(report, "node", None)
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    line = {
        "worker": worker,
        "test": report.nodeid,
        "phase": report.when,
        "start": report.start,
        "stop": report.stop,
    }
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back() -> Iterator[None]:
    yield
    engine.model.give_freed_memory_back()
