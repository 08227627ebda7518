"""The token stream: decode workers push tokens to the router over one TCP connection each.

Why: relaying tokens by Ray long-poll cost one actor call and its reply per request per
engine step, each waking several threads in three processes; on a two-core box those
wake-ups land on the cores the engine's OpenMP threads spin on (docs/benchmarks.md). Here a
step's tokens for one router go out as one frame written by the engine thread itself (one
non-blocking `send`), and the router reads them on its event loop: no call, no reply.

Wire (`protos/pdserve/v1/token_stream.proto`): the router listens (`router.token_sink`);
each request it places carries a `TokenSink` (the listener's address and a secret). The
worker connects once per sink and writes frames, each a 4-byte big-endian length and a
`TokenStreamFrame`; the first holds only the hello with the secret. Nothing flows back.

Liveness stays with Ray: the router still polls a pushed request about once a second
(`DecodeWorker.poll` answers at once, with no tokens), which keeps the worker's idle-stream
reaper away and tells the router when the worker or the request is gone.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Sequence

from engine.request import FinishReason
from engine.sampling import TokenLogprob
from pool_api.messages import TokenBatch, TokenSink
from protos.pdserve.v1 import WIRE_VERSION
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import token_stream_pb2 as tspb

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a frame past this is a broken or hostile peer
# A router that reads nothing for this long is treated as gone: its streams are aborted.
SEND_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
CLOSE_JOIN_S = 2.0  # how long `close` waits for the flusher thread to return

# The one map from the engine's finish reasons to the proto's (the router's responses too).
FINISH_TO_PROTO = {
    FinishReason.STOP: gen.FINISH_REASON_STOP,
    FinishReason.LENGTH: gen.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gen.FINISH_REASON_ABORT,
}
_FINISH_OF_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


def logprob_pb(lp: TokenLogprob) -> gen.TokenLogprob:
    """A sampled token's logprob (and its top alternatives) as the public proto's."""
    return gen.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[gen.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank,
    )


def logprob_of(lp: gen.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top), lp.rank
    )


def prompt_logprobs_pb(lps: Sequence[TokenLogprob | None]) -> list[gen.TokenLogprob]:
    """Prompt logprobs as the protos carry them: positions 1 .. n-1 (0 has none)."""
    return [logprob_pb(lp) for lp in lps[1:] if lp is not None]


# ---- the codec -------------------------------------------------------------------------------
def delta(batch: TokenBatch) -> tspb.TokenDelta:
    d = tspb.TokenDelta(
        request_id=batch.request_id,
        token_ids=batch.token_ids,
        text=batch.text,
        finished=batch.finished,
        num_cached_tokens=batch.num_cached_tokens,
        error=batch.error,
        logprobs=[logprob_pb(lp) for lp in batch.logprobs],
        prompt_logprobs=prompt_logprobs_pb(batch.prompt_logprobs),
        index=batch.index,
    )
    if batch.finish_reason is not None:
        d.finish_reason = FINISH_TO_PROTO[batch.finish_reason]
    return d


def batch_of(d: tspb.TokenDelta) -> TokenBatch:
    return TokenBatch(
        request_id=d.request_id,
        token_ids=tuple(d.token_ids),
        text=d.text,
        logprobs=tuple(logprob_of(lp) for lp in d.logprobs),
        prompt_logprobs=(
            (None, *(logprob_of(lp) for lp in d.prompt_logprobs)) if d.prompt_logprobs else ()
        ),
        finished=d.finished,
        finish_reason=_FINISH_OF_PROTO.get(d.finish_reason) if d.finished else None,
        num_cached_tokens=d.num_cached_tokens,
        error=d.error,
        index=d.index,
    )


def encode(frame: tspb.TokenStreamFrame) -> bytes:
    body = frame.SerializeToString()
    return HEADER.pack(len(body)) + body


def hello(sink: TokenSink, worker: str) -> bytes:
    greeting = tspb.TokenStreamHello(secret=sink.secret, worker=worker, wire_version=WIRE_VERSION)
    return encode(tspb.TokenStreamFrame(hello=greeting))


def frame(deltas: Iterable[tspb.TokenDelta]) -> bytes:
    return encode(tspb.TokenStreamFrame(deltas=deltas))


# ---- the worker's end ------------------------------------------------------------------------
class SinkConnection:
    """One decode worker's connection to one router's sink.

    `send` may be called from any thread and returns at once: the frame goes out with one
    non-blocking `send` when the socket takes it all, the rest waits in order for a flusher
    thread. A router that stops reading for `SEND_TIMEOUT_S`, or a broken connection, ends
    it: `on_lost(sink)` runs once (on the flusher or the sending thread) and later sends are
    dropped.
    """

    def __init__(
        self, sink: TokenSink, worker: str, on_lost: Callable[[TokenSink, str], None]
    ) -> None:
        self.sink = sink
        self._on_lost = on_lost
        host, _, port = sink.address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(hello(sink, worker))
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._pending: list[bytes] = []  # bytes not yet sent, in order
        self._busy = False  # the flusher is writing a backlog: new frames queue behind it
        self.closed = False
        self._flusher = threading.Thread(
            target=self._flush_loop, name="pd-token-flush", daemon=True
        )
        self._flusher.start()

    def send(self, data: bytes) -> None:
        with self._lock:
            if self.closed:
                return
            if not self._pending and not self._busy:
                try:
                    n = self._sock.send(data)
                except BlockingIOError:
                    n = 0
                except OSError as e:
                    self._lose_locked(f"send failed: {e}")
                    return
                if n == len(data):
                    return
                data = data[n:]
            self._pending.append(data)
            self._ready.notify()

    def close(self) -> None:
        """Drop what is pending and end the flusher (waited for: it holds `on_lost`, and so
        the worker, until it returns; a blocked write ends with the socket)."""
        with self._lock:
            self.closed = True
            self._ready.notify()
        self._sock.close()
        if threading.current_thread() is not self._flusher:
            self._flusher.join(CLOSE_JOIN_S)

    def _lose_locked(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self._ready.notify()
        # on_lost takes other locks (the worker's loop): never call it holding ours
        threading.Thread(target=self._on_lost, args=(self.sink, why), daemon=True).start()

    def _flush_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self.closed:
                    self._busy = False
                    self._ready.wait()
                if self.closed:
                    return
                self._busy = True
                data = b"".join(self._pending)
                self._pending.clear()
            try:
                self._write_all(data)
            except OSError as e:
                with self._lock:
                    self._lose_locked(str(e))
                return

    def _write_all(self, data: bytes) -> None:
        """Blocking write of a backlog, outside the lock; newer frames queue behind it."""
        view = memoryview(data)
        while view:
            _, writable, _ = select.select([], [self._sock], [], SEND_TIMEOUT_S)
            if not writable:
                raise OSError(f"the router read nothing for {SEND_TIMEOUT_S:.0f} s")
            try:
                view = view[self._sock.send(view) :]
            except BlockingIOError:
                continue
