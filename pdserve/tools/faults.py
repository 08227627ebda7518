"""A deployment in this process with its faults at hand, for `pdserve chaos` and the tests.

`Rig` stands up what `pdserve serve` runs (the two pools as Ray actors, the router's gRPC
and HTTP servers on an event loop thread of its own) and adds what a fault harness needs:
each worker's process id, `kill -9` of a worker process, the router's requests on a worker
(what a kill is about to hit), a stalled KV transfer (a wrapper around the prefill worker's
transport, `pdserve.tools.stall`, that counts what it held), and the quiescence checks:
blocks still used on each worker and per-request state still held anywhere.
`RedisProcess` is a redis-server child for the prefix index that can be killed like a
crashed server and started again on the same port. `RouterProcess` is a second router, a
`pdserve serve` child attached to the rig's Ray cluster and pools, to be killed mid-load.

Nothing here changes how pdserve behaves; it reads worker state and injects faults from
outside the production classes. One setting is the exception: `set_stream_idle_timeout`
lowers the decode workers' `stream_idle_timeout_s`, which `pdserve.launch` derives as
max(30 s, 10 x router.heartbeat_s) and the serve config cannot set, so that a dead
router's streams are dropped within seconds instead of 30.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from pdserve.config import ServeConfig
from pdserve.launch import Deployment
from pdserve.serve import freeze_startup_heap
from router.core import Router
from router.http import HTTPServer, start_http_server
from router.pools import WorkerLoad
from router.service import RouterServer, start_server

T = TypeVar("T")
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisProcess:
    """redis-server on 127.0.0.1:`port` without persistence; `start` again after `kill`
    brings up a fresh, empty server on the same address, as a restarted pod would."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir.resolve()  # redis-server runs in it and is told it again
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> RedisProcess:
        import redis

        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir), "--loglevel", "warning"]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.workdir
        )
        client = redis.Redis(port=self.port, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer PING in {timeout_s:.0f} s")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; what a crash or an OOM kill does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def registered_workers(self, model_name: str) -> set[str]:
        """Workers whose epoch is registered in this Redis (docs/prefix_index.md)."""
        import redis

        client = redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)
        try:
            return {str(k) for k in client.hkeys(f"pdserve:{{{model_name}}}:epochs")}
        except redis.RedisError:
            return set()
        finally:
            client.close()


_LISTENING = re.compile(r"^pdserve: (gRPC|HTTP) listening on (.+):(\d+)$")
_NOT_INHERITED = ("RAY_ADDRESS", "PDSERVE_API_KEY", "PDSERVE_REDIS_URL", "PDSERVE_REDIS_PASSWORD")


class RouterProcess:
    """A second router: `pdserve serve` in a child process, attached to the Ray cluster at
    `ray_address` and to the pools already running there. `pdserve.launch.Deployment`
    creates its workers as named actors with `get_if_exists`, so with the same namespace
    and pool sizes it takes handles to the rig's workers instead of starting new ones.
    `kill9` is the router dying: its clients' streams break, and what it held on the
    workers is theirs to free (leases, the idle-stream bound).

    Its config is the rig's (`cfg`) with `ray.detached` set, so that even a graceful stop of
    this router would leave the rig's workers alone (it never kills detached actors)."""

    def __init__(
        self,
        cfg: ServeConfig,
        ray_address: str,
        http: bool = False,
        router: dict[str, Any] | None = None,
    ) -> None:
        """`http`: serve the HTTP API too (port 0); `router`: keys over the rig's `router`
        section (the drain-overrun row sets `drain_grace_s` and `log_requests`)."""
        data = cfg.to_dict(reveal_secrets=True)
        data["ray"] = {**data["ray"], "address": None, "detached": True}
        section = {**data["router"], **(router or {})}
        section["grpc"] = {**section["grpc"], "port": 0}
        section["http"] = {**section["http"], "enabled": http, "port": 0}
        data["router"] = section
        self.config = data
        self.http = http
        self.ray_address = ray_address
        self.dir = tempfile.TemporaryDirectory(prefix="pdserve-router-")
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.http_port = 0
        self.log_path = Path(self.dir.name) / "serve.stderr"

    @property
    def target(self) -> str:
        assert self.port, "start the router process first"
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str | None:
        return f"http://127.0.0.1:{self.http_port}" if self.http_port else None

    def start(self, timeout_s: float = 180.0) -> RouterProcess:
        """Start it and wait for its `gRPC listening` line (and the HTTP one with `http`)."""
        path = Path(self.dir.name) / "serve.yaml"  # JSON is YAML; it may hold secrets: 0600
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.config, f)
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        env["PYTHONUNBUFFERED"] = "1"
        args = [sys.executable, "-m", "pdserve.cli", "serve", "--config", str(path)]
        args += ["--ray-address", self.ray_address, "--grpc-port", "0"]
        args += ["--http-port", "0"] if self.http else ["--no-http"]
        with open(self.log_path, "w") as err:
            self.proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=err, text=True, env=env
            )
        listening = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                m = _LISTENING.match(line.rstrip("\n"))
                if m and m.group(1) == "gRPC":
                    self.port = int(m.group(3))
                elif m:
                    self.http_port = int(m.group(3))
                if self.port and (self.http_port or not self.http):
                    listening.set()
            listening.set()  # it exited

        threading.Thread(target=pump, daemon=True).start()
        listening.wait(timeout_s)
        if not self.port or (self.http and not self.http_port):
            self.kill9()
            tail = self.log_tail()
            raise RuntimeError(f"pdserve serve (the second router) did not start:\n{tail}")
        return self

    def kill9(self) -> int | None:
        """SIGKILL, as the OOM killer would; returns the dead pid (None: not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        pid = self.proc.pid
        self.proc.kill()
        self.proc.wait(10)
        return pid

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        self.kill9()
        with contextlib.suppress(OSError):
            self.dir.cleanup()


@dataclass
class Quiescence:
    """What is left once the load is over: it should all be empty or zero."""

    used_blocks: dict[str, int | None]  # worker -> total - free (None: did not answer)
    leftovers: dict[str, list[str]]  # worker -> per-request state still held
    router_active: list[str]  # requests the router still tracks
    waited_s: float
    integrity_errors: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return (
            not self.router_active
            and all(v == 0 for v in self.used_blocks.values())
            and not any(self.leftovers.values())
            and not self.integrity_errors
        )


def _pid(actor: Any) -> int:
    return os.getpid()


def _stall(actor: Any, stall_s: float, num_transfers: int) -> None:
    from pdserve.tools import stall

    actor.worker.loop.call(lambda: stall.install(actor.worker, stall_s, num_transfers)).result()


def _num_stalled(actor: Any) -> int:
    from pdserve.tools import stall

    return stall.num_held(actor.worker)


def _set_stream_idle(actor: Any, idle_s: float) -> float:
    """The decode worker aborts streams nobody polled for `idle_s`; returns the old value.
    Its stream reaper read the old value when it started, so it is started anew (on the
    actor's loop, which owns it)."""
    w = actor.worker
    before: float = w.cfg.stream_idle_timeout_s
    w.cfg = replace(w.cfg, stream_idle_timeout_s=idle_s)
    task = w._stream_reaper
    if task is not None:

        def restart() -> None:
            task.cancel()
            w._stream_reaper = task.get_loop().create_task(w._reap_unheard())

        task.get_loop().call_soon_threadsafe(restart)
    return before


def _kv_address(actor: Any) -> str:
    address: str = actor.worker.receiver.address
    return address


def _held_state(actor: Any) -> list[str]:
    """Per-request bookkeeping inside a worker (runs in the worker's process)."""
    w = actor.worker
    held = [f"{n}:{k}" for n in ("jobs", "streams", "reserved") for k in getattr(w, n, {})]
    held += [f"engine:{k}" for k in w.engine.requests]
    held += [f"lease:{k}" for k in getattr(getattr(w, "leases", None), "_held", {})]
    receiver = getattr(w, "receiver", None)
    if receiver is not None:
        with receiver.lock:
            held += [
                f"transfer:{r.request_id}:{r.state.value}" for r in receiver._by_transfer.values()
            ]
    return sorted(held)


class Rig:
    """A Deployment plus the router's gRPC server, run the way `pdserve serve` runs them,
    on an asyncio loop in a background thread of this process."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.deployment = Deployment(cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.router: Router | None = None
        self.server: RouterServer | None = None
        self.http: HTTPServer | None = None  # when router.http.enabled

    def start(self) -> Rig:
        self.router = self.deployment.start()
        self.thread.start()
        self.server = self.call(self._up())
        freeze_startup_heap()
        return self

    @property
    def target(self) -> str:
        assert self.server is not None, "start the rig first"
        return f"127.0.0.1:{self.server.port}"

    @property
    def http_port(self) -> int:
        assert self.http is not None, "the rig serves HTTP when router.http.enabled"
        return self.http.port

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coro` on the router's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _up(self) -> RouterServer:
        assert self.router is not None
        server = await start_server(self.router, "127.0.0.1", 0)
        await self.router.start()
        await server.set_serving(True)
        if self.cfg.router.http.enabled:
            self.http = await start_http_server(self.router, "127.0.0.1", self.cfg.router.http.port)
        return server

    async def _down(self) -> None:
        assert self.router is not None and self.server is not None
        await self.server.set_serving(False)
        await self.router.drain(1.0)
        if self.http is not None:
            await self.http.stop(2.0)
        await self.server.server.stop(grace=0.5)

    # ---- workers -------------------------------------------------------------------------
    def actors(self) -> dict[str, Any]:
        return dict(self.deployment.actors)

    def _get(self, refs: Any, timeout_s: float) -> Any:
        import ray

        return ray.get(refs, timeout=timeout_s)

    def pid(self, name: str, timeout_s: float = 30.0) -> int:
        """The worker's process id (waits while Ray restarts it)."""
        pid: int = self._get(self.actors()[name].__ray_call__.remote(_pid), timeout_s)
        return pid

    def kill9(self, name: str) -> int:
        """SIGKILL the worker's process, as the OOM killer would; returns the dead pid."""
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def requests_on(self, name: str) -> list[str]:
        """The router's requests on worker `name` right now: on a prefill worker, those in
        its prompt pass or transfer (no token sent yet); on a decode worker, those reserved
        on it, transferring into it or decoding there. Any thread may call it: the copy of
        the router's table is one step under the interpreter lock."""
        assert self.router is not None
        on = []
        for rid, act in list(self.router.active.items()):
            on_decode = act.decode is not None and act.decode.name == name
            prefilling = act.prefill is not None and act.prefill.name == name
            if on_decode or (prefilling and act.first_sent_s is None):
                on.append(rid)
        return on

    def routing_state(self) -> dict[str, str]:
        """Each worker as the router sees it now: why it takes no new request, or "routable"
        (for a row's figures: a fault that hit nothing says where the requests went)."""
        assert self.router is not None
        state = {}
        workers: list[WorkerLoad[Any]] = [*self.router.prefill.workers, *self.router.decode.workers]
        for w in workers:  # the terms of `WorkerLoad.routable`
            why = {"down": not w.healthy, "retiring": w.retiring, "draining": w.draining}
            why["misplaced"] = w.misplaced
            state[w.name] = ",".join(k for k, on in why.items() if on) or "routable"
        return state

    def stall_transfers(self, name: str, stall_s: float, num_transfers: int) -> None:
        """Prefill worker `name` holds back the KV of its next transfers for `stall_s`
        (`pdserve.tools.stall` wraps its transport)."""
        actor = self.actors()[name]
        self._get(actor.__ray_call__.remote(_stall, stall_s, num_transfers), 30.0)

    def num_stalled(self, name: str) -> int:
        """Transfers prefill worker `name` held back since `stall_transfers` last ran."""
        n: int = self._get(self.actors()[name].__ray_call__.remote(_num_stalled), 30.0)
        return n

    def set_stream_idle_timeout(self, idle_s: float) -> dict[str, float]:
        """Decode workers abort streams nobody polled for `idle_s` (a dead router's); returns
        each one's value before. A worker Ray restarts is back at the launched value."""
        decode = {n: a for n, a in self.actors().items() if "decode" in n}
        refs = {n: a.__ray_call__.remote(_set_stream_idle, idle_s) for n, a in decode.items()}
        return {n: self._get(r, 30.0) for n, r in refs.items()}

    def kv_addresses(self) -> dict[str, str]:
        """Each decode worker's KV endpoint (host:port), where prefill workers connect."""
        decode = {n: a for n, a in self.actors().items() if "decode" in n}
        return {n: self._get(a.__ray_call__.remote(_kv_address), 30.0) for n, a in decode.items()}

    def gcs_address(self) -> str:
        """The Ray cluster the rig runs on, for another driver to attach to."""
        import ray

        address: str = ray.get_runtime_context().gcs_address
        return address

    def used_blocks(self, timeout_s: float = 10.0) -> dict[str, int | None]:
        """Blocks each worker holds for requests (total - free; cached blocks count as free).

        Reads stats, which has no side effect (check_integrity runs lease expiry itself)."""
        out: dict[str, int | None] = {}
        for name, actor in self.actors().items():
            try:
                s = self._get(actor.stats.remote(), timeout_s)
                out[name] = s.num_total_blocks - s.num_free_blocks
            except Exception:
                out[name] = None
        return out

    def leftovers(self, timeout_s: float = 10.0) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, actor in self.actors().items():
            try:
                out[name] = self._get(actor.__ray_call__.remote(_held_state), timeout_s)
            except Exception as e:
                out[name] = [f"unreachable: {type(e).__name__}"]
        return out

    def integrity_errors(self, timeout_s: float = 10.0) -> dict[str, str]:
        errors: dict[str, str] = {}
        for name, actor in self.actors().items():
            try:
                self._get(actor.check_integrity.remote(), timeout_s)
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
        return errors

    def router_active(self) -> list[str]:
        """Requests the router tracks, and those its worker loads still count."""
        r = self.router
        assert r is not None
        loads = [
            f"{w.client.name}:{rid}"
            for w in r.prefill.workers + r.decode.workers
            for rid in w.active
        ]
        return list(r.active) + loads

    def quiesce(self, timeout_s: float, poll_s: float = 0.25) -> Quiescence:
        """Wait until no request is tracked, no block is used and no per-request state is
        held anywhere, or `timeout_s`; then run every worker's integrity check."""
        t0 = time.monotonic()
        while True:
            active, used, left = self.router_active(), self.used_blocks(), self.leftovers()
            clean = not active and all(v == 0 for v in used.values()) and not any(left.values())
            if clean or time.monotonic() - t0 > timeout_s:
                break
            time.sleep(poll_s)
        waited = time.monotonic() - t0
        return Quiescence(used, left, active, waited, self.integrity_errors())

    def close(self) -> None:
        try:
            if self.server is not None:
                self.call(self._down(), 30.0)
        finally:
            if self.thread.is_alive():
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(10)
            self.deployment.stop()
            gc.unfreeze()  # this process may go on (a test session): collect as before
