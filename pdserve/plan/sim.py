"""A discrete-event simulator of pdserve, driven by a profile.

It runs pdserve's own scheduling and placement code on simulated time:
- each worker is the engine's `Scheduler` over its own `BlockManager` (chunked prompts,
  mixed steps, the step budget, admission, preemption, the prefix cache with its real
  chained block hashes); a step takes the time the profile's step-time model gives for the
  batch that `Scheduler.schedule` chose;
- the router places each request with `router.pools`: `Pool.best_match` and
  `Pool.decode_order` colocated; `rank_pairs` (prefill time against transfer time, KV room
  first) disaggregated; the prefix index's answer is each worker's own `match_prefix`;
- a disaggregated request reserves its blocks on the decode worker before its prompt pass
  (a full pool makes it wait, first come first served, up to the router's queue timeout);
- the KV transfer takes `α + bytes/β` (the profile's transport), overlapping the prompt
  pass: it ends at `max(pass end + α, pass start + α + bytes/β)`;
- the fixed costs (`Overheads`) add the router's time before placement, the hop to a
  worker, and the streaming delay of each token.

What it leaves out, on purpose (docs/plan.md): the router's stats are exact at every
decision (the real router refreshes them every `router.stats_interval_s`); no failures or
aborts; a worker's steps take exactly the model's time (no noise); structured output, n>1
and prompt logprobs are not modelled.

What must hold: the simulator calls `Scheduler.schedule`, `BlockManager` and the placement
functions exactly as the engine and the router do, so a change to either policy changes
the prediction without a change here.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.config import SchedulerConfig
from engine.prefix_hash import namespace_seed
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from pdserve.plan.stepmodel import StepCost, StepShape
from pdserve.plan.workload import WorkloadRequest, token_ids
from pool_api.messages import Role, StatKey, WorkerStats
from router.pools import Pool, WorkerLoad, rank_pairs

_SEED = namespace_seed("pdserve-plan", "")


@dataclass(frozen=True)
class Overheads:
    """Fixed costs outside the engine's steps, in seconds."""

    router_s: float = 0.0  # validation, tokenizing, hashing, the index lookup
    hop_s: float = 0.0  # router -> worker (a Ray call)
    stream_s: float = 0.0  # a token from the worker's step to the client
    step_s: float = 0.0  # a served worker's own work per step (its loop, its stats)
    row_s: float = 0.0  # per token a step emits (streaming it out: CPU the step shares)
    # served step time over the profile's for the same batch: the host's speed while it
    # serves (its drift since the profile, the cores it shares with the router and Ray) ...
    step_scale: float = 1.0
    # ... plus this much per output token per second the workload offers: on a host whose
    # router, Ray and clients run on the workers' cores, the CPU they take grows with the
    # token rate, and the steps slow down with it
    scale_per_token_s: float = 0.0

    @classmethod
    def from_json(cls, d: dict[str, float] | None) -> Overheads:
        given = {k: float(v) for k, v in (d or {}).items() if k in {f.name for f in fields(cls)}}
        return cls(**given)


@dataclass(frozen=True)
class Transfer:
    """A KV transfer of `bytes` takes `alpha_s + bytes / beta_bytes_per_s`."""

    alpha_s: float = 0.0
    beta_bytes_per_s: float = float("inf")

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s


@dataclass(frozen=True)
class PoolShape:
    """A deployment to simulate: `colocated` workers, or `prefill` and `decode` pools; each
    worker's thread count, and the engines' step budget."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    threads: int = 1  # colocated workers'
    prefill_threads: int = 1
    decode_threads: int = 1
    budget: int = 2048  # scheduler.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("worker counts: not negative")
        if bool(self.colocated) == bool(self.prefill or self.decode):
            raise ValueError("a pool shape is colocated workers, or prefill and decode pools")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("a split needs at least one prefill and one decode worker")

    @property
    def cores(self) -> int:
        if self.colocated:
            return self.colocated * self.threads
        return self.prefill * self.prefill_threads + self.decode * self.decode_threads

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated {self.colocated}x{self.threads}t b{self.budget}"
        return (
            f"{self.prefill}P{self.prefill_threads}t:{self.decode}D{self.decode_threads}t "
            f"b{self.budget}"
        )


@dataclass
class Outcome:
    """One request's times (simulated seconds), None where it never got there."""

    arrival_s: float
    output_tokens: int
    first_token_s: float | None = None
    last_token_s: float | None = None
    placement: str = ""
    failed: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.last_token_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.last_token_s - self.first_token_s) / (self.output_tokens - 1)

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        t, p = self.ttft_s, self.tpot_s
        return not self.failed and t is not None and p is not None and t <= ttft_s and p <= tpot_s


@dataclass
class _Client:
    """What `router.pools` reads of a worker's client: its name and role."""

    name: str
    role: Role


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    @property
    def pending(self) -> bool:
        """Events are still to happen."""
        return bool(self._events)

    def run(self) -> None:
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()


@dataclass
class _Live:
    """A request in flight: its outcome, and on which worker it is now."""

    index: int
    request: Request
    outcome: Outcome
    prefill_start_s: float = 0.0  # when the step that ended its prompt pass began
    decode: SimWorker | None = None  # disaggregated: the worker holding its reservation
    shared_blocks: int = 0  # of its reservation there, already cached (they do not move)


class SimWorker:
    """One engine: `Scheduler` + `BlockManager`, stepping in simulated time."""

    def __init__(
        self,
        name: str,
        role: Role,
        model: StepCost,
        num_blocks: int,
        block_size: int,
        kv_bytes_per_block: int,
        sched: SchedulerConfig,
        sim: Simulator,
    ) -> None:
        self.name, self.role, self.model, self.sim = name, role, model, sim
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(sched, self.blocks)
        self.kv_bytes_per_block = kv_bytes_per_block
        self.load: WorkerLoad[Any] = WorkerLoad(_Client(name, role))
        self.live: dict[str, _Live] = {}
        self.busy = False
        self.steps_total = 0  # its engine's step counters, as a worker reports them
        self.step_seconds_total = 0.0
        self.max_len = sched.max_model_len or 1 << 30
        self.refresh()

    def refresh(self) -> None:
        """The router's view of this worker (exact: see the module docstring)."""
        s = self.scheduler
        self.load.stats = WorkerStats(
            self.name, self.role, self.blocks.num_free_blocks, self.blocks.num_blocks,
            len(s.running), len(s.waiting), 0,
            sum(r.prefill_end - r.num_computed_tokens for r in s.waiting), 0,
            s.num_preemptions, kv_bytes_per_block=self.kv_bytes_per_block,
            extra={StatKey.ENGINE_STEPS_TOTAL.value: float(self.steps_total),
                   StatKey.ENGINE_STEP_SECONDS_TOTAL.value: self.step_seconds_total},
        )  # fmt: skip
        self.load.pending_blocks = 0

    def add(self, live: _Live) -> None:
        self.live[live.request.request_id] = live
        self.scheduler.add(live.request)
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        out = self.scheduler.schedule()
        if out.is_empty:
            return
        self.busy = True
        shape = StepShape(*out.batch_shape())
        start = self.sim.clock.now
        for c in out.prefill:
            if c.completes_prompt:
                self.live[c.request.request_id].prefill_start_s = start
        over = self.sim.cfg.overheads
        rows = len(out.decode) + sum(c.completes_prompt for c in out.prefill)
        dt = max(self.model.predict(shape), 1e-6) * self.sim.scale + over.step_s + over.row_s * rows
        self.steps_total += 1
        self.step_seconds_total += dt
        self.sim.clock.at(start + dt, lambda: self._step_done(out))

    def _step_done(self, out: SchedulerOutput) -> None:
        """What `LLMEngine._postprocess` does, less the logits: the same state changes."""
        now = self.sim.clock.now
        for c in out.prefill:
            c.request.num_computed_tokens = c.end
            if c.completes_prefill and not c.completes_prompt:
                self.scheduler.join(c.request)
        for r in out.decode:
            r.num_computed_tokens += 1
        for r in [c.request for c in out.prefill] + list(out.decode):
            self.blocks.commit(r.request_id, r.computed_hashes())
        sampled = [c.request for c in out.prefill if c.completes_prompt]
        sampled += [r for r in out.decode if not r.replaying]
        for req in sampled:
            req.append_token(5, None)
            live = self.live[req.request_id]
            reason = req.check_stop(self.max_len)
            self.sim.token(live, now)
            if req.prefill_only:
                self.scheduler.remove(req)
                req.finish(reason)
                del self.live[req.request_id]
                self.sim.prefilled(live, self, now)
            elif reason is not None:
                self.scheduler.remove(req)
                req.finish(reason)
                self.blocks.free(req.request_id)
                del self.live[req.request_id]
                self.sim.finished(live, self)
            elif req.status is RequestStatus.WAITING:
                self.scheduler.join(req)
        self.busy = False
        self.refresh()
        self.kick()


@dataclass
class SimConfig:
    shape: PoolShape
    prefill_model: StepCost
    decode_model: StepCost
    block_size: int
    kv_bytes_per_block: int
    pool_blocks: int
    transfer: Transfer = field(default_factory=Transfer)
    overheads: Overheads = field(default_factory=Overheads)
    max_num_seqs: int = 64
    queue_timeout_s: float = 30.0
    max_model_len: int = 8192
    # the router's pair-ranking speeds (`router.policy`): only their ratio matters
    prefill_tokens_per_s: float = 4000.0
    transfer_gbps: float = 1.0
    vocab_size: int = 49152


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.clock = _Clock()
        self.scale = cfg.overheads.step_scale  # set per run (`run`)
        self.sched = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.shape.budget,
            max_model_len=cfg.max_model_len,
        )
        s = cfg.shape
        if s.colocated:
            self.decode = [
                self.new_worker(Role.DECODE, f"colocated-{i}") for i in range(s.colocated)
            ]
            self.prefill: list[SimWorker] = []
        else:
            self.prefill = [self.new_worker(Role.PREFILL, f"prefill-{i}") for i in range(s.prefill)]
            self.decode = [self.new_worker(Role.DECODE, f"decode-{i}") for i in range(s.decode)]
        self.prefill_pool: Pool[Any] = Pool(Role.PREFILL, [])
        self.prefill_pool.workers = [w.load for w in self.prefill]
        self.decode_pool: Pool[Any] = Pool(Role.DECODE, [])
        self.decode_pool.workers = [w.load for w in self.decode]
        self.by_load = {id(w.load): w for w in self.prefill + self.decode}
        self.waiting: deque[tuple[_Live, float]] = deque()  # for KV room, with their deadline
        self.outcomes: list[Outcome] = []

    def new_worker(self, role: Role, name: str) -> SimWorker:
        """An empty worker of `role` (a colocated one prefills with the prefill model)."""
        cfg = self.cfg
        model = cfg.decode_model if role is Role.DECODE and not cfg.shape.colocated else None
        return SimWorker(
            name, role, model or cfg.prefill_model, cfg.pool_blocks, cfg.block_size,
            cfg.kv_bytes_per_block, self.sched, self,
        )  # fmt: skip

    # ---- the router ------------------------------------------------------------------------
    def _matches(self, hashes: Sequence[int]) -> dict[str, int]:
        return {
            w.name: n for w in self.prefill + self.decode if (n := w.blocks.match_prefix(hashes))
        }

    def _arrive(self, live: _Live) -> None:
        self._place(live, self.clock.now + self.cfg.queue_timeout_s)

    def _place(self, live: _Live, deadline: float) -> None:
        req = live.request
        usable = req.block_hashes[: (len(req.prompt_token_ids) - 1) // self.cfg.block_size]
        matches = self._matches(usable)
        hop = self.cfg.overheads.hop_s
        if self.cfg.shape.colocated:
            best = self.decode_pool.best_match(matches)
            load = best or self.decode_pool.decode_order()[0]
            live.outcome.placement = "colocated"
            worker = self.by_load[id(load)]
            self.clock.at(self.clock.now + hop, partial(worker.add, live))
            return
        pairs = rank_pairs(
            self.prefill_pool.routable(), self.decode_pool.routable(), matches,
            len(req.prompt_token_ids), self.cfg.block_size, self.cfg.prefill_tokens_per_s,
            self.cfg.transfer_gbps * 1e9,
        )  # fmt: skip
        for pair in pairs:
            if not pair.has_room:
                break
            d = self.by_load[id(pair.decode)]
            try:
                alloc = d.blocks.allocate(req.request_id, usable, len(req.prompt_token_ids))
            except NoFreeBlocksError:
                continue
            live.shared_blocks = alloc.num_cached_tokens // self.cfg.block_size
            d.refresh()
            p = self.by_load[id(pair.prefill)]
            live.outcome.placement = "disaggregated"
            live.decode = d
            pair.prefill.outstanding_tokens += len(req.prompt_token_ids)
            self.clock.at(self.clock.now + hop, partial(p.add, live))
            return
        self.waiting.append((live, deadline))

    def _retry_waiting(self) -> None:
        """KV room freed: the waiting line, in order, until one does not fit."""
        while self.waiting:
            live, deadline = self.waiting[0]
            if self.clock.now > deadline:
                self.waiting.popleft()
                live.outcome.failed = "queue timeout"
                self.timed_out(live)
                continue
            before = len(self.waiting)
            self.waiting.popleft()
            self._place(live, deadline)
            if len(self.waiting) >= before:  # it went back to the end: keep FIFO order
                self.waiting.rotate(1)
                return

    # ---- callbacks from the workers --------------------------------------------------------
    def token(self, live: _Live, now: float) -> None:
        at = now + self.cfg.overheads.stream_s
        if live.outcome.first_token_s is None:
            live.outcome.first_token_s = at
        live.outcome.last_token_s = at

    def prefilled(self, live: _Live, worker: SimWorker, now: float) -> None:
        """A prompt pass ended on a prefill worker: ship its KV, then decode."""
        req = live.request
        n = len(req.prompt_token_ids)
        worker.load.outstanding_tokens -= n
        d = live.decode
        assert d is not None, "a prefilled request has a decode reservation"
        moved = -(-n // self.cfg.block_size) - live.shared_blocks
        nbytes = moved * self.cfg.kv_bytes_per_block
        t = self.cfg.transfer
        done = max(now + t.alpha_s, live.prefill_start_s + t.seconds(nbytes))

        def landed() -> None:
            worker.blocks.free(req.request_id)  # the sender lets go once acknowledged
            worker.refresh()
            decoded = _decode_copy(req)
            d.blocks.commit(decoded.request_id, decoded.computed_hashes())
            d.live[decoded.request_id] = live
            live.request = decoded
            if decoded.check_stop(d.max_len) is not None:
                d.blocks.free(decoded.request_id)
                del d.live[decoded.request_id]
                self.finished(live, d)
                return
            d.scheduler.add_running(decoded)
            d.kick()

        self.clock.at(done, landed)
        worker.kick()

    def finished(self, live: _Live, worker: SimWorker) -> None:
        worker.refresh()
        self._retry_waiting()

    def timed_out(self, live: _Live) -> None:
        """A request waited for KV room past the router's queue timeout (a subclass hook)."""

    # ---- a run -----------------------------------------------------------------------------
    def run(self, requests: Sequence[WorkloadRequest], seed: int = 0) -> list[Outcome]:
        over = self.cfg.overheads
        self.scale = over.step_scale + over.scale_per_token_s * offered_token_rate(requests)
        prompts = token_ids(requests, self.cfg.vocab_size, seed)
        split = not self.cfg.shape.colocated
        lives = []
        for i, (r, ids) in enumerate(zip(requests, prompts, strict=True)):
            params = SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
            req = Request(
                f"r{i}", ids, params, _SEED, self.cfg.block_size, prefill_only=split, replays=True
            )
            live = _Live(i, req, Outcome(r.arrival_s, r.output_tokens))
            lives.append(live)
            t = r.arrival_s + self.cfg.overheads.router_s
            self.clock.at(t, partial(self._arrive, live))
        self.clock.run()
        for waiting, _ in self.waiting:
            waiting.outcome.failed = "queue timeout"
        return [live.outcome for live in lives]


def _decode_copy(req: Request) -> Request:
    """The decode worker's request for a prompt prefilled elsewhere (`add_prefilled`): its
    prompt computed, the first token appended."""
    decoded = Request(
        req.request_id, req.prompt_token_ids, req.params, req.hash_seed, req.block_size,
        replays=True,
    )  # fmt: skip
    decoded.num_computed_tokens = len(req.prompt_token_ids)
    decoded.append_token(req.output_token_ids[0], None)
    decoded.status = RequestStatus.RUNNING
    return decoded


def offered_token_rate(requests: Sequence[WorkloadRequest]) -> float:
    """Output tokens per second the workload asks for over its arrivals (0: one instant)."""
    if len(requests) < 2:
        return 0.0
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return sum(r.output_tokens for r in requests) / span if span > 0 else 0.0


def simulate(cfg: SimConfig, requests: Sequence[WorkloadRequest], seed: int = 0) -> list[Outcome]:
    return Simulator(cfg).run(requests, seed)
