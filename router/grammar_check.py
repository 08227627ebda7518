"""The edge's check of a structured-output request: its grammar compiles, within a bound.

A pathological schema or regex can keep a compiler busy for minutes, and a thread cannot be
stopped. So the router compiles in a child process of its own (spawned on first use; it loads
xgrammar and the served tokenizer once): a compile that outlasts `timeout_s` is refused with
a 400 naming the field, the child is killed and the next check starts a fresh one, and a
spec that timed out is refused at once when it comes again. Nothing reaches a worker before
it passed here; the workers then compile the same spec from their own caches.

One check at a time (the child is single-threaded); specs that passed are remembered, so a
repeat costs nothing. The pipe carries JSON bytes only (`send_bytes`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc

from engine.sampling import InvalidParameterError
from engine.structured import StructuredOutput, lowly
from router.active import RequestFailed

log = logging.getLogger(__name__)
COMPILE_TIMEOUT_S = 5.0  # a grammar that takes longer at the edge is refused (a 400)
REMEMBERED = 1024  # specs remembered as good, and as timed out (each an LRU)


@dataclass(frozen=True)
class TokenizerSpec:
    """What the child needs to build the same backend as the workers'."""

    tokenizer_json: str  # `tokenizers.Tokenizer.to_str()`
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def _child(conn: Connection) -> None:
    """The compile loop: the tokenizer first, then one JSON request in, one answer out.
    It is ready only once the backend is warm, so a compile's bound times the compile."""
    # Ctrl-C (the terminal's SIGINT to the whole process group) is the server's to handle.
    # The child was started with SIGINT blocked (`_spawn`), so one that came while it
    # imported is still pending: ignored from here on, it is dropped when unblocked.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    spec = json.loads(conn.recv_bytes())
    made: list[Any] = []
    # The cold start (imports, tokenizer info: seconds of CPU) at low priority: it must not
    # slow the requests the router serves meanwhile. Compiles run at normal priority.
    setup = threading.Thread(target=lowly(lambda: made.append(_warm_backend(spec))))
    setup.start()
    setup.join()
    backend = made[0]
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            backend.compile(StructuredOutput(req["kind"], req["spec"], req["field"], req["strict"]))
            answer: dict[str, Any] = {"ok": True}
        except InvalidParameterError as e:
            answer = {"error": e.message}
        answer["ms"] = (time.perf_counter() - t0) * 1e3
        conn.send_bytes(json.dumps(answer).encode())


def _warm_backend(spec: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer as HFTokenizer

    from engine.structured import GrammarBackend

    tok = HFTokenizer.from_str(spec["tokenizer_json"])
    backend = GrammarBackend(tok, spec["vocab_size"], tuple(spec["eos_token_ids"]))
    backend.warm()
    return backend


def _spawn(proc: Any) -> None:
    """Start `proc` with SIGINT blocked, as the child inherits its signal mask: a Ctrl-C
    in the second it spends importing, before `_child` ignores SIGINT, would otherwise end
    it with a KeyboardInterrupt traceback on the server's terminal. Blocked in this thread
    only (any thread may start the child), and only while it is spawned."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class GrammarChecker:
    def __init__(self, tokenizer: TokenizerSpec, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._proc: Any = None  # multiprocessing.Process
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one check at a time (the child is sequential)
        self._turn: asyncio.Lock | None = None  # made on the router's loop, at first use
        self._good: OrderedDict[str, None] = OrderedDict()
        self._timed_out: OrderedDict[str, None] = OrderedDict()
        self.num_timeouts = 0
        self._closed = False  # `close` ran: a start it cut short is no warning

    async def check(self, so: StructuredOutput) -> None:
        """Raise InvalidParameterError naming `so.field` when it does not compile, or not
        within `timeout_s`. Runs off the event loop."""
        if so.key in self._good:
            return
        if so.key in self._timed_out:
            raise self._too_slow(so)
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:  # waiters queue here, not in the event loop's thread pool
            await asyncio.to_thread(self._check, so)

    def start(self) -> threading.Thread:
        """Start the child now, in the background (the router's start-up must not wait for
        it): the first check then finds it warm, or waits only for what is left."""

        def warm() -> None:
            with self._lock:
                try:
                    self._child_conn()
                except (RuntimeError, OSError, EOFError) as e:  # the first check tries again
                    if not self._closed:  # else the router closed (killed it) as it started
                        log.warning("the grammar checker did not start: %r", e)

        thread = threading.Thread(target=warm, name="grammar-check-start", daemon=True)
        thread.start()
        return thread

    def _too_slow(self, so: StructuredOutput) -> InvalidParameterError:
        return InvalidParameterError(
            so.field, f"did not compile within {self.timeout_s:g} s (too complex)"
        )

    def _check(self, so: StructuredOutput) -> None:
        with self._lock:
            try:
                answer = self._ask(so)
            except (EOFError, OSError) as e:  # the child died (or was stopped) under it
                self._kill()
                raise RequestFailed(
                    grpc.StatusCode.UNAVAILABLE, f"the grammar checker stopped: {e!r}"
                ) from e
        if "error" in answer:
            raise InvalidParameterError(so.field, answer["error"])
        _remember(self._good, so.key)

    def _ask(self, so: StructuredOutput) -> dict[str, Any]:
        conn = self._child_conn()
        request = {"kind": so.kind, "spec": so.spec, "field": so.field, "strict": so.strict}
        conn.send_bytes(json.dumps(request).encode())
        if not conn.poll(self.timeout_s):
            self.num_timeouts += 1
            log.warning("a %s grammar did not compile within %g s", so.kind, self.timeout_s)
            self._kill()
            _remember(self._timed_out, so.key)
            raise self._too_slow(so)
        return dict(json.loads(conn.recv_bytes()))

    def _child_conn(self) -> Connection:
        """The live child's pipe, starting a child (and waiting until it is ready)."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        self._kill()
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        parent, child = ctx.Pipe()
        spec = json.dumps(
            {
                "tokenizer_json": self.tokenizer.tokenizer_json,
                "vocab_size": self.tokenizer.vocab_size,
                "eos_token_ids": list(self.tokenizer.eos_token_ids),
            }
        ).encode()
        proc = ctx.Process(target=_child, args=(child,), daemon=True, name="grammar-check")
        _spawn(proc)
        self._proc = proc  # `close` stops it even while it starts
        child.close()
        parent.send_bytes(spec)
        if not parent.poll(120.0):  # it imports xgrammar and transformers: seconds
            proc.kill()
            raise RuntimeError("the grammar checker did not start")
        parent.recv_bytes()
        self._proc, self._conn = proc, parent
        return parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self) -> None:
        """Stop the child without waiting for a check in progress (that check then ends
        UNAVAILABLE)."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            proc.kill()


def _remember(lru: OrderedDict[str, None], key: str) -> None:
    lru[key] = None
    lru.move_to_end(key)
    while len(lru) > REMEMBERED:
        lru.popitem(last=False)
