"""The grpc transport's idle limit: a Push stream that sends nothing for `idle_s` is
cancelled, so a stalled or half-open sender cannot hold one of the endpoint's stream slots
(and its transfer's blocks) for longer than a transfer may take. The stream's consumer then
sees a TransferError and fails the transfer like any stream that breaks off."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

import grpc

from kv_transfer.wire import TransferError

log = logging.getLogger(__name__)

T = TypeVar("T")


class WatchedStream:
    """One Push stream under the watch: `since` is when it began waiting for its next
    chunk (None while the servicer works on the last one)."""

    def __init__(self, context: grpc.ServicerContext, idle_s: float) -> None:
        self.context = context
        self.idle_s = idle_s
        self.since: float | None = None
        self.cancelled = False

    def chunks(self, chunks: Iterator[T]) -> Iterator[T]:
        """`chunks`, timed; a cancellation by the watch surfaces as a TransferError."""
        while True:
            self.since = time.monotonic()
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            except grpc.RpcError as e:
                if self.cancelled:
                    raise TransferError(
                        f"the push stream sent nothing for {self.idle_s:g} s"
                    ) from e
                raise
            finally:
                self.since = None
            yield chunk


class IdleWatch:
    """Cancels watched streams idle for more than `idle_s`: one daemon thread per endpoint,
    looking every quarter of `idle_s` (at least every second)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.num_cancelled = 0
        self._streams: set[WatchedStream] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-grpc-idle", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watch(self, context: grpc.ServicerContext) -> Iterator[WatchedStream]:
        stream = WatchedStream(context, self.idle_s)
        with self._lock:
            self._streams.add(stream)
        try:
            yield stream
        finally:
            with self._lock:
                self._streams.discard(stream)

    def _run(self) -> None:
        period = min(max(self.idle_s / 4, 0.01), 1.0)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                streams = list(self._streams)
            for s in streams:
                since = s.since
                if since is None or s.cancelled or now - since <= self.idle_s:
                    continue
                s.cancelled = True
                self.num_cancelled += 1
                log.warning(
                    "kv push from %s sent nothing for %.1f s: cancelled",
                    s.context.peer(),
                    now - since,
                )
                s.context.cancel()

    def close(self) -> None:
        self._stop.set()
