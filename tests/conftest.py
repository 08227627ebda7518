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
  (`pytest -n 2 --dist loadfile`, a module whole on one worker), and a long module handed
  out last would run alone on one core at the end.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine.model

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
    "test_bench.py",
    "test_prompt_logprobs.py",
    "test_prefix_routing.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back() -> Iterator[None]:
    yield
    engine.model.give_freed_memory_back()
