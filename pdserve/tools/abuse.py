"""One abusive client, for `pdserve chaos`'s abusive-client scenario: what a hostile or broken
client can send at the edge while others are served.

`run_abuser` runs in a child process of its own (like a client on another machine: it takes
CPU, never the router's interpreter lock), abusing and pausing as it is told until told to
stop, with one thread per kind of abuse, each one request at a time:

- huge prompts: a 10 MB prompt text over HTTP (`/v1/completions`) and over gRPC, again and
  again (refused at the edge: 400 / INVALID_ARGUMENT, never tokenized);
- stop-string floods: as many stop strings, each as long, as the router accepts
  (`router.max_stop_strings` x `max_stop_chars`: these requests run, matching every stop at
  every token), then one over each limit (refused), over HTTP and gRPC;
- a slowloris: `num_slowloris` connections to the HTTP port that send half a request head
  and then a byte a second, reopened as the server closes them (408 after
  `router.http_header_timeout_s`), so that many are held open throughout;
- KV pokes: connections to each decode worker's KV endpoint (the TCPStore of torch_dist,
  the gRPC server of grpc) that send nothing, or 4 KB of random bytes, and stay open.

Every payload is built and serialized once and then replayed as bytes, so that the client
spends its CPU (which on the one-machine rig is the server's too) on sending, not on
building 10 MB strings. It reports, per kind, how each attempt ended, and its own CPU time
(`AbuseReport`). Nothing here imports torch, Ray or the router.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.client import make_request

HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
GENERATE = "/pdserve.v1.Generation/Generate"


@dataclass(frozen=True)
class AbuseTargets:
    grpc_target: str  # host:port of the router's gRPC server
    http_port: int  # the router's HTTP port on 127.0.0.1
    model: str  # the served model name
    kv_addresses: tuple[str, ...] = ()  # decode workers' KV endpoints (host:port)


@dataclass(frozen=True)
class AbuseSizes:
    huge_prompt_bytes: int = 10 << 20
    max_stop_strings: int = 16  # the router's limits (router.max_stop_strings, ...)
    max_stop_chars: int = 256
    stop_max_tokens: int = 32  # tokens each accepted stop-flood request generates
    num_slowloris: int = 256  # half-sent request heads held open at once
    kv_pokes: int = 8  # connections held open on each KV endpoint (half send junk)
    timeout_s: float = 60.0  # per abusive request


@dataclass
class AbuseReport:
    """How each attempt ended, by kind: an HTTP status, a gRPC code name, or an error."""

    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    slowloris_opened: int = 0
    slowloris_held_at_go: int = 0  # half heads open when the loaded run began
    kv_opened: int = 0
    kv_closed_by_server: int = 0  # of those, closed by the endpoint before the end
    wall_s: float = 0.0  # from the start of the abuse to its end
    cpu_s: float = 0.0  # the client's own CPU time (user + system) while it abused

    def count(self, kind: str, how: str) -> None:
        self.outcomes.setdefault(kind, Counter())[how] += 1

    def total(self, kind: str) -> int:
        return sum(self.outcomes.get(kind, Counter()).values())

    def to_json(self) -> dict[str, Any]:
        return {
            "outcomes": {k: dict(v) for k, v in sorted(self.outcomes.items())},
            "slowloris_opened": self.slowloris_opened,
            "slowloris_held_at_go": self.slowloris_held_at_go,
            "kv_opened": self.kv_opened,
            "kv_closed_by_server": self.kv_closed_by_server,
            "wall_s": round(self.wall_s, 2),
            "cpu_s": round(self.cpu_s, 2),
        }


class Abuser:
    """The threads of one abusive client; `start`, then `stop` for the report."""

    def __init__(self, targets: AbuseTargets, sizes: AbuseSizes) -> None:
        self.t = targets
        self.sizes = sizes
        self.report = AbuseReport()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.turn = threading.Condition()  # guards `active` and `parked`
        self.active = True  # the threads abuse; else they park between steps (`pause`)
        self.parked = 0
        self.threads: list[threading.Thread] = []
        self.channel = grpc.insecure_channel(
            targets.grpc_target,
            options=[("grpc.max_send_message_length", 2 * sizes.huge_prompt_bytes)],
        )
        # Requests go as bytes serialized once (no request serializer): see the module doc.
        self.generate = self.channel.unary_stream(GENERATE)
        self.payloads = self._payloads()
        self.slow: set[socket.socket] = set()  # half-sent request heads
        self.kv: list[socket.socket] = []
        self.t0 = time.monotonic()
        self.cpu0 = _cpu_s()

    def count(self, kind: str, how: str) -> None:
        with self.lock:
            self.report.count(kind, how)

    def _payloads(self) -> dict[str, tuple[bytes, bytes]]:
        """Per kind of abusive request: its HTTP body and its gRPC request, as bytes."""
        sizes, model = self.sizes, self.t.model
        huge = "z" * sizes.huge_prompt_bytes
        n, length = sizes.max_stop_strings, sizes.max_stop_chars
        at_limit = [f"{i:03d}" + "s" * (length - 3) for i in range(n)]
        kinds: dict[str, tuple[str, list[str], int]] = {  # prompt, stops, max_tokens
            "huge prompt": (huge, [], 4),
            "stop flood": ("a flood of stops", at_limit, sizes.stop_max_tokens),
            "stops over limit (count)": ("x", [*at_limit, "t"], 4),
            "stops over limit (length)": ("x", [at_limit[0], "u" * (length + 1)], 4),
        }
        out = {}
        for kind, (prompt, stop, max_tokens) in kinds.items():
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stop": stop}
            req = make_request(prompt, stop=stop, max_tokens=max_tokens)
            out[kind] = (json.dumps(body).encode(), req.SerializeToString())
        return out

    # ---- set-up ---------------------------------------------------------------------------
    def open_held(self) -> None:
        """Open the slowloris heads and the KV pokes (before the loaded run starts)."""
        for _ in range(self.sizes.num_slowloris):
            self._open_slow()
        rnd = os.urandom(4096)
        for address in self.t.kv_addresses:
            host, port = address.rsplit(":", 1)
            for i in range(self.sizes.kv_pokes):
                try:
                    s = socket.create_connection((host, int(port)), timeout=5)
                    if i % 2:
                        s.sendall(rnd)
                except OSError as e:
                    self.count("kv poke", f"connect failed: {type(e).__name__}")
                    continue
                s.setblocking(False)
                self.kv.append(s)
        self.report.kv_opened = len(self.kv)

    def _open_slow(self) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.t.http_port), timeout=5)
            s.sendall(HALF_HEAD)
        except OSError as e:
            self.count("slowloris", f"connect failed: {type(e).__name__}")
            return
        s.setblocking(False)
        self.slow.add(s)
        self.report.slowloris_opened += 1

    def start(self) -> None:
        self.t0, self.cpu0 = time.monotonic(), _cpu_s()
        self.report.slowloris_held_at_go = len(self.slow)
        for loop in (self._huge, self._stops, self._slowloris):
            t = threading.Thread(target=self._forever, args=(loop,), daemon=True)
            t.start()
            self.threads.append(t)

    def pause(self) -> None:
        """Stop abusing once every thread's step in flight has ended (the slowloris heads
        stay open, idle): from here on the server sees no abuse until `resume`."""
        with self.turn:
            self.active = False
            self.turn.wait_for(lambda: self.parked == len(self.threads), self.sizes.timeout_s)

    def resume(self) -> None:
        with self.turn:
            self.active = True
            self.turn.notify_all()

    def stop(self) -> AbuseReport:
        self.done.set()
        self.resume()  # wake the parked threads, which see `done`
        for t in self.threads:
            t.join(self.sizes.timeout_s)
        for s in self.kv:
            with contextlib.suppress(OSError):
                if s.recv(1) == b"":
                    self.report.kv_closed_by_server += 1
        for s in [*self.kv, *self.slow]:
            s.close()
        self.channel.close()
        self.report.wall_s = time.monotonic() - self.t0
        self.report.cpu_s = _cpu_s() - self.cpu0
        return self.report

    def _forever(self, step: Callable[[], None]) -> None:
        while not self.done.is_set():
            with self.turn:
                if not self.active:
                    self.parked += 1
                    self.turn.notify_all()
                    self.turn.wait_for(lambda: self.active)
                    self.parked -= 1
            if not self.done.is_set():
                step()

    # ---- the abuse ------------------------------------------------------------------------
    def _send(self, kind: str, counted_as: str = "") -> None:
        body, request = self.payloads[kind]
        self.count(f"{counted_as or kind} HTTP", self._post(body))
        self.count(f"{counted_as or kind} gRPC", self._generate(request))

    def _huge(self) -> None:
        self._send("huge prompt")

    def _stops(self) -> None:
        self._send("stop flood")
        self._send("stops over limit (count)", "stops over limit")
        self._send("stops over limit (length)", "stops over limit")

    def _slowloris(self) -> None:
        """A byte a second on every half head; one the server closed is counted and reopened."""
        sel = selectors.DefaultSelector()
        for sock in self.slow:
            sel.register(sock, selectors.EVENT_READ, data=sock)
        try:
            for key, _ in sel.select(timeout=1.0):
                s: socket.socket = key.data
                try:
                    got = s.recv(4096)
                except OSError:
                    got = b""
                self.count("slowloris", _answer(got))
                self.slow.discard(s)
                s.close()
                if not self.done.is_set():
                    self._open_slow()
            for s in list(self.slow):
                with contextlib.suppress(OSError):
                    s.send(b"x")
        finally:
            sel.close()

    def _post(self, body: bytes) -> str:
        conn = http.client.HTTPConnection(
            "127.0.0.1", self.t.http_port, timeout=self.sizes.timeout_s
        )
        try:
            headers = {"Content-Type": "application/json"}
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            return str(resp.status)
        except (OSError, http.client.HTTPException) as e:
            return f"error: {type(e).__name__}"
        finally:
            conn.close()

    def _generate(self, request: bytes) -> str:
        try:
            for _ in self.generate(request, timeout=self.sizes.timeout_s):
                pass
        except grpc.RpcError as e:
            return str(e.code().name)
        return "OK"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _answer(got: bytes) -> str:
    """What the server sent before closing a half-sent head: its status, or nothing."""
    if not got:
        return "closed"
    first = got.split(b"\r\n", 1)[0].decode("latin-1")
    parts = first.split(" ")
    return parts[1] if len(parts) > 1 else first[:40]


def run_abuser(targets: AbuseTargets, sizes: AbuseSizes, commands: Any, out: Any) -> None:
    """The child process: say "ready" (imported), then follow `commands` (a multiprocessing
    queue): "abuse" (the first one opens the held connections and starts the threads) is
    answered "abusing" once the abuse runs, "pause" is answered "quiet" once no abusive
    request is in flight, and "stop" (or anything else) ends it; then put the
    `AbuseReport` on `out`."""
    abuser = Abuser(targets, sizes)
    out.put("ready")
    try:
        while (command := commands.get()) in ("abuse", "pause"):
            if command == "pause":
                abuser.pause()
                out.put("quiet")
            elif abuser.threads:
                abuser.resume()
                out.put("abusing")
            else:
                abuser.open_held()
                abuser.start()
                out.put("abusing")
    finally:
        out.put(abuser.stop())
