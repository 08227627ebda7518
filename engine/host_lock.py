"""One holder at a time on this host: an exclusive `fcntl.flock` on a file.

Why: work that every process would otherwise do at once on a 2-core host (the kernel
selection's timings, fetching and converting a named model) must run once, with the others
waiting for its result rather than racing it: two fetches of one model wrote the same
`.part` file, and one renamed it from under the other (a fresh clone's suite, 13 errors).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """Hold the lock file `path` (created with its directory); where it cannot be made (a
    read-only home), go ahead unlocked: the work is then done twice, not refused."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
