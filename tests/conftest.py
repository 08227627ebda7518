"""Settings for every test and the processes it starts.

- The debug checks that worker state is touched only by its owning thread
  (`worker_common.check_owner`) are on.
- One kernel build and selection cache for the whole run (`engine.native`): a test that
  gives a server or a Ray head another HOME must not rebuild the C++ extension (about 90 s
  on 2 cores) under it. A test that means to build afresh sets PDSERVE_KERNELS_DIR itself.
- After each module, the memory its engines held goes back to the OS. An engine makes
  glibc keep its peak heap (`engine.model.keep_freed_memory`: right for a server, which
  reuses it on every step), so without this the test process, which hosts one module's
  in-process workers after another's, would grow by each module's peak.
"""

import contextlib
import ctypes
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("PDSERVE_CHECK_OWNERS", "1")
os.environ.setdefault("PDSERVE_KERNELS_DIR", str(Path.home() / ".cache" / "pdserve" / "kernels"))


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back() -> Iterator[None]:
    yield
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
