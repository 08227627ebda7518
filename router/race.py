"""One way to race a call against a signal and a deadline (`first_of`).

The router waits on a worker while something else may make the answer moot: a worker
call against the worker being found silent (`WorkerClient._call`), a prompt pass against
its decode worker going silent and its ticket's lease (`RequestFlow._prefill`), a stream's
next response against the router's drain running out (`Router._until_stopped`). Each used
to spell the race out with `asyncio.wait` and its own cleanup; they now share this one, so
that the loser is always cancelled, and the call always unwound, the same way.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Lost(enum.Enum):
    """Why `first_of` returned without the call's answer."""

    SIGNAL = "signal"
    TIMEOUT = "timeout"


async def first_of(
    call: Awaitable[T], signal: Awaitable[object], timeout_s: float | None = None
) -> T | Lost:
    """`call`'s answer (or the exception it raised), unless `signal` completes first
    (`Lost.SIGNAL`) or `timeout_s` passes (`Lost.TIMEOUT`).

    What this function started it also ends: a call or signal given as a coroutine is
    cancelled when it loses, and a losing call is awaited until it has unwound (its own
    cleanup, e.g. a flow's `finally`, has run when this returns). A future or task given by
    the caller as `signal` stays the caller's: it is never cancelled here (a stop signal
    waited on by many calls in turn)."""
    answer = asyncio.ensure_future(call)
    owned_signal = not asyncio.isfuture(signal)
    sig = asyncio.ensure_future(signal)
    try:
        done, _ = await asyncio.wait(
            {answer, sig}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    except BaseException:  # the caller was cancelled: end the call before going
        await _end(answer)
        raise
    finally:
        if owned_signal:
            sig.cancel()
    if answer in done:
        return answer.result()
    await _end(answer)
    return Lost.SIGNAL if sig in done else Lost.TIMEOUT


async def _end(task: asyncio.Future[T]) -> None:
    """Cancel `task` and wait for it to unwind; what it raises doing so is its own (seen
    here, never logged as unretrieved). A cancellation of the caller still propagates."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled():
        task.exception()
