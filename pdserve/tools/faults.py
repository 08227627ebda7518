"""A deployment in this process with its faults at hand, for `pdserve chaos` and the tests.

`Rig` stands up what `pdserve serve` runs (the two pools as Ray actors, the router's gRPC
server on an event loop thread of its own) and adds what a fault harness needs: each worker's
process id, `kill -9` of a worker process, a stalled KV transfer (a wrapper around the
prefill worker's transport, `pdserve.tools.stall`), and the quiescence checks: blocks still
used on each worker and per-request state still held anywhere. `RedisProcess` is a
redis-server child for the prefix index that can be killed like a crashed server and started
again on the same port.

Nothing here changes how pdserve behaves; it reads worker state and injects faults from
outside the production classes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pdserve.config import ServeConfig
from pdserve.launch import Deployment
from pdserve.serve import freeze_startup_heap
from router.core import Router
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

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coro` on the router's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _up(self) -> RouterServer:
        assert self.router is not None
        server = await start_server(self.router, "127.0.0.1", 0)
        await self.router.start()
        await server.set_serving(True)
        return server

    async def _down(self) -> None:
        assert self.router is not None and self.server is not None
        await self.server.set_serving(False)
        await self.router.drain(1.0)
        await self.server.server.stop(grace=0.5)

    # ---- workers -------------------------------------------------------------------------
    def actors(self) -> dict[str, Any]:
        d = self.deployment
        named = {f"pdserve-prefill-{i}": a for i, a in enumerate(d.prefill_actors)}
        named.update({f"pdserve-decode-{i}": a for i, a in enumerate(d.decode_actors)})
        return named

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

    def stall_transfers(self, name: str, stall_s: float, num_transfers: int) -> None:
        """Prefill worker `name` holds back the KV of its next transfers for `stall_s`
        (`pdserve.tools.stall` wraps its transport)."""
        actor = self.actors()[name]
        self._get(actor.__ray_call__.remote(_stall, stall_s, num_transfers), 30.0)

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
