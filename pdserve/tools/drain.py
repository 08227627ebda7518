"""A drain that runs out, seen from the clients: SIGTERM a `pdserve serve` process while
streams are in flight on both faces, and record how each stream ended.

`make chaos`'s `drain-overrun` row (a second router on the rig's pools) and
tests/test_serve_cli.py (a whole `pdserve serve`) both drive it. What must hold
(docs/reliability.md, "Gray failures"): once `router.drain_grace_s` runs out, each HTTP stream
gets an SSE error event and `[DONE]`, each gRPC stream UNAVAILABLE "server shutting down";
none is cut off with no ending, and the server exits 0 with no traceback in its log.

Each client is a thread with a blocking stream (http.client for SSE, the sync gRPC stub):
the point is what reaches a client on the wire, so nothing here shares the server's loop.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc

from pdserve.client import make_request
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc

SHUTTING_DOWN = "server shutting down"
# What a client's stream ended with: an error it was told, a normal end, or nothing at all.
ERROR, FINISHED, TRUNCATED = "error", "finished", "truncated"


@dataclass
class StreamEnd:
    """One client's stream: which face, tokens it saw, and how it ended."""

    face: str  # "http" or "grpc"
    tokens: int = 0
    ending: str = TRUNCATED
    detail: str = ""  # the error's message, or the finish reason
    done: bool = False  # SSE: `data: [DONE]` arrived
    # seconds since the run started (time.monotonic() - DrainRun.t0)
    first_token_s: float | None = None
    ended_s: float | None = None

    @property
    def told_shutting_down(self) -> bool:
        return self.ending == ERROR and SHUTTING_DOWN in self.detail


@dataclass
class DrainRun:
    """The streams and the server's exit after one SIGTERM."""

    ends: list[StreamEnd] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    sigterm_s: float = 0.0
    streaming_at_sigterm: int = 0
    exit_code: int | None = None
    exit_s: float | None = None  # SIGTERM until the process exited

    @property
    def truncated(self) -> list[StreamEnd]:
        return [e for e in self.ends if e.ending == TRUNCATED]


def _first(end: StreamEnd, t0: float) -> None:
    if end.first_token_s is None:
        end.first_token_s = time.monotonic() - t0


def _sse_stream(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    end: StreamEnd,
    started: threading.Event,
    t0: float,
) -> None:
    """A streaming /v1/completions call, read line by line until the server closes it."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=120)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            end.ending, end.detail = ERROR, f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        while line := resp.readline():
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            data = text[len("data: ") :]
            if data == "[DONE]":
                end.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                end.ending, end.detail = ERROR, str(event["error"].get("message", ""))
                continue
            choice = event["choices"][0]
            if choice.get("text"):
                end.tokens += 1
                _first(end, t0)
                started.set()
            if choice.get("finish_reason"):
                end.ending, end.detail = FINISHED, str(choice["finish_reason"])
    except (OSError, http.client.HTTPException, ValueError) as e:
        # a chunked body cut short: what the client sees of a truncated stream
        end.detail = f"{type(e).__name__}: {e}"
    finally:
        end.ended_s = time.monotonic() - t0
        started.set()  # never leave the driver waiting on a stream that could not start
        conn.close()


def _grpc_stream(
    target: str, prompt: str, max_tokens: int, end: StreamEnd, started: threading.Event, t0: float
) -> None:
    request = make_request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        with grpc.insecure_channel(target) as channel:
            for resp in gen_grpc.GenerationStub(channel).Generate(request, timeout=120):
                if resp.HasField("chunk"):
                    end.tokens += len(resp.chunk.token_ids)
                    _first(end, t0)
                    started.set()
                else:
                    reason = gen.FinishReason.Name(resp.complete.finish_reason)
                    end.ending, end.detail = FINISHED, reason
    except grpc.RpcError as e:
        end.ending, end.detail = ERROR, f"{e.code().name}: {e.details()}"
    finally:
        end.ended_s = time.monotonic() - t0
        started.set()


def drain_overrun(
    proc: subprocess.Popen[str],
    grpc_target: str,
    http_url: str | None,
    model: str,
    num_streams: int,
    max_tokens: int,
    exit_timeout_s: float = 60.0,
) -> DrainRun:
    """Start `num_streams` long streams (half over HTTP SSE when `http_url` is given, the rest
    over gRPC), wait until each has a token, SIGTERM `proc`, and wait for every stream and the
    process to end. `max_tokens` must outlast the server's drain grace."""
    faces = ["http" if http_url and i % 2 == 0 else "grpc" for i in range(num_streams)]
    run = DrainRun(ends=[StreamEnd(face) for face in faces])
    started = [threading.Event() for _ in faces]
    threads = []
    for i, (end, ev) in enumerate(zip(run.ends, started, strict=True)):
        prompt = f"stream {i}: the drain runs out while this is being written"
        if end.face == "http":
            assert http_url is not None
            args: tuple[object, ...] = (http_url, model, prompt, max_tokens, end, ev, run.t0)
            t = threading.Thread(target=_sse_stream, args=args, daemon=True)
        else:
            args = (grpc_target, prompt, max_tokens, end, ev, run.t0)
            t = threading.Thread(target=_grpc_stream, args=args, daemon=True)
        t.start()
        threads.append(t)
    for ev in started:
        ev.wait(120)
    run.streaming_at_sigterm = sum(e.tokens > 0 and e.ending == TRUNCATED for e in run.ends)
    t0 = time.monotonic()
    run.sigterm_s = t0 - run.t0
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(exit_timeout_s)
    try:
        run.exit_code = proc.wait(max(exit_timeout_s - (time.monotonic() - t0), 1.0))
        run.exit_s = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        pass
    return run


def log_problems(log: str) -> list[str]:
    """Lines of a server log that say something went unhandled."""
    bad = ("Traceback", "Exception in ASGI application", "Task exception was never retrieved")
    return [line for line in log.splitlines() if any(b in line for b in bad)]
