"""Connection hygiene on the HTTP port (docs/config.md#connections), under uvicorn.

uvicorn times out only a keep-alive connection waiting between requests: a connection that
sends half a request head (slowloris), or nothing at all, or a body that stops, holds its
socket for as long as the client likes, and a few hundred of them exhaust the process's file
descriptors for HTTP and gRPC alike. `GuardedH11Protocol` is uvicorn's h11 protocol plus:

- a deadline on the request head: the whole head must arrive within `header_timeout_s` of
  the connection (or of its first byte after a keep-alive wait), however slowly it trickles;
  past it the client gets 408 and the connection is closed;
- an idle limit on the request body: a body that sends nothing for `body_timeout_s` is
  dropped (the app sees a disconnect; time the app itself leaves it unread does not count);
- a cap on open connections: one more than `max_connections` is answered 503 and closed at
  once, so its descriptor is freed before it can send anything.

With TLS, asyncio's own handshake timeout (60 s) covers the time before the protocol starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.config import RouterConfig

log = logging.getLogger(__name__)

_WARN_EVERY_S = 10.0


def _response(status: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


TOO_MANY = _response("503 Service Unavailable", b"Too many open connections.")
HEAD_TIMEOUT = _response("408 Request Timeout", b"Request head not received in time.")


# Internals nobody tunes (once settings; tests lower them). A request head must arrive whole
# within HEADER_TIMEOUT_S (counted from the connection, or from its first byte after a
# keep-alive wait: answered 408, closed); a body that sends nothing for BODY_TIMEOUT_S is
# dropped; a larger head than MAX_HEADER_BYTES is refused (400, h11's limit); BACKLOG is the
# listen backlog (uvicorn's).
HEADER_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 60.0
MAX_HEADER_BYTES = 16384
BACKLOG = 2048


@dataclass(frozen=True)
class HTTPLimits:
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    max_connections: int = 0  # 0: no cap

    @classmethod
    def of(cls, cfg: RouterConfig) -> HTTPLimits:
        return cls(HEADER_TIMEOUT_S, BODY_TIMEOUT_S, cfg.limits.max_connections)


class _Warnings:
    """At most one warning per kind every _WARN_EVERY_S: a flood is one line, with a count."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args: Any) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        now = time.monotonic()
        if now - self.last.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self.last[kind] = now
            log.warning(msg + " (%d so far)", *args, self.count[kind])


WARNINGS = _Warnings()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline, a body idle limit and a
    connection cap (`limits`; `protocol_for` makes the subclass a server uses)."""

    limits: ClassVar[HTTPLimits] = HTTPLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_kind: Literal["head", "body", ""] = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap and len(self.connections) > cap:
            WARNINGS.warn("cap", "HTTP connection refused: %d open (max_connections)", cap)
            transport.write(TOO_MANY)
            transport.close()
            return
        self._watch_reads()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # refused or timed out: nothing more is parsed
            return
        super().data_received(data)
        self._watch_reads()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_reads()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _watch_reads(self) -> None:
        """Arm, keep or drop the read timer for what the client owes now: a request head
        (one deadline, not moved by bytes trickling in), a body (an idle limit, moved by
        every read), or nothing (a response in progress, or uvicorn's keep-alive wait)."""
        if self.transport.is_closing():
            self._stop_timer()
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.timeout_keep_alive_task is None:
            if self._read_kind != "head":
                self._start_timer("head", self.limits.header_timeout_s)
        elif state is h11.SEND_BODY:
            self._start_timer("body", self.limits.body_timeout_s)
        else:
            self._stop_timer()

    def _start_timer(self, kind: Literal["head", "body"], after_s: float) -> None:
        self._stop_timer()
        self._read_kind = kind
        self._read_timer = self.loop.call_later(after_s, self._timed_out, kind)

    def _stop_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = None
        self._read_kind = ""

    def _timed_out(self, kind: Literal["head", "body"]) -> None:
        self._read_timer = None
        self._read_kind = ""
        if self.transport.is_closing():
            return
        if kind == "body" and self.flow.read_paused:  # the app has not read what came
            self._start_timer("body", self.limits.body_timeout_s)
            return
        if kind == "head":
            limit = self.limits.header_timeout_s
            WARNINGS.warn("head", "HTTP request head incomplete after %.1f s: closed", limit)
            self.transport.write(HEAD_TIMEOUT)
        else:
            limit = self.limits.body_timeout_s
            WARNINGS.warn("body", "HTTP request body idle for %.1f s: closed", limit)
        self.transport.close()


def protocol_for(limits: HTTPLimits) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol subclass bound to `limits` (uvicorn instantiates the class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_options(cfg: RouterConfig) -> dict[str, Any]:
    """Keyword arguments of `uvicorn.Config` for the router's connection limits."""
    return {
        "http": protocol_for(HTTPLimits.of(cfg)),
        "timeout_keep_alive": cfg.http.keepalive_timeout_s,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "backlog": BACKLOG,
    }
