"""Mock workers: the worker API answered from a step-time model, for the router at scale.

Why: the router's control plane (refreshes, placement, the planner, the token sink) must hold
at 100-200 workers, and a 2-core machine runs two real workers at most. A mock worker does
what a real one tells the router, with no model behind it: a prompt pass sleeps the time the
profile's step model (`pdserve.plan.stepmodel`) predicts and returns a first token; a decode
worker steps its running requests together, each step as long as the model predicts for
that batch and those contexts, and pushes every step's tokens to the router's token sink
over the real wire (`pool_api.token_stream`). Ray calls, the stats the router reads, drains,
reservations, aborts and heartbeats behave as the real worker's do (`pool_api.api`). The KV
transfer is not modelled: a reservation's blocks count as landed when decoding starts (the
router never waits on a transfer itself: the prefill result is its acknowledgement).

Many mock workers share one Ray actor process (`MockHost`): 200 processes would not fit in
this machine's memory. The router still holds one handle per worker (`named_handle`), so its
calls, their Ray hops and its view of the pools are the same as with one actor each.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.request import FinishReason
from pdserve.plan.stepmodel import StepModel, StepShape
from pool_api.messages import (
    DecodeStart,
    FirstToken,
    IndexUpdate,
    NotServing,
    PrefillResult,
    PrefillTask,
    ReserveResult,
    Role,
    StatKey,
    TokenBatch,
    TokenSink,
    WorkerRequest,
    WorkerStats,
)
from pool_api.token_stream import SinkConnection, delta, frame
from protos.pdserve.v1 import kv_transfer_pb2

BLOCK_SIZE = 16
TOKEN_ID = 42  # every mock token (the router does not read them)


@dataclass
class _Running:
    """A request decoding on a mock decode worker."""

    request_id: str
    sink: TokenSink
    ctx: int  # tokens so far (prompt + generated)
    left: int  # tokens still to send
    blocks: int  # held until it ends (its prompt and every token it may generate)
    sent: int = 0


@dataclass
class MockWorker:
    """One worker's state and API (`pool_api.api.PrefillApi` / `DecodeApi`), in its host's
    event loop. `model` gives every step's seconds."""

    name: str
    role: Role
    model: StepModel
    num_blocks: int = 4096
    free: int = field(init=False)
    drain_until: float = 0.0
    reserved: dict[str, tuple[WorkerRequest, int]] = field(default_factory=dict)  # + blocks
    running: dict[str, _Running] = field(default_factory=dict)
    prompt_queue: int = 0  # prompt tokens waiting for or in a prompt pass
    requests_total: int = 0
    steps_total: int = 0
    step_seconds_total: float = 0.0
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    _prefill_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _loop_task: asyncio.Task[None] | None = None
    _sinks: dict[str, SinkConnection] = field(default_factory=dict)
    # per request, when each call reached this worker and when it answered (perf_counter,
    # one clock for every process on the host): what `router_overhead_s` subtracts
    marks: dict[str, dict[str, float]] = field(default_factory=dict)

    def _mark(self, request_id: str, what: str) -> None:
        self.marks.setdefault(request_id, {})[what] = time.perf_counter()

    def __post_init__(self) -> None:
        self.free = self.num_blocks

    # ---- every worker -----------------------------------------------------------------------
    async def stats(self) -> WorkerStats:
        return WorkerStats(
            name=self.name,
            role=self.role,
            num_free_blocks=self.free,
            num_total_blocks=self.num_blocks,
            num_running=len(self.running),
            num_waiting=0,
            num_reserved=len(self.reserved),
            queued_prefill_tokens=self.prompt_queue,
            num_requests_total=self.requests_total,
            num_preemptions_total=0,
            extra={
                StatKey.ENGINE_STEPS_TOTAL.value: float(self.steps_total),
                StatKey.ENGINE_STEP_SECONDS_TOTAL.value: self.step_seconds_total,
            },
            kv_bytes_per_block=1,
            draining=self.draining,
            pid=os.getpid(),
        )

    async def take_index_update(self, with_held: bool = False) -> IndexUpdate:
        return IndexUpdate(self.name, self.epoch, (), () if with_held else None)

    async def drain(self, lease_s: float) -> None:
        self.drain_until = time.monotonic() + lease_s

    @property
    def draining(self) -> bool:
        return time.monotonic() < self.drain_until

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise NotServing(f"{self.name} is draining")

    async def abort(self, request_id: str) -> bool:
        held = self.reserved.pop(request_id, None)
        if held is not None:
            self.free += held[1]
        run = self.running.get(request_id)
        if run is not None:
            self._send(run, (), FinishReason.ABORT)
            self._end(run)
        return held is not None or run is not None

    # ---- prefill ----------------------------------------------------------------------------
    async def prefill(self, task: PrefillTask) -> PrefillResult:
        self._refuse_when_draining()
        req = task.request
        self._mark(req.request_id, "prefill_in")
        n = len(req.prompt_token_ids)
        self.requests_total += 1
        self.prompt_queue += n
        arrived = time.perf_counter()
        try:
            async with self._prefill_lock:  # one prompt pass at a time, as one engine
                began = time.perf_counter()
                seconds = self._step(StepShape(chunks=((n, 0),)))
                await asyncio.sleep(seconds)
        finally:
            self.prompt_queue -= n
        done = req.params.max_tokens <= 1
        first = FirstToken(TOKEN_ID, "", None, FinishReason.LENGTH if done else None)
        self._mark(req.request_id, "prefill_out")
        return PrefillResult(
            req.request_id,
            (first,) * req.params.n,
            0,
            (began - arrived) * 1e3,
            seconds * 1e3,
            0.0,
        )

    # ---- decode -----------------------------------------------------------------------------
    async def reserve(self, request: WorkerRequest) -> ReserveResult:
        self._refuse_when_draining()
        blocks = _blocks(len(request.prompt_token_ids) + request.params.max_tokens)
        if blocks > self.free:
            return ReserveResult(None, self.free, "full")
        self.free -= blocks
        self.reserved[request.request_id] = (request, blocks)
        ticket = kv_transfer_pb2.TransferTicket(
            request_id=request.request_id,
            transfer_id=uuid.uuid4().hex,
            dst_block_ids=list(range(blocks)),
            deadline_unix_ms=int(time.time() * 1e3) + 30_000,
        )
        return ReserveResult(ticket.SerializeToString(), self.free)

    async def release_reservation(self, request_id: str, transfer_id: str) -> None:
        held = self.reserved.pop(request_id, None)
        if held is not None:
            self.free += held[1]

    async def start(self, start: DecodeStart) -> None:
        self._mark(start.request_id, "start_in")
        held = self.reserved.pop(start.request_id, None)
        if held is None:
            raise NotServing(f"{self.name}: no reservation for {start.request_id}")
        req, blocks = held
        self._run(req, start.sink, req.params.max_tokens - 1, blocks)

    async def submit(self, request: WorkerRequest, sink: TokenSink) -> None:
        """The colocated path: the prompt pass here, then decode."""
        self._refuse_when_draining()
        self._mark(request.request_id, "submit_in")
        blocks = _blocks(len(request.prompt_token_ids) + request.params.max_tokens)
        if blocks > self.free:
            raise NotServing(f"{self.name} is full")
        self.free -= blocks
        result = await self.prefill(PrefillTask(request, b""))
        self._run(request, sink, request.params.max_tokens - 1, blocks, result.first_token_ids)

    async def heartbeat(self, request_id: str) -> bool:
        return request_id in self.running or request_id in self.reserved

    def _run(
        self,
        req: WorkerRequest,
        sink: TokenSink,
        left: int,
        blocks: int,
        first: tuple[int, ...] = (),
    ) -> None:
        """Decode `left` more tokens of `req` (its `blocks` already taken from `free`)."""
        self.requests_total += 1
        run = _Running(req.request_id, sink, len(req.prompt_token_ids) + 1, left, blocks)
        self.running[req.request_id] = run
        if first:
            self._send(run, first, FinishReason.LENGTH if left <= 0 else None)
        if left <= 0:
            self._end(run)
            return
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._decode_loop())

    async def _decode_loop(self) -> None:
        """Continuous batching: every running request gets one token per step."""
        while self.running:
            shape = StepShape(decode=tuple(r.ctx for r in self.running.values()))
            await asyncio.sleep(self._step(shape))
            for run in list(self.running.values()):
                run.ctx += 1
                run.left -= 1
                last = run.left <= 0
                self._send(run, (TOKEN_ID,), FinishReason.LENGTH if last else None)
                if last:
                    self._end(run)

    def _end(self, run: _Running) -> None:
        if self.running.pop(run.request_id, None) is not None:
            self.free += run.blocks

    def _send(self, run: _Running, tokens: tuple[int, ...], reason: FinishReason | None) -> None:
        run.sent += len(tokens)
        batch = TokenBatch(
            run.request_id,
            tokens,
            "",
            finished=reason is not None,
            finish_reason=reason,
            num_output_tokens=run.sent + 1,
        )
        conn = self._sinks.get(run.sink.address)
        if conn is None or conn.closed:
            conn = SinkConnection(run.sink, self.name, self._lost)
            self._sinks[run.sink.address] = conn
        if reason is not None:
            self._mark(run.request_id, "last_out")
        conn.send(frame([delta(batch)]))

    def _lost(self, sink: TokenSink, why: str) -> None:
        self._sinks.pop(sink.address, None)

    def _step(self, shape: StepShape) -> float:
        seconds = max(0.0, self.model.predict(shape))
        self.steps_total += 1
        self.step_seconds_total += seconds
        return seconds


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_SIZE)


class MockHost:
    """Many mock workers in one process (a Ray actor: `ray.remote(MockHost)`); the router
    reaches one through `named_handle(host, name)`."""

    def __init__(self, model: dict[str, float]) -> None:
        self.model = StepModel.from_json(model)
        self.workers: dict[str, MockWorker] = {}

    async def add(self, name: str, role: str) -> int:
        self.workers[name] = MockWorker(name, Role(role), self.model)
        return os.getpid()

    async def flip(self, name: str, role: str) -> None:
        w = self.workers[name]
        if w.running or w.reserved or w.prompt_queue:
            raise NotServing(f"{name} still holds requests")
        w.role, w.drain_until = Role(role), 0.0

    async def remove(self, name: str) -> None:
        self.workers.pop(name, None)

    async def take_marks(self) -> dict[str, dict[str, float]]:
        """Every worker's per-request marks (`MockWorker.marks`), merged by request, and
        forgotten here."""
        out: dict[str, dict[str, float]] = {}
        for w in self.workers.values():
            for rid, m in w.marks.items():
                out.setdefault(rid, {}).update(m)
            w.marks.clear()
        return out

    async def call(self, name: str, method: str, *args: Any) -> Any:
        w = self.workers.get(name)
        if w is None:
            raise NotServing(f"{name} is not here")
        fn: Callable[..., Any] = getattr(w, method)
        return await fn(*args)


class _Method:
    def __init__(self, host: Any, name: str, method: str) -> None:
        self._host, self._name, self._method = host, name, method

    def remote(self, *args: Any) -> Any:
        return self._host.call.remote(self._name, self._method, *args)


class _Named:
    """What `router.clients.ray_api` needs of an actor handle: `handle.m.remote(*args)`."""

    def __init__(self, host: Any, name: str) -> None:
        self._host, self._name = host, name

    def __getattr__(self, method: str) -> _Method:
        return _Method(self._host, self._name, method)


async def take_marks(hosts: list[Any]) -> dict[str, dict[str, float]]:
    """The mock workers' per-request marks (`MockWorker.marks`), from every host, merged by
    request (a disaggregated request's marks lie on two workers, maybe two hosts)."""
    marks: dict[str, dict[str, float]] = {}
    for got in await asyncio.gather(*(h.take_marks.remote() for h in hosts)):
        for rid, m in got.items():
            marks.setdefault(rid, {}).update(m)
    return marks


def named_handle(host: Any, name: str) -> Any:
    """A Ray handle of `host` that calls its mock worker `name` (`MockHost.call`)."""
    return _Named(host, name)


class MockLauncher:
    """`router.membership.WorkerLauncher` over mock hosts, so the pool admin and the planner
    can add, flip and retire mock workers: a new worker joins the host with the fewest after
    `start_s` (a cold start's time, modelled), a flip switches its role in place."""

    def __init__(self, hosts: list[Any], placed: dict[str, Any], start_s: float = 0.0) -> None:
        self.hosts, self.placed, self.start_s = hosts, placed, start_s
        self._next = 0

    async def launch(self, role: Role) -> Any:
        self._next += 1
        name = f"mock-{role.value}-new{self._next}"
        load = {id(h): 0 for h in self.hosts}
        for h in self.placed.values():
            load[id(h)] += 1
        host = min(self.hosts, key=lambda h: load[id(h)])
        await asyncio.sleep(self.start_s)
        await host.add.remote(name, role.value)
        self.placed[name] = host
        return self.client(name, role)

    async def flip(self, name: str, to: Role) -> tuple[Any, float]:
        t0 = time.perf_counter()
        await self.placed[name].flip.remote(name, to.value)
        return self.client(name, to), time.perf_counter() - t0

    async def retire(self, name: str) -> None:
        host = self.placed.pop(name, None)
        if host is not None:
            await host.remove.remote(name)

    def client(self, name: str, role: Role) -> Any:
        from router.clients import DecodeClient, PrefillClient

        handle = named_handle(self.placed[name], name)
        if role is Role.PREFILL:
            return PrefillClient.of_actor(name, handle)
        return DecodeClient.of_actor(name, handle)


# ---- a router over mock workers, and a request through it (benchmarks, tests) --------------
async def mock_router(
    num_prefill: int, num_decode: int, hosts: list[Any], placed: dict[str, Any]
) -> Any:
    """A Router (not started) over new mock workers spread over `hosts`, built as
    `pdserve.launch.build_router` builds one; `placed` gets each worker's host."""
    from protos.pdserve.v1 import generation_pb2 as gen
    from router.clients import DecodeClient, PrefillClient
    from router.config import RouterConfig
    from router.core import Router
    from router.pools import Pool
    from router.validation import EdgeLimits, ModelLimits

    names = {Role.PREFILL: [f"mock-prefill-{i}" for i in range(num_prefill)],
             Role.DECODE: [f"mock-decode-{i}" for i in range(num_decode)]}  # fmt: skip
    adds = []
    for i, name in enumerate(names[Role.PREFILL] + names[Role.DECODE]):
        host = hosts[i % len(hosts)]
        placed[name] = host
        adds.append(host.add.remote(name, "prefill" if "prefill" in name else "decode"))
    await asyncio.gather(*adds)
    prefill = Pool(
        Role.PREFILL,
        [PrefillClient.of_actor(w, named_handle(placed[w], w)) for w in names[Role.PREFILL]],
    )
    decode = Pool(
        Role.DECODE,
        [DecodeClient.of_actor(w, named_handle(placed[w], w)) for w in names[Role.DECODE]],
    )
    info = gen.ModelInfo(served_model_name="mock", max_context_length=4096, block_size=16)
    cfg = RouterConfig()
    # the edge limits fixed once, not per request
    limits = ModelLimits("mock", 49152, 4096, 16, 4096, edge=EdgeLimits.of(cfg, 4096))
    return Router(cfg, limits, None, info, prefill, decode, "local")


def start_hosts(count: int, model: dict[str, float]) -> list[Any]:
    """`count` mock hosts answering from `model` (seconds per step-model term), on the Ray
    cluster this process has (a local node started if none)."""
    import ray

    from pdserve.launch import init_ray

    if not ray.is_initialized():
        init_ray(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    host_cls: Any = ray.remote(MockHost)
    return [
        host_cls.options(num_cpus=0, max_concurrency=10_000).remote(model) for _ in range(count)
    ]


@dataclass(frozen=True)
class Driven:
    """One request through the router, as a client saw it (perf_counter times)."""

    outcome: str  # "ok", "short (N tokens)", or what it raised
    request_id: str  # "" if it was not admitted
    sent: float
    first: float | None  # its first token
    end: float
    tokens: int


async def drive(router: Any, req: Any, max_tokens: int) -> Driven:
    """`req` through a started Router, as its gRPC face drives one; never raises."""
    sent, first, tokens, rid = time.perf_counter(), None, 0, ""
    try:
        act = await router.admit(req)
        rid = act.request_id
        try:
            async for resp in router.run(act):
                if first is None and resp.chunk.token_ids:
                    first = time.perf_counter()
                tokens += len(resp.chunk.token_ids)
        finally:
            router.finish(act, True)
        outcome = "ok" if tokens == max_tokens else f"short ({tokens} tokens)"
    except Exception as e:  # an outcome to count, not a crash of the benchmark
        outcome = f"{type(e).__name__}: {e}"[:80]
    return Driven(outcome, rid, sent, first, time.perf_counter(), tokens)


def router_overhead_s(d: Driven, marks: dict[str, float]) -> float | None:
    """The part of a request's latency its workers did not spend: from the client's send to
    the call that reached its first worker (admission, the index lookup, placement, the
    reservation's round trip, the Ray hop), from the prompt pass's answer to the decode
    worker's start (disaggregated), and from its last token leaving the worker to the client
    holding it (the token sink, the relay). None: a mark is missing (it failed, or a
    worker's marks were not taken)."""
    m = marks
    if "start_in" in m and {"prefill_in", "prefill_out", "last_out"} <= m.keys():
        return (
            (m["prefill_in"] - d.sent)
            + (m["start_in"] - m["prefill_out"])
            + (d.end - m["last_out"])
        )
    if {"submit_in", "last_out"} <= m.keys():
        return (m["submit_in"] - d.sent) + (d.end - m["last_out"])
    return None
