"""`pdserve serve --grpc-port 0 --http-port 0` as a subprocess, for the HTTP tests.

Used by tests/test_http.py, tests/test_metrics.py and tests/test_tls.py (HTTPS, with
`ssl_context`): each module runs one server on the tiny preset (generated under a temporary
PDSERVE_HOME), reads the two ports from its
`pdserve: gRPC listening on HOST:PORT` / `pdserve: HTTP listening on HOST:PORT` lines, and
stops it with SIGTERM (the drain path) at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.models import pdserve_home

ROOT = Path(__file__).resolve().parent.parent
_LINE = re.compile(r"^pdserve: (gRPC|HTTP) listening on (.+):(\d+)$")


class ServeProcess:
    def __init__(
        self,
        home: Path,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 240.0,
        ssl_context: ssl.SSLContext | None = None,  # HTTPS: a server started with --tls-cert
        model: str | None = "tiny",  # None: no --model flag (the server's default)
    ) -> None:
        self.home = home
        self.model_args = ("--model", model) if model else ()
        self.ssl_context = ssl_context
        for attempt in range(2):  # a loaded host can time Ray's startup out: retry once
            self.log_path = home / f"serve-{attempt}.stderr"
            if self._start(extra_args, env, start_timeout_s):
                break
            if attempt == 1 or self.proc.returncode is None:
                self.stop()
                raise RuntimeError(f"pdserve serve did not start: {self.stdout}\n{self.log_tail()}")
        self.grpc_target = f"127.0.0.1:{self.ports['gRPC']}"
        scheme = "https" if ssl_context else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.ports['HTTP']}"

    def _start(
        self, extra_args: tuple[str, ...], env: dict[str, str] | None, timeout_s: float
    ) -> bool:
        """Start the server; whether it printed both ports within `timeout_s`."""
        full_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
        full_env.pop("PDSERVE_API_KEY", None)
        full_env.update({"PDSERVE_HOME": str(self.home), "PYTHONUNBUFFERED": "1", **(env or {})})
        self._stderr = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "serve",
                *self.model_args,
                "--grpc-port",
                "0",
                "--http-port",
                "0",
                *extra_args,
            ],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.ports: dict[str, int] = {}
        self.stdout: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                line = line.rstrip("\n")
                self.stdout.append(line)
                m = _LINE.match(line)
                if m:
                    self.ports[m.group(1)] = int(m.group(3))
                    if len(self.ports) == 2:
                        ready.set()
            ready.set()  # exited

        threading.Thread(target=pump, daemon=True).start()
        ready.wait(timeout_s)
        if len(self.ports) == 2:
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)  # exited (its stdout closed)? then its returncode is known
        return False

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._stderr.close()
        return self.proc.returncode

    # ---- plain HTTP ----------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> tuple[int, dict[str, str], bytes]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers=headers or {}
        )
        if data is not None and "Content-Type" not in (headers or {}):
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self.ssl_context) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def metrics_text(self) -> str:
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        return body.decode()

    def wait_for(self, predicate: Any, timeout_s: float = 30.0, every_s: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value or time.monotonic() > deadline:
                return value
            time.sleep(every_s)


# ---- one server for several modules -------------------------------------------------------
# Modules whose tests need only a stock server share one: the first of them starts it, and
# tests/conftest.py stops it after the last test of their group (`SHARED_SERVERS` there,
# whose scheduler hook hands the group to one worker, which runs them one after another).
# Their tests must hold whatever state the others leave: they wait for an idle server and
# compare counters as deltas, as they would on any long-running server.
_shared: dict[str, ServeProcess] = {}


def shared_server(name: str, factory: pytest.TempPathFactory) -> ServeProcess:
    """The group `name`'s server, started now if no module of the group has (`factory`
    gives it a home)."""
    if name not in _shared:
        _shared[name] = _SHARED_STARTS[name](factory)
    return _shared[name]


def stop_shared_server(name: str) -> None:
    """Stop the group's server if it runs; it must exit 0 (its drain completed)."""
    proc = _shared.pop(name, None)
    if proc is not None:
        rc = proc.stop()
        assert rc == 0, f"the shared {name} server exited with {rc}:\n{proc.log_tail()}"


_SHARED_STARTS: dict[str, Callable[[pytest.TempPathFactory], ServeProcess]] = {
    # `pdserve serve --model tiny` under a fresh home
    "tiny-server": lambda factory: ServeProcess(factory.mktemp("tiny-server")),
    # `pdserve serve` with no model flag: the default model, from the cached conversion
    "default-model-server": lambda factory: ServeProcess(
        factory.mktemp("default-model-server"),
        model=None,
        env={"PDSERVE_HOME": str(pdserve_home())},
    ),
}
