"""What both worker packages share: the engine on its thread, the transport, the index feed,
stats, the integrity check, and the Ray actor shell. The router never imports this module.

A worker is a plain class (tests build it without Ray); its actor (`ActorBase` subclass)
only delegates. Everything that touches engine or block state runs on the engine thread
through `self.loop`.
"""

from __future__ import annotations

import abc
import asyncio
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from engine.config import ceil_div, format_bytes
from engine.engine import LLMEngine
from engine.loop import EngineFailed, EngineLoop
from engine.request import RequestOutput
from engine.sampling import SamplingParams
from kv_transfer.transports.base import Transport, get_transport
from pool_api.config import WorkerConfig
from pool_api.index_feed import IndexFeed
from pool_api.logs import log_to_stderr
from pool_api.messages import (
    IndexUpdate,
    KernelTiming,
    NotServing,
    Role,
    StatKey,
    WorkerStats,
)
from protos.pdserve.v1 import WIRE_VERSION

# How long `stats` waits for fresh stats before answering with the last ones taken.
_FRESH_STATS_WAIT_S = 0.25
# Debug check that worker state is touched only by its owning thread (the module docstrings
# of the workers name each owner); the tests switch it on.
CHECK_OWNERS = os.environ.get("PDSERVE_CHECK_OWNERS", "") not in ("", "0")


class WrongThread(AssertionError):
    """Worker state was touched outside its owning thread (`PDSERVE_CHECK_OWNERS=1`)."""


def check_owner(on_owner: bool, owner: str) -> None:
    if CHECK_OWNERS and not on_owner:
        raise WrongThread(f"touched off its owner ({owner}) on {threading.current_thread().name}")


class EngineStalled(EngineFailed):
    """A worker's engine thread has been on one step or call past `stall_timeout_s`."""


def exit_soon(error: BaseException) -> None:
    """A dead engine must not keep a live actor: exit so Ray restarts it (`max_restarts`).

    The short delay lets the error replies already queued reach their callers.
    """
    threading.Timer(0.5, os._exit, args=(1,)).start()


def make_transport(cfg: WorkerConfig) -> Transport:
    """The worker's KV transport, with the cluster secret resolved in this process."""
    t = cfg.transfer
    transport = get_transport(t.transport, t.timeout_s, cfg.engine.device, t.resolve_secret())
    transport.configure(t)
    return transport


@dataclass(frozen=True)
class StartupSummary:
    """What a worker loaded and how big its KV cache came out; `ready` returns it so the
    driver prints it in its own words, one line a worker."""

    name: str
    role: str
    model: str
    device: str
    dtype: str
    matmul: str  # the projections' path and dtype (`LlamaModel.matmul_path`)
    num_params: int
    load_s: float
    block_size: int
    num_blocks: int
    kv_bytes: int
    max_model_len: int
    sized_by: str  # num_kv_blocks | kv_cache_memory | gpu_memory_utilization
    model_fingerprint: str = ""  # the checkpoint's (engine.fingerprint): KV never crosses two
    wire_version: int = WIRE_VERSION  # protos.pdserve.v1.WIRE_VERSION of this worker
    grammar_backend: str = ""  # engine.structured.backend_name(): pairs only with its equal
    kernels: str = ""  # the kernel selection: each op's choice and candidates' times

    @classmethod
    def of(
        cls, name: str, role: str, model: str, engine: LLMEngine, load_s: float
    ) -> StartupSummary:
        cache, spec = engine.cache_config, engine.cache.spec
        sized_by = "num_kv_blocks"
        if cache.kv_cache_memory is not None:
            sized_by = "kv_cache_memory"
        elif cache.gpu_memory_utilization is not None:
            sized_by = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
        return cls(
            name=name,
            role=role,
            model=model,
            device=str(engine.cache.data.device),
            dtype=spec.dtype,
            matmul=engine.runner.model.matmul_path,
            num_params=engine.model_config.num_params(),
            load_s=load_s,
            block_size=cache.block_size,
            num_blocks=engine.blocks.num_blocks,
            kv_bytes=spec.page_bytes * spec.num_layers * engine.blocks.num_blocks,
            max_model_len=engine.max_model_len,
            sized_by=sized_by,
            model_fingerprint=engine.fingerprint,
            grammar_backend=engine.grammars.name if engine.grammars is not None else "none",
            kernels=engine.kernel_selection.line(),
        )

    @property
    def max_concurrency(self) -> float:
        """Requests of `max_model_len` tokens the cache holds at once (vLLM's figure)."""
        return self.num_blocks / ceil_div(self.max_model_len, self.block_size)

    def line(self) -> str:
        tokens = self.num_blocks * self.block_size
        return (
            f"{self.name} ({self.role}): {self.model}, {self.dtype} on {self.device} "
            f"({self.matmul} matmuls), "
            f"{self.num_params / 1e6:.1f}M parameters, loaded in {self.load_s:.2f} s; "
            f"KV cache {self.num_blocks} blocks x {self.block_size} = {tokens} tokens, "
            f"{format_bytes(self.kv_bytes)} (by {self.sized_by}); Maximum concurrency for "
            f"{self.max_model_len} tokens per request: {self.max_concurrency:.2f}x"
            + (f"; {self.kernels}" if self.kernels else "")
        )


@dataclass(frozen=True)
class CompiledGrammar:
    """`WorkerBase.compile_grammar`'s answer: the xgrammar CompiledGrammar (None:
    unconstrained) and `GrammarBackend.fingerprint` of its spec."""

    grammar: Any
    fingerprint: str


class WorkerBase(abc.ABC):
    """The engine loop and the calls every worker answers the same way.

    A subclass sets up its own state, then calls `_start_loop` last: from then on the engine
    thread may call `_on_outputs` and `_on_fatal`.
    """

    default_role: ClassVar[Role]

    def __init__(
        self, cfg: WorkerConfig, engine: LLMEngine | None, previous: WorkerBase | None = None
    ) -> None:
        """`previous`: the drained worker of the other role whose engine loop, weights, KV
        cache and index feed this one takes over (a role flip: `hand_over`), instead of
        building its own."""
        self.cfg = cfg
        self.name = cfg.name
        self.role = cfg.role or self.default_role
        # `drain`: new requests are refused (`NotServing`) until this monotonic time
        self._drain_until = 0.0
        t0 = time.perf_counter()
        self.feed: IndexFeed | None = None
        self.loop: EngineLoop
        self.num_requests_total: int
        if previous is not None:
            self.loop, self.feed = previous.loop, previous.feed
            self.num_requests_total = previous.num_requests_total
        else:
            # Built on the engine thread, which from then on is the only one running torch
            # ops (engine.loop says why); the loop only steps once requests arrive.
            build = engine or (lambda: LLMEngine.from_config(cfg.engine))
            self.loop = EngineLoop(build, None, cfg.name)
            self.num_requests_total = 0
        self.engine = self.loop.engine
        if self.engine.grammars is not None:  # the first constrained request finds it warm
            # before ready, not beside the first requests: building the tokenizer info holds
            # the GIL for about a second, which a background thread takes from the engine's
            self.engine.grammars.warm()
        sel = self.engine.kernel_selection
        self._kernel_timings = tuple(
            KernelTiming(op, kernel, ms, kernel == t.chosen)
            for op, t in sel.timings.items()
            for kernel, ms in t.median_ms.items()
        )
        self.summary = StartupSummary.of(
            self.name, self.role.value, cfg.model_name, self.engine, time.perf_counter() - t0
        )
        self.transport = make_transport(cfg)
        self._last_stats: WorkerStats | None = None  # what `_stats` last returned
        self.fatal_hook: Callable[[BaseException], None] | None = None  # the actor exits

    def _start_loop(self) -> None:
        self.loop.on_outputs = self._on_outputs
        self.loop.on_fatal = self._on_fatal
        if self.feed is None:  # a flipped worker keeps its feed: same blocks, same epoch
            self.feed = IndexFeed(self.name, self.cfg.index, self.cfg.model_name, self.loop)

    # ---- drain and hand-over (pool membership: docs/operations.md) -----------------------
    async def drain(self, lease_s: float = math.inf) -> None:
        """Take no new request from any router (each is refused with `NotServing` and placed
        elsewhere) for `lease_s`; what this worker holds runs to its end. Stats report it.
        The router draining it renews the lease while it waits (`router.membership`): if
        that router dies mid-drain, the worker serves again once the lease runs out,
        instead of staying out of every pool with no one to finish the drain."""
        self._drain_until = max(self._drain_until, time.monotonic() + lease_s)

    def undrain(self) -> None:
        self._drain_until = 0.0

    @property
    def draining(self) -> bool:
        return time.monotonic() < self._drain_until

    def refuse_when_draining(self, request_id: str) -> None:
        if self.draining:
            raise NotServing(f"{self.name} is draining: {request_id} goes to another worker")

    async def hand_over(self) -> int:
        """End what is left here (aborted, its blocks freed: a drain whose bound ran out),
        then close this role's own parts (transport, threads), leaving the engine loop, the
        weights, the KV cache and the index feed for the worker of the other role that
        takes them over (`previous`). Returns how many requests it ended."""
        ended = await self.loop.run(self._end_all)
        self.loop.on_outputs = None
        self._close_role()
        return ended

    @abc.abstractmethod
    def _end_all(self) -> int:
        """Engine thread: abort every request here, free its blocks; how many there were."""

    @abc.abstractmethod
    def _close_role(self) -> None:
        """Close what this role alone owns (its transport's endpoint or sender, threads);
        the engine loop keeps running."""

    async def compile_grammar(self, params: SamplingParams) -> CompiledGrammar:
        """A constrained request's grammar, compiled off the engine thread and the actor's
        loop (the backend's cache makes a repeat cheap), with its fingerprint; an
        unconstrained request's is (None, "")."""
        so = params.structured
        grammars = self.engine.grammars
        if so is None or grammars is None:
            return CompiledGrammar(None, "")
        compiled = await asyncio.to_thread(grammars.compile, so)
        return CompiledGrammar(compiled, grammars.fingerprint(so))

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """End the request wherever it is on this worker and free its blocks."""

    @abc.abstractmethod
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: what the last step produced."""

    @abc.abstractmethod
    def _fail_all(self, error: BaseException) -> None:
        """Engine thread, after a fatal engine error: answer every request in flight."""

    @abc.abstractmethod
    def _num_reserved(self) -> int:
        """Engine thread: blocks held for transfers (leases, reservations)."""

    @abc.abstractmethod
    def _extra_stats(self) -> dict[str, float]:
        """Engine thread: role-specific counters for `WorkerStats.extra`."""

    def _on_fatal(self, error: BaseException) -> None:
        """The engine died: answer every waiting request, then let the actor be replaced."""
        self._fail_all(error)
        if self.fatal_hook is not None:
            self.fatal_hook(error)

    async def start_feed(self) -> None:
        """Start publishing block events (needs the caller's running event loop)."""
        assert self.feed is not None, "_start_loop made it"
        self.feed.start()

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        """Block events since the last call (the router's in-memory index pulls these)."""
        assert self.feed is not None, "_start_loop made it"
        return await self.feed.take(with_held)

    async def stats(self) -> WorkerStats:
        """Fresh from the engine thread when it answers within `_FRESH_STATS_WAIT_S` (between
        steps it does at once; a decode step is tens of ms). During a longer step (a prompt
        pass of seconds on a CPU), the last stats taken, so the router never mistakes a busy
        worker for a dead one (it would route around it and report the service unready). A
        step or call running past
        `cfg.stall_timeout_s` raises `EngineStalled`: that worker is stuck."""
        fresh = asyncio.wrap_future(self.loop.call(self._stats))
        fresh.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen, if late
        try:
            return await asyncio.wait_for(asyncio.shield(fresh), _FRESH_STATS_WAIT_S)
        except asyncio.TimeoutError:
            pass
        busy_s = self.loop.busy_s()
        if busy_s > self.cfg.stall_timeout_s:
            raise EngineStalled(
                f"{self.name}: its engine has been on one step or call for {busy_s:.0f} s "
                f"(stall_timeout_s={self.cfg.stall_timeout_s:g})"
            )
        return self._last_stats if self._last_stats is not None else await fresh

    def _stats(self) -> WorkerStats:
        """Engine thread: the stats now; kept for `stats` to answer with during a long step."""
        self._last_stats = WorkerStats.of(
            self.name,
            self.role,
            self.engine.stats(),
            self._num_reserved(),
            self.num_requests_total,
            {
                StatKey.ENGINE_STEPS_TOTAL.value: float(self.loop.num_steps),
                StatKey.ENGINE_STEP_SECONDS_TOTAL.value: self.loop.step_s_total,
                **self._extra_stats(),
            },
            self._kernel_timings,
            draining=self.draining,
            pid=os.getpid(),
        )
        return self._last_stats

    async def check_integrity(self) -> int:
        """Run the block manager's integrity check; returns the number of held blocks."""
        return await self.loop.run(self._check_integrity)

    def _check_integrity(self) -> int:
        self.engine.blocks.check_integrity()
        return self.engine.blocks.num_used_blocks

    def shutdown(self) -> None:
        if self.feed is not None:
            self.feed.cancel()
        self.loop.stop()
        self._close_role()


W = TypeVar("W", bound=WorkerBase)


def pin(name: str, cpus: tuple[int, ...]) -> None:
    """Pin this thread, and so every thread it starts later (the engine thread and its
    OpenMP team), to `cpus` (`pool.cpu_affinity`); () leaves it where the OS puts it.
    Ray's own threads, started before, stay unpinned: they mostly sleep."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        have = sorted(os.sched_getaffinity(0))
        raise RuntimeError(
            f"{name}: pool.cpu_affinity gives cores {list(cpus)}, this node has {have}: {e}"
        ) from e


class ActorBase(Generic[W]):
    """The Ray actor shell of a worker: methods only delegate."""

    def __init__(self, make_worker: Callable[[WorkerConfig], W], cfg: WorkerConfig) -> None:
        pin(cfg.name, cfg.cpus)
        torch.set_num_threads(cfg.num_threads)  # Ray starts actors with one thread
        log_to_stderr(cfg.log_level)  # Ray streams it to the driver (pool_api.logs)
        self.worker = make_worker(cfg)
        self.worker.fatal_hook = exit_soon

    async def ready(self) -> StartupSummary:
        await self.worker.start_feed()
        return self.worker.summary

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        return await self.worker.take_index_update(with_held)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await self.worker.stats()

    async def check_integrity(self) -> int:
        return await self.worker.check_integrity()

    async def drain(self, lease_s: float) -> None:
        """Refuse new requests from every router for `lease_s` (renewed by the draining
        router); what is here runs to its end."""
        await self.worker.drain(lease_s)

    async def shutdown(self) -> None:
        self.worker.shutdown()
