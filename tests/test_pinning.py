"""`pool.cpu_affinity`: each worker pinned to its cores, its threads as many as its cores.

What must hold: the setting parses into one core set per worker and refuses a malformed
one or too few sets, naming the setting; a pinned actor's later threads (the engine thread
and its OpenMP team) run on its cores only; cores the node lacks fail the worker's start in
one line naming both.
"""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.config import PoolConfig, cpu_sets
from worker_common import pin


def test_core_sets_parse_one_per_worker() -> None:
    assert cpu_sets("") == []
    assert cpu_sets("0;1") == [(0,), (1,)]
    assert cpu_sets("0-3; 4,6") == [(0, 1, 2, 3), (4, 6)]
    assert PoolConfig(num_workers=2, cpu_affinity="0-5;6,7").cpu_affinity == "0-5;6,7"


@pytest.mark.parametrize(
    ("text", "workers", "named"),
    [("0;x", 1, "'x' is not a core"), ("3-1", 1, "'3-1' is empty"), ("0", 2, "1 core sets")],
)
def test_a_bad_affinity_is_refused_naming_the_setting(text: str, workers: int, named: str) -> None:
    with pytest.raises(ValueError, match=r"pool\.cpu_affinity") as e:
        PoolConfig(num_workers=workers, cpu_affinity=text)
    assert named in str(e.value)


def _affinity_in_a_pinned_thread(cpus: tuple[int, ...]) -> set[int]:
    """Pin a fresh thread (as an actor's constructor pins its own), then read the affinity
    of a thread it starts (as the engine thread is started)."""
    seen: list[set[int]] = []

    def actor() -> None:
        pin("w", cpus)
        child = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        child.start()
        child.join()

    t = threading.Thread(target=actor)
    t.start()
    t.join()
    return seen[0]


def test_a_pinned_workers_later_threads_run_on_its_cores() -> None:
    first = min(os.sched_getaffinity(0))
    assert _affinity_in_a_pinned_thread((first,)) == {first}
    assert os.sched_getaffinity(0) != {first} or len(os.sched_getaffinity(0)) == 1  # not us


def test_cores_the_node_lacks_fail_in_one_line() -> None:
    missing = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(RuntimeError, match=rf"w: pool.cpu_affinity gives cores \[{missing}\]"):
        pin("w", (missing,))
