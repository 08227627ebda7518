"""Runs an `LLMEngine` on its own thread, so a worker's event loop never blocks on a forward.

The engine is best built on that thread too (pass a function that builds it): torch's
OpenMP runtime keeps one thread team per thread that ever ran a parallel op, and once a
process holds more OpenMP threads than cores, libgomp stops spinning between parallel
regions and every one of a decode step's hundreds of regions pays a futex wake-up. Weights
loaded on the actor's main thread leave such a second team behind (the cost of a decode
step: docs/benchmarks.md).

With env `PDSERVE_STEP_LOG=DIR`, each loop appends one JSON line per step to
`DIR/<name>-<pid>.jsonl` (`StepLog`): the batch's shape and the step's served costs, what
`make bench-plan` compares with the step-time model a profile fitted in isolation.

Other threads (a Ray actor's asyncio loop, transport threads) hand the loop closures with
`call`; the loop runs them between steps, in order, on the engine thread. The engine, its
block manager included, is therefore only ever touched by one thread: transport threads
hand block frees back through `call` too (`KVReceiver`'s `release`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from engine.engine import LLMEngine
from engine.request import RequestOutput
from engine.scheduler import BatchShape

log = logging.getLogger(__name__)
T = TypeVar("T")
_Command = tuple[Callable[[], object], "concurrent.futures.Future[object]"]
_IDLE_WAIT_S = 0.05
_BLOCKED_WAIT_S = 0.002


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS name (`top -H`, `/proc/<pid>/task/*/comm`, py-spy), so
    an operator can tell the engine thread from Ray's and torch's; Linux only, best effort."""
    lib = ctypes.util.find_library("c")
    if lib is None:
        return
    try:
        libc = ctypes.CDLL(lib)
        libc.pthread_self.restype = ctypes.c_ulong  # a pointer-sized handle, not an int
        libc.pthread_setname_np.argtypes = [ctypes.c_ulong, ctypes.c_char_p]
        libc.pthread_setname_np(libc.pthread_self(), name.encode()[:15])
    except (OSError, AttributeError):
        pass


STEP_LOG_ENV = "PDSERVE_STEP_LOG"


class StepLog:
    """Per-step records of a serving engine, one JSON line each (buffered; flushed at least
    once a second, when the engine goes idle and at stop):

    - `t`: wall-clock time at the step's end (`time.time()`);
    - `chunks`, `decode`: the batch's shape (`SchedulerOutput.batch_shape`);
    - `rows`: the outputs it handed on (requests that got a token or ended);
    - `step_s`: `LLMEngine.step`, whole;
    - `out_s`: handing its outputs on (the worker's streaming);
    - `gap_s`: from the previous step's outputs to this step's start (commands run between
      steps: admissions, transfers landing, frees), 0 after an idle wait."""

    def __init__(self, directory: str, name: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{name}-{os.getpid()}.jsonl")
        self._file = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - closed at stop
        self._flushed = time.monotonic()

    def write(
        self, shape: BatchShape, rows: int, step_s: float, out_s: float, gap_s: float
    ) -> None:
        rec = {
            "t": round(time.time(), 4),
            "chunks": shape.chunks,
            "decode": shape.decode,
            "rows": rows,
            "step_s": round(step_s, 6),
            "out_s": round(out_s, 6),
            "gap_s": round(gap_s, 6),
        }
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if time.monotonic() - self._flushed > 1.0:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()


class EngineFailed(RuntimeError):
    """The engine thread died (or is stuck): this engine serves nothing more. A worker's
    callers take it as the worker being unavailable, not as a bug of theirs."""


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        on_outputs: Callable[[list[RequestOutput]], None] | None = None,
        name: str = "engine",
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`engine`: an engine, or a function that builds one on the loop's thread (what a
        worker passes: `WorkerBase.__init__`). Returns once the engine exists; a build error raises
        here."""
        self.on_outputs = on_outputs
        self.on_fatal = on_fatal  # called on the engine thread after a fatal error
        self.fatal: BaseException | None = None
        log_dir = os.environ.get(STEP_LOG_ENV)
        self.step_log = StepLog(log_dir, name) if log_dir else None
        self.num_steps = 0  # steps that ran a forward
        self.step_s_total = 0.0  # their wall time (schedule, forward, sampling, detokenize)
        self._busy_since: float | None = None  # monotonic start of the step or call running
        self._cmds: queue.SimpleQueue[
            tuple[Callable[[], object], concurrent.futures.Future[object]]
        ] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine, built), name=f"{name}-loop", daemon=True
        )
        self._thread.start()
        built.result()  # sets self.engine, or raises what building it raised

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread before the next step; its result resolves the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.fatal is not None:
            fut.set_exception(EngineFailed(f"engine died: {self.fatal!r}"))
            return fut
        self._cmds.put((fn, fut))  # type: ignore[arg-type]
        self._wake.set()
        return fut

    def on_its_thread(self) -> bool:
        """Whether the caller runs on the engine thread (owner checks)."""
        return threading.current_thread() is self._thread

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def busy_s(self) -> float:
        """How long the engine thread has been on its current step or call (0: between
        them): what tells a worker that is busy (one long prompt pass) from one that is
        stuck, without waiting on the thread."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _drain(self) -> None:
        while True:
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            self._busy_since = time.monotonic()
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)
            finally:
                self._busy_since = None

    def _run(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        built: concurrent.futures.Future[LLMEngine],
    ) -> None:
        name_os_thread("pd-engine")
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(self.engine)
        try:
            self._loop()
        except BaseException as e:  # a fatal engine error must not go silent
            self.fatal = e
            log.exception("engine loop %s died", self._thread.name)
            self._fail_pending(e)
            if self.on_fatal is not None:
                self.on_fatal(e)

    def _fail_pending(self, error: BaseException) -> None:
        """Answer every queued command with the fatal error, so no caller waits forever."""
        while True:
            try:
                _, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineFailed(f"engine died: {error!r}"))

    def _loop(self) -> None:
        last = None  # when the previous step's outputs were handed on (None: idle since)
        while not self._stop.is_set():
            self._drain()
            if not self.engine.has_unfinished():
                if last is not None and self.step_log is not None:
                    self.step_log.flush()  # idle now: what it wrote is readable
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                last = None
                continue
            t0 = time.perf_counter()
            self._busy_since = time.monotonic()
            try:
                result = self.engine.step()
            finally:
                self._busy_since = None
            t1 = time.perf_counter()
            outputs = result.outputs
            if result.phase is not None:
                self.num_steps += 1
                self.step_s_total += t1 - t0
            else:  # work exists but none fits now (e.g. waiting on blocks): do not spin
                self._wake.wait(_BLOCKED_WAIT_S)
                self._wake.clear()
            if outputs and self.on_outputs is not None:
                self.on_outputs(outputs)
            if self.step_log is not None and result.phase is not None:
                gap = 0.0 if last is None else t0 - last
                self._log_step(result.shape, len(outputs), t1 - t0, time.perf_counter() - t1, gap)
            last = time.perf_counter() if result.phase is not None else None

    def _log_step(
        self, shape: BatchShape, rows: int, step_s: float, out_s: float, gap: float
    ) -> None:
        """A record for the step log; a log that cannot be written is dropped, never the
        engine (observability must not stop serving)."""
        assert self.step_log is not None
        try:
            self.step_log.write(shape, rows, step_s, out_s, gap)
        except Exception:
            log.exception("step log %s: cannot write; logging stops", self.step_log.path)
            self.step_log = None

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self.step_log is not None and not self._thread.is_alive():
            self.step_log.close()
