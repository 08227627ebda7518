"""Stopping a server the benchmarks and tools started in its own process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_group(
    proc: subprocess.Popen[str] | subprocess.Popen[bytes],
    timeout_s: float,
    term_group: bool = False,
) -> None:
    """SIGTERM (the process, or its whole group with `term_group`: a server that spawned
    helpers of its own), then SIGKILL to the group if it has not exited in `timeout_s`.
    The process must have been started with `start_new_session=True`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if term_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
