"""`pdserve chaos` (`make chaos`): load while one fault at a time is injected, and what became
of every request.

It stands up a deployment in this process (`pdserve.tools.faults.Rig`: 2 prefill + 2 decode
workers as Ray actors with `max_restarts`, a redis-server child holding the prefix index, the
router's gRPC and HTTP servers) and runs the scenarios in sequence, each a load plus one fault:

- cancel: 200 streams, each cut short (client cancel or `Abort`) at a point planned in one
  of four stages (before prefill, prefill, transfer, decode) from a calibration run's timings;
- kill-prefill / kill-decode: 100 requests; kill -9 of the process of the prefill / decode
  worker the router has the most requests on, once 25 of them ended; kill-decode-n4 the
  same with n = 4 seeded choices per request (each forked on its decode worker);
- freeze-decode / freeze-prefill: 100 requests spread over the freeze; SIGSTOP of the worker
  the router has the most requests on for 40 s (`--freeze-s`), then SIGCONT: its requests
  end within 10 s, none as an abort, and the rest of the service serves meanwhile;
- redis: 100 requests sharing prefixes; kill -9 of redis-server once 15 ended, a fresh one
  after the load;
- stall: 24 requests; 4 transfers of each prefill worker held back past the KV lease;
- overload: capacity from a closed loop, then Poisson arrivals at 0.8x (the baseline TTFT)
  and 2x capacity for 30 s, the router's admission bound sized from the 0.8x TTFT;
- kill-router: a second router (`pdserve serve` in a child process, on the same pools) under
  41 requests (the last 16 long); kill -9 of its process once 25 ended and a decode worker
  holds one of the long streams: the workers must free all it held
  (leases, the idle-stream bound) and the rig's own router serve on;
- drain-overrun: a second router (HTTP and gRPC, `router.drain_grace_s` 2 s) on the same
  pools, SIGTERM while 20 long streams (half SSE, half gRPC) are in flight: each must end with
  an error its client is told (SSE error event then `[DONE]`; UNAVAILABLE "server shutting
  down"), none cut off; the router exits 0 with no traceback, its request log and
  `pdserve:request_failure_total` count them;
- router-restart-mismatch: a second router asking for another model (`small`) started against
  the rig's detached workers: it must fail its start in one line naming both models, without
  serving, and leave the workers and the rig's router as they were;
- abusive-client: a normal load alone, then again while one client sends 10 MB prompts,
  stop-string floods, a slowloris and idle KV connections: its median latency within 2x.

Per scenario, one row: requests sent; succeeded; ended with a status (by code: a gRPC code
name, or ABORTED for a stream that completed with finish reason abort); hung (no end within
`--hang-bound-s`); lost (the stream closed with neither a result nor a status); blocks still
used on each worker once the load is over and the lease has passed (stranded); time to
recover (after a kill: until a probe is served by the restarted worker; redis: until every
worker re-registered in the fresh Redis; otherwise until a probe is served again). Each
scenario also checks the acceptance figures of docs/reliability.md and says which failed,
among them that its fault hit what it names ("the fault hit: ..."): a row whose fault missed
(a kill with nothing on the worker, a stall that held no transfer) fails instead of passing
on a load that never met the fault.

Results: `chaos.json` (every request's outcome) and `chaos.png` (a timeline per scenario)
under `--out`. Request timings are client-side (perf_counter), in seconds since the
scenario's load started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from queue import Empty
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from tqdm import tqdm

from kv_transfer.registry import SERVE_TRANSPORT_NAMES
from pdserve.client import make_request
from pool_api import logs
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc

if TYPE_CHECKING:  # torch, Ray and the router load only when a run starts
    from pdserve.config import ServeConfig
    from pdserve.tools.faults import Quiescence, RedisProcess, Rig

FIRST_TOKEN_ID = 4  # ids below are special tokens in pdserve's checkpoints
STAGES = ("before prefill", "prefill", "transfer", "decode")
# Where the router has a request in each stage (prefill and transfer are one call there).
ROUTER_STAGE = {
    "before prefill": "before prefill",
    "prefill": "prefill or transfer",
    "transfer": "prefill or transfer",
    "decode": "decode",
}
FAULT_HIT = "the fault hit"  # the prefix of each scenario's check that its fault ran
OK, ABORTED, HUNG, LOST = "OK", "ABORTED", "HUNG", "LOST"


@dataclass(frozen=True)
class ChaosConfig:
    """Sizes and bounds of one run (the acceptance figures are in docs/reliability.md)."""

    preset: str = "tiny"
    out_dir: Path = Path("build/chaos")
    scenarios: tuple[str, ...] = (
        "cancel",
        "kill-prefill",
        "kill-decode",
        "kill-decode-n4",
        "freeze-decode",
        "freeze-prefill",
        "redis",
        "stall",
        "overload",
        "kill-router",
        "drain-overrun",
        "router-restart-mismatch",
        "abusive-client",
        "pool-drain",
        "pool-flip",
        "pool-kill-flip",
        "pool-router-killed",
    )
    seed: int = 0
    transport: str = "torch_dist"
    num_prefill: int = 2  # prefill workers (1: freeze-prefill freezes the only one)
    prompt_len: int = 256  # tokens per request (random ids)
    output_len: int = 32  # tokens generated per request (EOS ignored)
    num_cancel: int = 200
    cancel_concurrency: int = 32
    num_kill: int = 100  # requests per kill scenario and the redis scenario
    kill_concurrency: int = 16
    kill_after: int = 25  # the fault comes once this many requests ended
    freeze_s: float = 40.0  # freeze-*: how long the worker stays SIGSTOPped
    freeze_bound_s: float = 10.0  # freeze-*: its requests end within this of the freeze
    aim_timeout_s: float = 5.0  # after that, a kill waits this long for a request on its worker
    num_stall: int = 24
    num_stalled: int = 4  # transfers held back on each worker of `stall_workers`
    # every prefill worker: the fault hits whichever one the router picks
    stall_workers: tuple[str, ...] = ("pdserve-prefill-0", "pdserve-prefill-1")
    stall_past_lease_s: float = 10.0  # held this long past the lease
    overload_s: float = 30.0
    capacity_concurrency: int = 48  # closed loop that measures capacity
    baseline_s: float = 20.0  # the 0.8x phase
    lease_s: float = 5.0  # transfer.lease_s (30 s in service): short, so quiescence is quick
    # kill-router: decode workers drop streams nobody polled this long (pdserve.launch sets
    # max(30 s, 10 x router.heartbeat_s); the rig lowers it for the scenario)
    stream_idle_s: float = 3.0
    # kill-router: tokens of the requests sent after the first `kill_after`, so that a stream
    # seen held on a decode worker cannot end in the moment before the kill lands
    kill_router_output_len: int = 512
    num_drain: int = 20  # drain-overrun: streams in flight at the SIGTERM (half SSE, half gRPC)
    drain_grace_s: float = 2.0  # drain-overrun: the second router's router.drain_grace_s
    drain_output_len: int = 2000  # drain-overrun: tokens per stream, to outlast the grace
    drain_bound_s: float = 10.0  # drain-overrun: SIGTERM until every stream and the process end
    mismatch_model: str = "small"  # router-restart-mismatch: the model the new router asks for
    mismatch_bound_s: float = 60.0  # router-restart-mismatch: it must have failed by then
    num_abuse: int = 48  # abusive-client: the normal load, alone and under abuse
    abuse_concurrency: int = 4
    abuse_ratio_bound: float = 2.0  # its p50 latency under abuse / alone
    abuse_windows: int = 3  # windows under abuse, each between two alone
    num_slowloris: int = 256  # half-sent HTTP request heads held open
    kv_pokes: int = 8  # idle (or junk) connections held on each decode worker's KV endpoint
    hang_bound_s: float = 60.0  # a request with no end by then is hung
    cut_bound_s: float = 2.0  # a cancelled or aborted stream must end within this
    fault_bound_s: float = 10.0  # requests in flight at a kill must end within this
    recover_bound_s: float = 30.0
    rejection_bound_ms: float = 50.0
    ttft_ratio_bound: float = 1.5
    progress: bool = True

    def serve_config(self, redis_url: str | None) -> ServeConfig:
        from pdserve.config import ServeConfig

        index: dict[str, Any] = {"refresh_interval_s": 1.0, "timeout_s": 0.1}
        if redis_url:
            index["redis_url"] = redis_url
        return ServeConfig.load(
            None,
            {
                "model": {"model": self.preset},
                "router": {"grpc": {"port": 0}, "http": {"port": 0}},
                "prefill": {"num_workers": self.num_prefill, "max_restarts": 5},
                "decode": {"num_workers": 2, "max_restarts": 5},
                "transfer": {"transport": self.transport, "lease_s": self.lease_s},
                "index": index,
            },
        )


# ---- one request -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shot:
    """One request of a load: what to send, when, and whether to cut it short."""

    request: gen.GenerateRequest
    at_s: float = 0.0  # open loop: send this long after the load started
    cut: str = ""  # "cancel" (client cancels the stream) | "abort" (Abort RPC) | ""
    cut_after_s: float = 0.0  # after sending
    stage: str = ""  # the stage the cut was planned to hit
    # with a rig: how long after the router has the request in `stage` (`Driver._until_cut`)
    cut_in_stage_s: float = 0.0


@dataclass
class Outcome:
    """What became of one request. Times are seconds since the load started."""

    request_id: str
    sent_s: float
    status: str = LOST  # OK | ABORTED | a gRPC status code name | HUNG | LOST
    detail: str = ""
    ended_s: float | None = None
    first_token_s: float | None = None
    num_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    server_ms: dict[str, float] = field(default_factory=dict)  # the complete's timings
    cut: str = ""
    planned_stage: str = ""
    cut_s: float | None = None  # when the cut was made (None: it ended first)
    seen_stage: str = ""  # where the router had the request at the cut
    released_s: float | None = None  # the router stopped tracking the cut request
    client_stall_s: float = 0.0  # the load generator's own loop stalls while it was out
    # ... and from its cut until its stream ended, and until the router let go of it
    end_stall_s: float = 0.0
    release_stall_s: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def latency_s(self) -> float | None:
        return None if self.ended_s is None else self.ended_s - self.sent_s


def random_prompt(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def request_of(ids: list[int], request_id: str, max_tokens: int, n: int = 1) -> gen.GenerateRequest:
    """Greedy; with `n` > 1, n seeded choices (sampled: each its own tokens)."""
    if n > 1:
        return make_request(
            ids, request_id=request_id, temperature=1.0, seed=len(ids), n=n,
            max_tokens=max_tokens, ignore_eos=True,
        )  # fmt: skip
    return make_request(
        ids, request_id=request_id, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )


class Stalls:
    """When an event loop could not run: a ticker sleeps `PERIOD_S` and records each tick
    that woke more than `SLACK_S` late (the loop busy, or its process waiting for a core).

    Why: at twice a 2-core host's capacity the load generator, the router and four workers
    share two cores, and a request's latency as the client measures it includes the
    client's own waits. `within` says how much of a span was the measuring loop's own stall,
    so a figure about the router can leave it out (and say so)."""

    PERIOD_S, SLACK_S = 0.005, 0.002

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.spans: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            t = self.now()
            await asyncio.sleep(self.PERIOD_S)
            woke = self.now()
            if woke - t - self.PERIOD_S > self.SLACK_S:
                self.spans.append((t + self.PERIOD_S, woke))

    def within(self, a: float, b: float) -> float:
        """Seconds of [a, b] the loop spent stalled."""
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in self.spans)


class Driver:
    """Sends shots to the router over grpc.aio and records an Outcome for each.

    With a rig, a cut also notes where the router had the request and when the router
    stopped tracking it (the server side of "the stream ended")."""

    def __init__(
        self, target: str, bound_s: float, rig: Rig | None = None, progress: bool = False
    ) -> None:
        self.target = target
        self.bound_s = bound_s
        self.rig = rig
        self.progress = progress
        self.t0 = time.perf_counter()
        self.outcomes: list[Outcome] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def num_ended(self) -> int:
        return sum(o.ended_s is not None for o in self.outcomes)

    async def wait_ended(self, n: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_ended < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def run(
        self, shots: Sequence[Shot], concurrency: int | None = None, desc: str = ""
    ) -> list[Outcome]:
        """Send every shot (each at its `at_s`, at most `concurrency` in flight)."""
        sem = asyncio.Semaphore(concurrency or len(shots) or 1)
        bar = tqdm(total=len(shots), desc=desc, disable=not self.progress, leave=False)
        stalls = Stalls(self.now)
        ticker = asyncio.ensure_future(stalls.run())
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = gen_grpc.GenerationStub(channel)

            async def go(shot: Shot) -> Outcome:
                delay = shot.at_s - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with sem:
                    out = await self._one(stub, shot)
                bar.update(1)
                return out

            outs = await asyncio.gather(*(go(s) for s in shots))
        ticker.cancel()
        bar.close()
        for o in outs:
            o.client_stall_s = stalls.within(o.sent_s, o.ended_s or o.sent_s)
            if o.cut_s is not None:
                o.end_stall_s = stalls.within(o.cut_s, o.ended_s or o.cut_s)
                o.release_stall_s = stalls.within(o.cut_s, o.released_s or o.cut_s)
        return list(outs)

    async def _one(self, stub: gen_grpc.GenerationStub, shot: Shot) -> Outcome:
        out = Outcome(shot.request.request_id, self.now(), planned_stage=shot.stage)
        self.outcomes.append(out)
        call = stub.Generate(shot.request, timeout=self.bound_s)
        cutter = asyncio.ensure_future(self._cut(stub, call, shot, out)) if shot.cut else None
        complete: gen.GenerateComplete | None = None
        try:
            async for resp in call:
                if resp.HasField("chunk"):
                    if resp.chunk.token_ids and out.first_token_s is None:
                        out.first_token_s = self.now()
                    out.num_tokens += len(resp.chunk.token_ids)
                else:
                    complete = resp.complete
            out.status, out.detail = _ending(complete)
        except asyncio.CancelledError:
            if shot.cut != "cancel":
                raise
            out.status = grpc.StatusCode.CANCELLED.name
        except grpc.aio.AioRpcError as e:
            code = e.code()
            hung = code == grpc.StatusCode.DEADLINE_EXCEEDED
            out.status, out.detail = (HUNG if hung else code.name), e.details() or ""
        except Exception as e:  # the client broke: the request's fate is unknown
            out.status, out.detail = LOST, f"{type(e).__name__}: {e}"
        out.ended_s = self.now()
        if complete is not None:
            out.prefill_worker, out.decode_worker = complete.prefill_worker, complete.decode_worker
            t = complete.timings
            out.server_ms = {
                "queue": t.queue_ms,
                "prefill": t.prefill_ms,
                "transfer": t.transfer_ms,
                "ttft": t.ttft_ms,
            }
        if cutter is not None:
            if out.cut_s is not None:  # the cut is under way: let it finish its accounting
                await cutter
            else:
                cutter.cancel()
        return out

    async def _until_cut(self, shot: Shot) -> None:
        """Sleep until the cut: `cut_after_s` after sending. With a rig the router's view
        steers it instead: once the router has the request in the planned stage (or past
        it), `cut_in_stage_s` later. A cut then lands in its stage whatever the host's load
        did since the calibration (a run faster than its calibration put every cut planned
        in prefill or transfer into decode)."""
        if self.rig is None or self.rig.router is None or not shot.stage:
            await asyncio.sleep(shot.cut_after_s)
            return
        order = list(dict.fromkeys(ROUTER_STAGE.values()))
        want = order.index(ROUTER_STAGE[shot.stage])
        rid, admitted = shot.request.request_id, False
        deadline = self.now() + shot.cut_after_s + self.bound_s + 30.0
        while self.now() < deadline:
            seen = self._stage(rid)
            if seen in order:
                admitted = True
                if order.index(seen) >= want:
                    break
            elif admitted:  # done: the cut finds it ended
                return
            await asyncio.sleep(0.002)
        await asyncio.sleep(shot.cut_in_stage_s)

    async def _cut(
        self, stub: gen_grpc.GenerationStub, call: Any, shot: Shot, out: Outcome
    ) -> None:
        await self._until_cut(shot)
        if call.done() or out.ended_s is not None:
            return
        rid = shot.request.request_id
        out.cut, out.cut_s, out.seen_stage = shot.cut, self.now(), self._stage(rid)
        if shot.cut == "cancel":
            call.cancel()
        else:
            try:
                found = await stub.Abort(gen.AbortRequest(request_id=rid), timeout=self.bound_s)
            except grpc.aio.AioRpcError as e:
                found = gen.AbortResponse(found=False)
                out.detail = f"Abort failed: {e.code().name}"
            if not found.found:  # not admitted yet (or just done): the request went on
                out.cut, out.cut_s, out.seen_stage = "", None, ""
                return
        await self._watch_release(rid, out)

    def _stage(self, request_id: str) -> str:
        """The router's view of the request (prefill and transfer are one Ray call there)."""
        if self.rig is None or self.rig.router is None:
            return ""
        act = self.rig.router.active.get(request_id)
        if act is None:
            return "not admitted or done"
        if act.first_sent_s is not None:
            return "decode"
        return "prefill or transfer" if act.prefill is not None else "before prefill"

    async def _watch_release(self, request_id: str, out: Outcome, timeout_s: float = 30) -> None:
        if self.rig is None or self.rig.router is None:
            return
        active = self.rig.router.active
        deadline = self.now() + timeout_s
        while request_id in active and self.now() < deadline:
            await asyncio.sleep(0.002)
        if request_id not in active:
            out.released_s = self.now()


def _ending(complete: gen.GenerateComplete | None) -> tuple[str, str]:
    if complete is None:
        return LOST, "the stream closed without a complete message or a status"
    if complete.finish_reason == gen.FINISH_REASON_ABORT:
        return ABORTED, ""
    return OK, ""


# ---- results ---------------------------------------------------------------------------------
@dataclass
class ScenarioResult:
    name: str
    fault: str
    outcomes: list[Outcome]
    quiescence: Quiescence | None = None
    recover_s: float | None = None
    fault_s: list[float] = field(default_factory=list)  # when faults hit (load clock)
    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def succeeded(self) -> int:
        return sum(o.status == OK for o in self.outcomes)

    @property
    def statuses(self) -> dict[str, int]:
        c = Counter(o.status for o in self.outcomes if o.status not in (OK, HUNG, LOST))
        return dict(sorted(c.items()))

    @property
    def hung(self) -> int:
        return sum(o.status == HUNG for o in self.outcomes)

    @property
    def lost(self) -> int:
        return sum(o.status == LOST for o in self.outcomes)

    @property
    def stranded(self) -> dict[str, int | None]:
        return dict(self.quiescence.used_blocks) if self.quiescence else {}

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    def fault_hit(self, what: str, hit: bool) -> None:
        """The check that the fault hit what the scenario names (`what`, with its count)."""
        self.checks[f"{FAULT_HIT}: {what}"] = hit

    def base_checks(self) -> None:
        """What every scenario must show: no hang, no loss, nothing left behind."""
        self.checks["0 hung"] = self.hung == 0
        self.checks["0 lost"] = self.lost == 0
        if self.quiescence is not None:
            q = self.quiescence
            self.checks["0 blocks stranded"] = all(v == 0 for v in q.used_blocks.values())
            self.checks["no per-request state left"] = not any(q.leftovers.values()) and not (
                q.router_active
            )
            self.checks["integrity"] = not q.integrity_errors

    def to_json(self) -> dict[str, Any]:
        q = self.quiescence
        return {
            "name": self.name,
            "fault": self.fault,
            "sent": self.sent,
            "succeeded": self.succeeded,
            "statuses": self.statuses,
            "hung": self.hung,
            "lost": self.lost,
            "stranded_blocks": self.stranded,
            "leftovers": q.leftovers if q else {},
            "router_active_after": q.router_active if q else [],
            "quiesce_wait_s": q.waited_s if q else None,
            "integrity_errors": q.integrity_errors if q else {},
            "recover_s": self.recover_s,
            "fault_s": self.fault_s,
            "figures": self.figures,
            "checks": self.checks,
            "passed": self.passed,
            "wall_s": self.wall_s,
            "outcomes": [asdict(o) for o in self.outcomes],
        }


def percentile(values: Sequence[float], p: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), p)) if values else None


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 1)


# ---- the run's context -----------------------------------------------------------------------
@dataclass
class Chaos:
    """One rig and what scenarios share: sizes, randomness, the model's vocabulary."""

    cfg: ChaosConfig
    rig: Rig
    redis: RedisProcess | None = None
    rng: random.Random = field(default_factory=random.Random)
    probe_log: list[list[Any]] = field(default_factory=list)  # the last recovery's probes
    _n: int = 0

    @property
    def vocab_size(self) -> int:
        assert self.rig.router is not None
        return int(self.rig.router.model_info.vocab_size)

    def driver(self) -> Driver:
        return Driver(self.rig.target, self.cfg.hang_bound_s, self.rig, self.cfg.progress)

    def request(
        self, tag: str, ids: list[int] | None = None, max_tokens: int | None = None, n: int = 1
    ) -> gen.GenerateRequest:
        self._n += 1
        ids = ids or random_prompt(self.rng, self.cfg.prompt_len, self.vocab_size)
        return request_of(ids, f"chaos-{tag}-{self._n}", max_tokens or self.cfg.output_len, n)

    def shots(self, tag: str, count: int, n: int = 1) -> list[Shot]:
        """`count` requests of `n` choices each."""
        return [Shot(self.request(tag, n=n)) for _ in range(count)]

    def quiesce(self) -> Quiescence:
        """After the load: wait out the lease (and a reaper period) for anything held."""
        return self.rig.quiesce(timeout_s=self.cfg.lease_s + 5.0)

    async def probe(
        self, n: int = 1, timeout_s: float = 10.0, stagger_s: float = 0.05
    ) -> list[Outcome]:
        """`n` short requests, sent `stagger_s` apart so that they overlap but each is
        routed after the one before has reserved: requests that arrive at the same instant
        are all routed on the same view of the pool and go to the same decode worker (the
        first in order, on a tie), which would hide a restarted worker from the probes."""
        d = Driver(self.rig.target, timeout_s)
        shots = [Shot(self.request("probe", max_tokens=4), at_s=i * stagger_s) for i in range(n)]
        return await d.run(shots)

    async def recover(
        self, since: float, served_by: str = "", timeout_s: float = 90.0
    ) -> float | None:
        """Seconds from `since` (perf_counter) until a burst of probes all succeed, one of
        them served by `served_by` when given (a burst as wide as that worker's pool)."""
        width = 1
        if served_by:
            role = "prefill" if "prefill" in served_by else "decode"
            width = sum(role in n for n in self.rig.actors())
        deadline = time.perf_counter() + timeout_s
        self.probe_log = []
        while time.perf_counter() < deadline:
            outs = await self.probe(width)
            names = {o.prefill_worker for o in outs} | {o.decode_worker for o in outs}
            self.probe_log.append(
                [round(time.perf_counter() - since, 2)]
                + [f"{o.status} {o.prefill_worker} {o.decode_worker} {o.detail[:80]}" for o in outs]
            )
            if all(o.status == OK for o in outs) and (not served_by or served_by in names):
                return time.perf_counter() - since
            await asyncio.sleep(0.25)
        return None


# ---- scenarios -------------------------------------------------------------------------------
async def _calibrate_stages(ch: Chaos, n: int) -> dict[str, tuple[float, float]]:
    """Each stage's window, seconds after sending, from `n` uncut requests at the cancel
    scenario's concurrency: medians of the server's queue and prefill times, then the client's
    TTFT and end."""
    d = ch.driver()
    outs = await d.run(ch.shots("calib", n), ch.cfg.cancel_concurrency, "calibrate")
    ok = [o for o in outs if o.status == OK and o.ttft_s is not None and o.latency_s]
    if not ok:
        raise RuntimeError(f"calibration: no request succeeded ({Counter(o.status for o in outs)})")
    queue = float(np.median([o.server_ms["queue"] for o in ok])) / 1e3
    prefill = queue + float(np.median([o.server_ms["prefill"] for o in ok])) / 1e3
    ttft = max(float(np.median([o.ttft_s or 0.0 for o in ok])), prefill)
    end = max(float(np.median([o.latency_s or 0.0 for o in ok])), ttft)
    return {
        "before prefill": (0.0, queue),
        "prefill": (queue, prefill),
        "transfer": (prefill, ttft),
        "decode": (ttft, ttft + 0.9 * (end - ttft)),
    }


def scenario_cancel(ch: Chaos) -> ScenarioResult:
    cfg = ch.cfg
    windows = asyncio.run(_calibrate_stages(ch, max(cfg.cancel_concurrency, 8)))
    shots = []
    for i in range(cfg.num_cancel):
        stage = STAGES[i % len(STAGES)]
        lo, hi = windows[stage]
        shots.append(
            Shot(
                # 16 times the calibration's length: a run faster than its calibration (on a
                # host whose load fell meanwhile: 5-7x seen) still finds the stream alive at a
                # cut planned in decode; every such stream is cut long before its end
                ch.request("cancel", max_tokens=16 * cfg.output_len),
                cut="cancel" if ch.rng.random() < 0.5 else "abort",
                cut_after_s=ch.rng.uniform(lo, hi),
                stage=stage,
                cut_in_stage_s=ch.rng.uniform(0.0, (hi - lo) / 2),
            )
        )
    d = ch.driver()
    outs = asyncio.run(d.run(shots, cfg.cancel_concurrency, "cancel"))
    last_cut = max((o.cut_s for o in outs if o.cut_s is not None), default=d.now())
    res = ScenarioResult("cancel", f"{cfg.num_cancel} streams cut at random points", outs)
    res.quiescence = ch.quiesce()
    res.recover_s = asyncio.run(ch.recover(d.t0 + last_cut))
    cut = [o for o in outs if o.cut_s is not None]
    end_after = [(o.ended_s or math.inf) - (o.cut_s or 0.0) for o in cut]
    release_after = [(o.released_s or math.inf) - (o.cut_s or 0.0) for o in cut]
    # less the load generator's own stalls after each cut (`Stalls`): it notes the end and
    # the release, and a loop that waited for a core notes them late (the overload row's way)
    end_less = [t - o.end_stall_s for t, o in zip(end_after, cut, strict=True)]
    release_less = [t - o.release_stall_s for t, o in zip(release_after, cut, strict=True)]
    in_stage = Counter(
        o.seen_stage for o in cut if o.seen_stage == ROUTER_STAGE.get(o.planned_stage)
    )
    res.figures = {
        "stage_windows_ms": {
            k: [round(a * 1e3, 1), round(b * 1e3, 1)] for k, (a, b) in windows.items()
        },
        "cut": len(cut),
        "ended_before_cut": len(outs) - len(cut),
        "cut_by_kind": dict(Counter(o.cut for o in cut)),
        "cut_by_planned_stage": dict(Counter(o.planned_stage for o in cut)),
        "cut_by_router_stage": dict(Counter(o.seen_stage for o in cut)),
        "cut_in_planned_stage": dict(in_stage),
        "max_end_after_cut_ms": _ms(max(end_after, default=0.0)),
        "p99_end_after_cut_ms": _ms(percentile(end_after, 99)),
        "max_release_after_cut_ms": _ms(max(release_after, default=0.0)),
        "p99_release_after_cut_ms": _ms(percentile(release_after, 99)),
        "max_end_less_client_stalls_ms": _ms(max(end_less, default=0.0)),
        "max_release_less_client_stalls_ms": _ms(max(release_less, default=0.0)),
    }
    res.base_checks()
    stages = dict.fromkeys(ROUTER_STAGE.values())
    res.fault_hit(
        "cuts in their planned stage: " + ", ".join(f"{k} {in_stage[k]}" for k in stages),
        all(in_stage[k] >= 1 for k in stages),
    )
    res.checks[f"every cut stream ended within {cfg.cut_bound_s:g} s (less client stalls)"] = all(
        t <= cfg.cut_bound_s for t in end_less
    )
    res.checks[f"the router let go of each within {cfg.cut_bound_s:g} s (less client stalls)"] = (
        all(t <= cfg.cut_bound_s for t in release_less)
    )
    return res


async def aim(rig: Rig, names: Sequence[str], timeout_s: float) -> tuple[str, list[str]]:
    """Wait (up to `timeout_s`) until the router has a request on one of the workers `names`;
    the one with the most, and the requests on it then (none: the time ran out). The caller
    strikes right after, with no await in between, so this is what the fault hits."""
    deadline = time.monotonic() + timeout_s
    while True:
        on = {name: rig.requests_on(name) for name in names}
        name = max(names, key=lambda n: len(on[n]))
        if on[name] or time.monotonic() > deadline:
            return name, on[name]
        await asyncio.sleep(0.002)


async def _aim_streaming(rig: Rig, names: Sequence[str], timeout_s: float) -> tuple[str, list[str]]:
    """As `aim`, counting only requests that already streamed a token from their worker."""
    assert rig.router is not None
    deadline = time.monotonic() + timeout_s
    while True:
        on: dict[str, list[str]] = {name: [] for name in names}
        for rid, act in list(rig.router.active.items()):
            if act.decode is not None and act.decode.name in on and act.num_sent > 1:
                on[act.decode.name].append(rid)
        name = max(names, key=lambda n: len(on[n]))
        if on[name] or time.monotonic() > deadline:
            return name, on[name]
        await asyncio.sleep(0.002)


def scenario_kill(ch: Chaos, role: str, n: int = 1) -> ScenarioResult:
    """kill -9 of a `role` worker's process once `kill_after` requests ended: of the one
    the router has the most requests on (waiting for one to have any; the requests on it
    right before the kill are the fault's proof). Both pools' workers share the load, but
    routing by free KV blocks may leave one of them without a request for a while. `n`:
    choices per request (n > 1: each request's choices are forked sequences there)."""
    cfg = ch.cfg
    names = [w for w in ch.rig.actors() if f"-{role}-" in w]
    pids = {w: ch.rig.pid(w) for w in names}
    d = ch.driver()
    row = f"kill-{role}" + (f"-n{n}" if n > 1 else "")
    shots = ch.shots(row, cfg.num_kill, n)
    fault: dict[str, float] = {}
    hit: list[str] = []
    victim: list[str] = []

    async def body() -> list[Outcome]:
        async def inject() -> None:
            await d.wait_ended(cfg.kill_after)
            name, on = await aim(ch.rig, names, cfg.aim_timeout_s)
            os.kill(pids[name], signal.SIGKILL)
            fault["pid"], fault["at"] = pids[name], d.now()
            victim.append(name)
            hit.extend(on)
            rec = await ch.recover(d.t0 + fault["at"], served_by=name)
            fault["recover"] = math.nan if rec is None else rec

        outs, _ = await asyncio.gather(d.run(shots, cfg.kill_concurrency, f"kill {role}"), inject())
        return outs

    outs = asyncio.run(body())
    t_kill, name = fault["at"], victim[0]
    res = ScenarioResult(row, f"kill -9 {name} (pid {int(fault['pid'])})", outs, fault_s=[t_kill])
    res.recover_s = None if math.isnan(fault["recover"]) else fault["recover"]
    res.quiescence = ch.quiesce()
    in_flight = [o for o in outs if o.sent_s <= t_kill and (o.ended_s or math.inf) > t_kill]
    after = [(o.ended_s or math.inf) - t_kill for o in in_flight]
    by_id = {o.request_id: o for o in outs}
    res.figures = {
        "in_flight_at_kill": len(in_flight),
        "in_flight_outcomes": dict(Counter(o.status for o in in_flight)),
        "on_worker_at_kill": len(hit),
        "on_worker_outcomes": dict(Counter(by_id[r].status for r in hit if r in by_id)),
        "max_end_after_kill_s": round(max(after, default=0.0), 3),
        "killed": name,
        "new_pid": ch.rig.pid(name),
        "probes": ch.probe_log,
    }
    res.base_checks()
    res.fault_hit(f"{len(hit)} requests on {name} at the kill", len(hit) >= 1)
    res.checks["each completes or ends UNAVAILABLE"] = set(o.status for o in outs) <= {
        OK,
        grpc.StatusCode.UNAVAILABLE.name,
    }
    res.checks[f"in flight at the kill ended within {cfg.fault_bound_s:g} s"] = all(
        t <= cfg.fault_bound_s for t in after
    )
    res.checks[f"serves again within {cfg.recover_bound_s:g} s"] = (
        res.recover_s is not None and res.recover_s <= cfg.recover_bound_s
    )
    return res


def scenario_freeze(ch: Chaos, role: str) -> ScenarioResult:
    """SIGSTOP of a `role` worker (the one the router has the most requests on, once
    `kill_after` ended) for `freeze_s`, then SIGCONT: a worker alive but not answering.
    Its requests must end within `freeze_bound_s` (served elsewhere or UNAVAILABLE), never
    as a normal-looking abort; the rest of the service keeps completing requests while it
    is frozen; a frozen prefill worker takes no decode worker down with it."""
    cfg = ch.cfg
    rig = ch.rig
    assert rig.router is not None
    names = [n for n in rig.actors() if f"-{role}-" in n]
    pids = {n: rig.pid(n) for n in names}
    d = ch.driver()
    # A load that outlasts the freeze: requests keep arriving while the worker is stopped.
    shots = [
        Shot(ch.request(f"freeze-{role}"), at_s=i * cfg.freeze_s / cfg.num_kill)
        for i in range(cfg.num_kill)
    ]
    fault: dict[str, float] = {}
    hit: list[str] = []
    victim: list[str] = []
    decode_down: set[str] = set()

    async def body() -> list[Outcome]:
        async def inject() -> None:
            await d.wait_ended(cfg.kill_after)
            # A decode worker is frozen under a stream it is decoding (tokens sent already):
            # the case that used to wait out the freeze.
            on_role = aim if role == "prefill" else _aim_streaming
            name, on = await on_role(rig, names, cfg.aim_timeout_s)
            os.kill(pids[name], signal.SIGSTOP)
            fault["at"] = d.now()
            victim.append(name)
            hit.extend(on)
            try:
                while d.now() < fault["at"] + cfg.freeze_s:
                    assert rig.router is not None
                    decode_down.update(w.name for w in rig.router.decode.workers if not w.healthy)
                    await asyncio.sleep(0.05)
            finally:
                os.kill(pids[name], signal.SIGCONT)
            fault["resumed"] = d.now()

        outs, _ = await asyncio.gather(
            d.run(shots, cfg.kill_concurrency, f"freeze {role}"), inject()
        )
        return outs

    outs = asyncio.run(body())
    t_freeze, name = fault["at"], victim[0]
    res = ScenarioResult(
        f"freeze-{role}",
        f"SIGSTOP {name} for {cfg.freeze_s:g} s",
        outs,
        fault_s=[t_freeze, fault["resumed"]],
    )
    res.recover_s = asyncio.run(ch.recover(time.perf_counter()))
    res.quiescence = ch.quiesce()
    by_id = {o.request_id: o for o in outs}
    on_it = [by_id[r] for r in hit if r in by_id]

    def let_go(o: Outcome) -> float:
        """When the frozen worker stopped holding the request up: a prompt that was on a
        frozen prefill worker, at its first token from the worker that took it over (the
        rest of its tokens are ordinary decoding, as long as its output, under this
        scenario's own load); otherwise when it ended."""
        if role == "prefill" and o.status == OK and o.first_token_s is not None:
            return o.first_token_s
        return o.ended_s or math.inf

    after = [let_go(o) - t_freeze for o in on_it]
    during = [
        o for o in outs if o.status == OK and t_freeze < (o.ended_s or math.inf) < fault["resumed"]
    ]
    res.figures = {
        "on_worker_at_freeze": len(hit),
        "on_worker_outcomes": dict(Counter(o.status for o in on_it)),
        "max_let_go_after_freeze_s": round(max(after, default=0.0), 3),
        "completed_while_frozen": len(during),
        "decode_workers_marked_down": sorted(decode_down),
        "frozen": name,
    }
    res.base_checks()
    res.fault_hit(f"{len(hit)} requests on {name} at the freeze", len(hit) >= 1)
    res.checks["each completes or ends UNAVAILABLE (none as an abort)"] = set(
        o.status for o in outs
    ) <= {OK, grpc.StatusCode.UNAVAILABLE.name}
    res.checks[f"its requests were let go within {cfg.freeze_bound_s:g} s"] = all(
        t <= cfg.freeze_bound_s for t in after
    )
    res.checks["the service completed requests while it was frozen"] = len(during) >= 1
    if role == "prefill":
        res.checks["no decode worker was marked down"] = not decode_down
    res.checks["serves afterwards"] = res.recover_s is not None
    return res


def scenario_redis(ch: Chaos) -> ScenarioResult:
    cfg = ch.cfg
    redis = ch.redis
    assert redis is not None, "the redis scenario needs the rig's redis-server"
    assert ch.rig.router is not None
    bases = [random_prompt(ch.rng, cfg.prompt_len * 3 // 4, ch.vocab_size) for _ in range(10)]
    tail = cfg.prompt_len - len(bases[0])
    shots = [
        Shot(ch.request("redis", bases[i % 10] + random_prompt(ch.rng, tail, ch.vocab_size)))
        for i in range(cfg.num_kill)
    ]
    errors_before = ch.rig.router.index.errors
    d = ch.driver()
    fault: dict[str, float] = {}

    async def body() -> list[Outcome]:
        async def inject() -> None:
            await d.wait_ended(15)
            await asyncio.to_thread(redis.kill)
            fault["at"] = d.now()

        outs, _ = await asyncio.gather(d.run(shots, cfg.kill_concurrency, "redis"), inject())
        return outs

    outs = asyncio.run(body())
    t_restart = time.perf_counter()
    redis.start()
    workers = set(ch.rig.actors())
    res = ScenarioResult(
        "redis", "kill -9 redis-server under load", outs, fault_s=[fault["at"], t_restart - d.t0]
    )
    while redis.registered_workers(ch.rig.router.model_info.served_model_name) != workers:
        if time.perf_counter() - t_restart > 60:
            break
        time.sleep(0.05)
    else:
        res.recover_s = time.perf_counter() - t_restart
    res.quiescence = ch.quiesce()
    during = [o for o in outs if (o.ended_s or 0.0) > fault["at"]]
    index_errors = ch.rig.router.index.errors - errors_before
    res.figures = {
        "requests_ended_while_down": len(during),
        "index_errors_at_router": index_errors,
        "recover_is": "all workers registered in the fresh Redis, seconds after its start",
    }
    res.base_checks()
    res.fault_hit(
        f"{len(during)} requests ended while redis was down, {index_errors} index errors",
        len(during) >= 1 or index_errors >= 1,
    )
    res.checks["100% succeed"] = res.succeeded == res.sent
    return res


def scenario_stall(ch: Chaos) -> ScenarioResult:
    """Transfers held back `stall_past_lease_s` past their lease: the decode side frees the
    blocks at the lease, the router stops waiting soon after and the request fails."""
    cfg = ch.cfg
    stall_s = cfg.lease_s + cfg.stall_past_lease_s
    workers = [name for name in cfg.stall_workers if name in ch.rig.actors()]
    for name in workers:
        ch.rig.stall_transfers(name, stall_s, cfg.num_stalled)
    routing_before = ch.rig.routing_state()
    d = ch.driver()
    try:
        outs = asyncio.run(d.run(ch.shots("stall", cfg.num_stall), 8, "stall"))
        held = {name: ch.rig.num_stalled(name) for name in workers}
    finally:
        for name in workers:
            ch.rig.stall_transfers(name, 0.0, 0)
    planned = f"{cfg.num_stalled} transfers on {', '.join(workers)}"
    res = ScenarioResult(
        "stall", f"{planned} held {stall_s:g} s (lease {cfg.lease_s:g} s)", outs, fault_s=[0.0]
    )
    res.quiescence = ch.quiesce()
    res.recover_s = asyncio.run(ch.recover(time.perf_counter()))
    failed = [o for o in outs if o.status != OK]
    bound_s = cfg.lease_s + 5.0  # the router's grace is 2 s
    res.figures = {
        "stall_s": stall_s,
        "lease_s": cfg.lease_s,
        "stalled": len(failed),
        "held_by_the_stall": held,
        "max_latency_failed_s": round(
            max((o.latency_s or math.inf for o in failed), default=0.0), 3
        ),
        "max_latency_ok_s": round(
            max((o.latency_s or 0.0 for o in outs if o.status == OK), default=0.0), 3
        ),
        # where the requests went, and the router's view of the workers before the load
        "prefilled_by": dict(Counter(o.prefill_worker or "(its decode worker)" for o in outs)),
        "routing_before": routing_before,
    }
    res.base_checks()
    num_held = sum(held.values())
    res.fault_hit(f"{num_held} transfers held back by the stall", num_held >= 1)
    res.checks["each completes or ends UNAVAILABLE"] = set(o.status for o in outs) <= {
        OK,
        grpc.StatusCode.UNAVAILABLE.name,
    }
    res.checks[f"stalled ones end within lease + {bound_s - cfg.lease_s:g} s"] = all(
        (o.latency_s or math.inf) <= bound_s for o in failed
    )
    return res


def scenario_kill_router(ch: Chaos) -> ScenarioResult:
    """A second router (`pdserve serve` in a child process, attached to the rig's Ray
    cluster and pools) under `kill_after + kill_concurrency` requests, `kill_concurrency` at
    a time; kill -9 of its process once `kill_after` ended, so that the rest are in flight.
    Their streams must end with a status at the client, and what the dead router held on the
    workers (reservations, KV landed for nobody, decode streams nobody polls) must be freed
    by the workers alone within the lease plus the idle-stream bound (`stream_idle_s`, which
    the rig sets on the decode workers for the scenario); the rig's own router serves on."""
    from pdserve.tools.faults import RouterProcess

    cfg, rig = ch.cfg, ch.rig
    unavailable = grpc.StatusCode.UNAVAILABLE.name
    idle_before = rig.set_stream_idle_timeout(cfg.stream_idle_s)
    proc = RouterProcess(rig.cfg, rig.gcs_address())
    fault: dict[str, float] = {}
    try:
        t_start = time.perf_counter()
        proc.start()
        fault["router_start_s"] = time.perf_counter() - t_start
        rig.leftovers()  # the workers import this module's helpers now, not while aiming
        pids = {name: rig.pid(name) for name in rig.actors()}
        d = Driver(proc.target, cfg.hang_bound_s, progress=cfg.progress)
        shots = ch.shots("kill-router", cfg.kill_after)
        long = [
            Shot(ch.request("kill-router", max_tokens=cfg.kill_router_output_len))
            for _ in range(cfg.kill_concurrency)
        ]
        shots += long
        held_at_kill: list[str] = []  # request ids of long streams held on a decode worker

        async def body() -> list[Outcome]:
            async def inject() -> None:
                await d.wait_ended(cfg.kill_after)
                # Aim: the kill lands only once a decode worker holds one of its streams (as
                # the worker's own state says); those are long, so they are still held.
                ids = {shot.request.request_id for shot in long}
                held_at_kill.extend(await _until_streaming(rig, cfg.aim_timeout_s, ids))
                fault["at"] = d.now()
                fault["pid"] = proc.kill9() or 0

            outs, _ = await asyncio.gather(
                d.run(shots, cfg.kill_concurrency, "kill router"), inject()
            )
            return outs

        outs = asyncio.run(body())
        t_kill = d.t0 + fault["at"]
        held = rig.leftovers()  # what the dead router left on the workers, right after
        held_blocks = rig.used_blocks()
        bound_s = cfg.lease_s + cfg.stream_idle_s + 5.0
        quiescence = rig.quiesce(max(bound_s - (time.perf_counter() - t_kill), 1.0))
        freed_s = time.perf_counter() - t_kill
        restarted = [name for name, pid in pids.items() if rig.pid(name) != pid]
    finally:
        proc.close()
        rig.set_stream_idle_timeout(max(idle_before.values(), default=30.0))
    res = ScenarioResult(
        "kill-router",
        f"kill -9 of a second router (pid {int(fault.get('pid', 0))}) under load",
        outs,
        fault_s=[fault["at"]],
    )
    res.quiescence = quiescence
    res.recover_s = asyncio.run(ch.recover(time.perf_counter()))
    in_flight = [o for o in outs if o.sent_s <= fault["at"] < (o.ended_s or math.inf)]
    after = [(o.ended_s or math.inf) - fault["at"] for o in in_flight]
    held_for_it = _held_for(held)
    streams_at_kill = set(held_at_kill)
    cut = [o for o in outs if o.request_id in streams_at_kill and o.status == unavailable]
    res.figures = {
        "router_start_s": round(fault["router_start_s"], 2),
        "in_flight_at_kill": len(in_flight),
        "streams_held_at_kill": len(streams_at_kill),
        "in_flight_outcomes": dict(Counter(o.status for o in in_flight)),
        "max_end_after_kill_s": round(max(after, default=0.0), 3),
        "held_after_kill": len(held_for_it),
        "held_after_kill_by_kind": dict(Counter(k.split(":", 1)[0] for k in held_for_it)),
        "blocks_used_after_kill": held_blocks,
        "freed_after_kill_s": round(freed_s, 2) if quiescence.clean else None,
        "free_bound_s": bound_s,
        "stream_idle_s": cfg.stream_idle_s,
        "workers_restarted": restarted,
    }
    res.base_checks()
    res.fault_hit(
        f"{len(streams_at_kill)} streams held on decode workers at the kill, "
        f"{len(cut)} of them cut by it (UNAVAILABLE)",
        len(streams_at_kill) >= 1 and len(cut) == len(streams_at_kill),
    )
    res.checks["each completes or ends UNAVAILABLE"] = set(o.status for o in outs) <= {
        OK,
        unavailable,
    }
    # A request whose last message left the router just before the kill still ends OK here.
    res.checks[f"in flight at the kill ended within {cfg.fault_bound_s:g} s"] = all(
        o.status in (OK, unavailable) and t <= cfg.fault_bound_s
        for o, t in zip(in_flight, after, strict=True)
    )
    res.checks[f"workers freed all within lease + idle bound + 5 s ({bound_s:g} s) of the kill"] = (
        quiescence.clean
    )
    res.checks["the pools stayed up (no worker restarted)"] = not restarted
    res.checks["the rig's router serves afterwards"] = res.recover_s is not None
    return res


def scenario_drain_overrun(ch: Chaos) -> ScenarioResult:
    """SIGTERM of a second router whose drain grace (`drain_grace_s`) is shorter than the
    streams it holds (`pdserve.tools.drain`): every stream ends with an error its client is
    told, the process exits 0 with no traceback, its request log has one `failed:
    UNAVAILABLE` line per stream, and the workers free all it held."""
    from pdserve.tools.drain import ERROR, FINISHED, drain_overrun, log_problems
    from pdserve.tools.faults import RouterProcess

    cfg, rig = ch.cfg, ch.rig
    overrides = {"drain_grace_s": cfg.drain_grace_s, "log_requests": True}
    proc = RouterProcess(rig.cfg, rig.gcs_address(), http=True, router=overrides)
    try:
        proc.start()
        assert proc.proc is not None and proc.http_url is not None
        assert rig.router is not None
        model = rig.router.model_info.served_model_name
        run = drain_overrun(
            proc.proc,
            proc.target,
            proc.http_url,
            model,
            cfg.num_drain,
            cfg.drain_output_len,
            exit_timeout_s=cfg.hang_bound_s,
        )
        log = proc.log_path.read_text()
    finally:
        proc.close()
    outs = []
    for i, e in enumerate(run.ends):
        status = LOST
        if e.ending == FINISHED:
            status = OK
        elif e.ending == ERROR:
            status = e.detail.split(":", 1)[0] if e.face == "grpc" else "SSE_ERROR"
        outs.append(
            Outcome(
                f"chaos-drain-{e.face}-{i}",
                0.0,
                status,
                e.detail[:200],
                e.ended_s,
                e.first_token_s,
                e.tokens,
            )
        )
    res = ScenarioResult(
        "drain-overrun",
        f"SIGTERM of a second router (drain grace {cfg.drain_grace_s:g} s) under "
        f"{cfg.num_drain} streams",
        outs,
        fault_s=[run.sigterm_s],
    )
    res.quiescence = ch.quiesce()
    res.recover_s = asyncio.run(ch.recover(time.perf_counter()))
    after = [(e.ended_s or math.inf) - run.sigterm_s for e in run.ends]
    grace_over = re.search(r"grace over, ending (\d+) requests in flight", log)
    ended_by_drain = int(grace_over.group(1)) if grace_over else 0
    problems = log_problems(log)
    res.figures = {
        "streams_at_sigterm": run.streaming_at_sigterm,
        "ended_by_the_drain": ended_by_drain,
        "outcomes": dict(Counter(o.status for o in outs)),
        "sse_done": sum(e.done for e in run.ends if e.face == "http"),
        "max_end_after_sigterm_s": round(max(after, default=0.0), 3),
        "exit_code": run.exit_code,
        "exit_after_sigterm_s": None if run.exit_s is None else round(run.exit_s, 2),
        "request_log_failed": log.count("failed: UNAVAILABLE"),
        "log_problems": problems[:5],
    }
    res.base_checks()
    res.fault_hit(
        f"{ended_by_drain} of {cfg.num_drain} streams still in flight when the grace ran out",
        run.streaming_at_sigterm == cfg.num_drain and ended_by_drain == cfg.num_drain,
    )
    res.checks["every stream was told (SSE error event + [DONE], or UNAVAILABLE)"] = all(
        e.told_shutting_down and (e.done or e.face == "grpc") for e in run.ends
    )
    res.checks[f"streams and process ended within {cfg.drain_bound_s:g} s of SIGTERM"] = (
        run.exit_s is not None
        and run.exit_s <= cfg.drain_bound_s
        and all(t <= cfg.drain_bound_s for t in after)
    )
    res.checks["exit 0"] = run.exit_code == 0
    res.checks["no traceback in its log"] = not problems
    res.checks["its request log counts each"] = log.count("failed: UNAVAILABLE") == cfg.num_drain
    res.checks["the rig's router serves afterwards"] = res.recover_s is not None
    return res


def scenario_router_mismatch(ch: Chaos) -> ScenarioResult:
    """A second router asking for `mismatch_model` started against the rig's detached
    workers, which serve another model: its start fails (non-zero exit, within
    `mismatch_bound_s`) in one line naming both models, before it listens; the rig's workers
    are left as they were (none restarted, none added) and its router serves on."""
    from pdserve.tools.faults import RouterProcess

    cfg, rig = ch.cfg, ch.rig
    theirs = rig.cfg.model.model
    pids = {name: rig.pid(name) for name in rig.actors()}
    other = replace(rig.cfg, model=replace(rig.cfg.model, model=cfg.mismatch_model))
    proc = RouterProcess(other, rig.gcs_address())
    t0 = time.perf_counter()
    refused = ""
    try:
        proc.start(timeout_s=cfg.mismatch_bound_s)
    except RuntimeError:
        refused = "did not start"
    assert proc.proc is not None
    try:
        code = proc.proc.wait(max(cfg.mismatch_bound_s - (time.perf_counter() - t0), 1.0))
    except subprocess.TimeoutExpired:
        code = None
    failed_s = time.perf_counter() - t0
    log = proc.log_tail(200)
    listened = bool(proc.port)
    proc.close()
    # its own last line: Ray's forwarded lines ("(raylet) ... disk is over 95% full") may
    # come after the error
    lines = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith("(")]
    last = lines[-1] if lines else ""
    names_both = cfg.mismatch_model in last and theirs in last
    after = {name: rig.pid(name) for name in rig.actors()}
    res = ScenarioResult(
        "router-restart-mismatch",
        f"a router for {cfg.mismatch_model} started against detached {theirs} workers",
        [],
    )
    res.recover_s = asyncio.run(ch.recover(time.perf_counter()))
    res.quiescence = ch.quiesce()
    res.figures = {
        "exit_code": code,
        "failed_after_s": round(failed_s, 2),
        "last_line": last[:400],
        "listened": listened,
        "workers_before": sorted(pids),
        "workers_after": sorted(after),
    }
    res.base_checks()
    res.fault_hit(
        f"the router met {len(pids)} workers of {theirs}", bool(refused) and len(pids) >= 1
    )
    res.checks[f"its start failed (exit != 0) within {cfg.mismatch_bound_s:g} s"] = code not in (
        None,
        0,
    )
    res.checks["in one line naming both models"] = names_both
    res.checks["it never listened (advertised nothing)"] = not listened
    res.checks["the workers are as they were"] = after == pids
    res.checks["the rig's router serves afterwards"] = res.recover_s is not None
    return res


def _held_for(leftovers: dict[str, list[str]], tag: str = "-kill-router-") -> list[str]:
    """The per-request state on the workers that belongs to requests tagged `tag`."""
    return sorted(k for v in leftovers.values() for k in v if tag in k)


async def _until_streaming(rig: Rig, timeout_s: float, request_ids: set[str]) -> list[str]:
    """Wait, up to `timeout_s`, until a decode worker holds the stream of one of
    `request_ids`; those it then holds (empty when the wait ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = await asyncio.to_thread(rig.leftovers)
        streams = [k.split(":", 1)[1] for v in held.values() for k in v if k.startswith("streams:")]
        if found := sorted(set(streams) & request_ids):
            return found
        await asyncio.sleep(0.01)
    return []


def _expect(queue: Any, child: Any, what: str, timeout_s: float) -> Any:
    """The abusive client's next message (`what`, or its report when `what` is empty)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = queue.get(timeout=0.5)
            break
        except Empty:
            if not child.is_alive():
                raise RuntimeError(f"the abusive client exited ({child.exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the abusive client did not say {what!r}") from None
    if what and got != what:
        raise RuntimeError(f"the abusive client said {got!r}, not {what!r}")
    return got


def scenario_abusive_client(ch: Chaos) -> ScenarioResult:
    """A normal load (`num_abuse` requests, `abuse_concurrency` at a time) in windows that
    alternate alone and under abuse, `abuse_windows` of each and one more alone (A B A B A:
    a drift in what else the machine runs falls on both alike). Under abuse, one client
    (`pdserve.tools.abuse`, a child process) sends 10 MB prompts over HTTP and gRPC,
    stop-string floods at and over the limits, holds `num_slowloris` half-sent HTTP request
    heads and `kv_pokes` idle or junk connections on each KV endpoint; between windows it
    pauses with nothing in flight. The normal load's median latency under abuse must stay
    within `abuse_ratio_bound` of its median alone, the abuse be refused at the edge (or
    served, at the limits), and nothing be left."""
    from pdserve.tools.abuse import AbuseReport, AbuseSizes, AbuseTargets, run_abuser

    cfg, rig = ch.cfg, ch.rig
    router = rig.router
    assert router is not None
    kv = tuple(rig.kv_addresses().values()) if cfg.kv_pokes else ()
    targets = AbuseTargets(rig.target, rig.http_port, router.model_info.served_model_name, kv)
    sizes = AbuseSizes(
        max_stop_strings=router.cfg.limits.max_stop_strings,
        max_stop_chars=router.cfg.limits.max_stop_chars,
        stop_max_tokens=cfg.output_len,
        num_slowloris=cfg.num_slowloris,
        kv_pokes=cfg.kv_pokes,
    )
    ctx = multiprocessing.get_context("spawn")
    commands, queue = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=run_abuser, args=(targets, sizes, commands, queue), daemon=True)
    child.start()
    d = ch.driver()
    k = cfg.abuse_windows
    per, c = max(1, cfg.num_abuse // k), cfg.abuse_concurrency
    windows: list[list[Outcome]] = []  # alone, abused, alone, ... alone
    fault_s: list[float] = []
    try:
        _expect(queue, child, "ready", 120.0)  # imported: it costs no CPU from here on
        for i in range(k + 1):
            windows.append(asyncio.run(d.run(ch.shots("alone", per), c, f"alone {i + 1}")))
            if i == k:
                break
            commands.put("abuse")
            _expect(queue, child, "abusing", 60.0)
            fault_s.append(d.now())
            windows.append(asyncio.run(d.run(ch.shots("abused", per), c, f"abused {i + 1}")))
            fault_s.append(d.now())
            commands.put("pause")
            _expect(queue, child, "quiet", sizes.timeout_s + 30.0)
        commands.put("stop")
        report: AbuseReport = _expect(queue, child, "", sizes.timeout_s + 60.0)
    finally:
        commands.put("stop")
        child.join(30)
        if child.is_alive():
            child.kill()
    alone = [o for window in windows[0::2] for o in window]
    abused = [o for window in windows[1::2] for o in window]
    res = ScenarioResult(
        "abusive-client",
        "10 MB prompts, stop floods, slowloris, KV pokes from one client",
        sorted(alone + abused, key=lambda o: o.sent_s),
        fault_s=fault_s,
    )
    res.quiescence = ch.quiesce()
    res.recover_s = asyncio.run(ch.recover(time.perf_counter()))
    p50_alone = percentile([o.latency_s or math.inf for o in alone], 50)
    p50_abused = percentile([o.latency_s or math.inf for o in abused], 50)
    ratio = p50_abused / p50_alone if p50_alone and p50_abused is not None else None
    got = report.outcomes
    res.figures = {
        "p50_latency_alone_ms": _ms(p50_alone),
        "p50_latency_by_window_ms": [  # A B A B ... A
            _ms(percentile([o.latency_s or math.inf for o in run], 50)) for run in windows
        ],
        "p50_latency_abused_ms": _ms(p50_abused),
        "p99_latency_alone_ms": _ms(percentile([o.latency_s or math.inf for o in alone], 99)),
        "p99_latency_abused_ms": _ms(percentile([o.latency_s or math.inf for o in abused], 99)),
        "p50_ratio": None if ratio is None else round(ratio, 3),
        "abuse": report.to_json(),
    }
    res.base_checks()
    huge = report.total("huge prompt HTTP"), report.total("huge prompt gRPC")
    floods = report.total("stop flood HTTP") + report.total("stop flood gRPC")
    res.fault_hit(
        f"{huge[0]} + {huge[1]} 10 MB prompts (HTTP + gRPC), {floods} stop floods, "
        f"{report.slowloris_held_at_go} half-sent heads held, {report.kv_opened} KV pokes",
        min(huge) >= 1
        and floods >= 1
        and report.slowloris_held_at_go == cfg.num_slowloris
        and (report.kv_opened >= 1 or not kv),
    )
    res.checks["the normal load completes, alone and under abuse"] = res.succeeded == res.sent
    res.checks[f"p50 latency under abuse within {cfg.abuse_ratio_bound:g}x of alone"] = (
        ratio is not None and ratio <= cfg.abuse_ratio_bound
    )
    # 400 / INVALID_ARGUMENT name the field; a gRPC message over the receive size (room for
    # the longest valid prompt) is refused by gRPC itself before it is parsed.
    refused = {"400", grpc.StatusCode.INVALID_ARGUMENT.name}
    too_big = refused | {grpc.StatusCode.RESOURCE_EXHAUSTED.name}
    expected = {
        "huge prompt HTTP": refused,
        "huge prompt gRPC": too_big,
        "stops over limit HTTP": refused,
        "stops over limit gRPC": refused,
    }
    res.checks["abuse refused at the edge (400, INVALID_ARGUMENT, RESOURCE_EXHAUSTED)"] = all(
        set(got.get(kind, {})) <= codes for kind, codes in expected.items()
    )
    res.checks["stop floods at the limits are served"] = set(got.get("stop flood HTTP", {})) | set(
        got.get("stop flood gRPC", {})
    ) <= {"200", OK}
    return res


def _drive(
    target: str, bound_s: float, shots: list[Shot], concurrency: int | None
) -> list[Outcome]:
    return asyncio.run(Driver(target, bound_s).run(shots, concurrency))


def drive_apart(
    ch: Chaos, shots: list[Shot], concurrency: int | None = None, offset_s: float = 0.0
) -> list[Outcome]:
    """Send the shots from a child process, its times shifted by `offset_s`. The load then
    does not take turns with the router's event loop on this process's interpreter lock,
    which would add tens of milliseconds to a rejection that the router answers at once."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        outs = pool.submit(_drive, ch.rig.target, ch.cfg.hang_bound_s, shots, concurrency)
        result = outs.result()
    for o in result:
        for name in ("sent_s", "ended_s", "first_token_s"):
            v = getattr(o, name)
            if v is not None:
                setattr(o, name, v + offset_s)
    return result


def _poisson(ch: Chaos, rate: float, duration_s: float, tag: str) -> list[Shot]:
    """Arrivals at `rate` per second for `duration_s` (send times from 0)."""
    t, shots = 0.0, list[Shot]()
    while True:
        t += ch.rng.expovariate(rate)
        if t >= duration_s:
            return shots
        shots.append(Shot(ch.request(tag), at_s=t))


def steady_throughput(outs: Sequence[Outcome], concurrency: int) -> float:
    """Requests per second of a closed loop that kept `concurrency` in flight, by Little's
    law over its steady part: `concurrency` / the mean latency of the requests sent after
    the first `concurrency` and before the last `concurrency` (the ramp and the tail, which
    ran with fewer in flight, left out).

    Why not completions over a span: the loop's completions come in bursts (its last
    requests end together), and a span's ends fall inside or beside a burst by chance; on a
    2-core host the quartile span measured 44.3-61.4 requests/s in three runs of one tree,
    and once 87.2 where the run before measured 42.5 (`make chaos` then ran its 0.8x phase
    above capacity). A mean over every steady request's latency is not moved by where its
    ends fall."""
    done = sorted((o.sent_s, o.ended_s) for o in outs if o.status == OK and o.ended_s is not None)
    steady = [end - sent for sent, end in done[concurrency:-concurrency]]
    if not steady or sum(steady) <= 0:
        return 0.0
    return concurrency / (sum(steady) / len(steady))


def waiting_counts(outs: Sequence[Outcome], step_s: float = 0.01) -> list[int]:
    """How many requests had been sent and had no token yet (nor an end), every `step_s`:
    what the router's `max_queue_len` counts."""
    spans = [(o.sent_s, o.first_token_s or o.ended_s or o.sent_s) for o in outs]
    if not spans:
        return []
    t_end = max(b for _, b in spans)
    ticks = np.arange(0.0, t_end, step_s)
    starts = np.sort([a for a, _ in spans])
    stops = np.sort([b for _, b in spans])
    waiting = np.searchsorted(starts, ticks, "right") - np.searchsorted(stops, ticks, "right")
    return [int(n) for n in waiting]


def scenario_overload(ch: Chaos) -> ScenarioResult:
    """The unloaded TTFT (requests one at a time) and the capacity (steady throughput of a
    closed loop, `capacity_concurrency` in flight). Then Poisson arrivals at 0.8x capacity
    for `baseline_s` with no admission bound to speak of (the default 256): the baseline.
    The router's `max_queue_len` (requests admitted, no token yet) is then sized by Little's
    law so that a full queue waits at most the baseline's median TTFT: capacity x that TTFT,
    rounded down.
    Then arrivals at 2x capacity for `overload_s`. The load comes from a child process
    (`drive_apart`). (A bound at the baseline's 99th percentile of waiting requests admits
    more, about the capacity, at a higher TTFT: docs/reliability.md has both.)"""
    cfg = ch.cfg
    router = ch.rig.router
    assert router is not None
    alone = drive_apart(ch, ch.shots("unloaded", 8), 1)
    unloaded_ttft = percentile([o.ttft_s for o in alone if o.ttft_s is not None], 50) or 0.0
    n_cal = 16 * cfg.capacity_concurrency  # ~15 s: 4x (~4 s) left the rate to the host's noise
    capacity = steady_throughput(
        drive_apart(ch, ch.shots("capacity", n_cal), cfg.capacity_concurrency),
        cfg.capacity_concurrency,
    )
    print(
        f"pdserve chaos: unloaded TTFT {unloaded_ttft * 1e3:.0f} ms, capacity "
        f"{capacity:.1f} requests/s",
        file=sys.stderr,
        flush=True,
    )
    base = drive_apart(ch, _poisson(ch, 0.8 * capacity, cfg.baseline_s, "0.8x"))
    base_ttft = [o.ttft_s for o in base if o.status == OK and o.ttft_s is not None]
    # rounded down: a full queue then waits at most the baseline's median (rounded up, a
    # queue of 3.1 requests' worth held 4, and its wait was 29 % longer than the sizing's)
    queue_len = max(2, math.floor(capacity * (percentile(base_ttft, 50) or 0.0)))
    default = router.cfg
    router.cfg = replace(default, policy=replace(default.policy, max_queue_len=queue_len))
    t_over = cfg.baseline_s + 1.0  # on the plot, the 2x phase follows the 0.8x one
    router_stalls = Stalls(time.perf_counter)  # the router's own loop, for the figures
    ticker = asyncio.run_coroutine_threadsafe(router_stalls.run(), ch.rig.loop)
    try:
        shots = _poisson(ch, 2 * capacity, cfg.overload_s, "2x")
        over = drive_apart(ch, shots, None, t_over)
    finally:
        router.cfg = default
        ticker.cancel()
    t_end = time.perf_counter()
    base_p99 = percentile(base_ttft, 99) or 0.0
    res = ScenarioResult(
        "overload",
        f"2x capacity for {cfg.overload_s:g} s",
        over,
        fault_s=[t_over, t_over + cfg.overload_s],
    )
    res.quiescence = ch.quiesce()
    res.recover_s = asyncio.run(ch.recover(t_end))
    rejected = [o for o in over if o.status == grpc.StatusCode.RESOURCE_EXHAUSTED.name]
    reject_ms = [(o.latency_s or math.inf) * 1e3 for o in rejected]
    # less the load generator's own stalls while each was out (`Stalls`): the router's part
    router_ms = [t - o.client_stall_s * 1e3 for t, o in zip(reject_ms, rejected, strict=True)]
    slowest = max(rejected, key=lambda o: o.latency_s or math.inf, default=None)
    router_stall_ms = max((e - a for a, e in router_stalls.spans), default=0.0) * 1e3
    over_ttft = [o.ttft_s for o in over if o.status == OK and o.ttft_s is not None]
    over_p99 = percentile(over_ttft, 99)
    ratio = (over_p99 / base_p99) if over_p99 is not None and base_p99 else None
    res.figures = {
        "unloaded_ttft_ms": _ms(unloaded_ttft),
        "capacity_rps": round(capacity, 2),
        "max_queue_len": queue_len,
        "baseline": {
            "sent": len(base),
            "ok": len(base_ttft),
            "statuses": dict(Counter(o.status for o in base)),
            "p99_waiting": percentile(waiting_counts(base), 99),
            "p50_ttft_ms": _ms(percentile(base_ttft, 50)),
            "p99_ttft_ms": _ms(base_p99),
        },
        "overload": {
            "sent": len(over),
            "ok": len(over_ttft),
            "rejected": len(rejected),
            "p50_ttft_ms": _ms(percentile(over_ttft, 50)),
            "p99_ttft_ms": _ms(over_p99),
            "admitted_rps": round(len(over_ttft) / cfg.overload_s, 2),
        },
        "rejection_ms": {
            "p50": _r(percentile(reject_ms, 50)),
            "p99": _r(percentile(reject_ms, 99)),
            "max": _r(max(reject_ms, default=0.0)),
            "max_less_client_stalls": _r(max(router_ms, default=0.0)),
            "slowest_client_stall": _r(slowest.client_stall_s * 1e3 if slowest else 0.0),
            "router_loop_stall_max": _r(router_stall_ms),
        },
        "p99_ttft_ratio": None if ratio is None else round(ratio, 3),
        "baseline_outcomes": [asdict(o) for o in base],
    }
    res.base_checks()
    res.checks["excess rejected (RESOURCE_EXHAUSTED)"] = bool(rejected)
    res.checks[f"every rejection within {cfg.rejection_bound_ms:g} ms (less client stalls)"] = all(
        t <= cfg.rejection_bound_ms for t in router_ms
    )
    res.checks[f"admitted p99 TTFT within {cfg.ttft_ratio_bound:g}x of 0.8x load"] = (
        ratio is not None and ratio <= cfg.ttft_ratio_bound
    )
    res.checks["admitted ones complete or end with a status"] = set(o.status for o in over) <= {
        OK,
        grpc.StatusCode.RESOURCE_EXHAUSTED.name,
    }
    return res


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def _admin(ch: Chaos, make: Callable[[], Any], timeout_s: float = 300.0) -> Any:
    """A pool operation (`router.membership`) on the rig's router loop, from any thread:
    its answer, or the PoolError it raised."""
    from router.membership import PoolError

    try:
        return ch.rig.call(make(), timeout_s)
    except PoolError as e:
        return e


def scenario_pool(ch: Chaos, op: str) -> ScenarioResult:
    """Pool membership under load (docs/operations.md), on the worker the router has the
    most requests on (waiting for one to have any) once `kill_after` requests ended:
    - `drain`: a decode worker drained and stopped, then a decode worker added back;
    - `flip`: a prefill worker flipped to decode, then back;
    - `kill-flip`: a decode worker's flip to prefill, with kill -9 of its process while the
      flip drains it: the flip answers an error, the worker stays in its first pool (down
      until Ray restarts it in its first role) and serves again.
    Nothing is lost: the drain and flips end every request whole (kill-flip: whole or
    UNAVAILABLE, as a kill does), and the pools end as they began."""
    from pool_api.messages import Role
    from router.membership import PoolError

    cfg, rig = ch.cfg, ch.rig
    router = rig.router
    assert router is not None
    role = "prefill" if op == "flip" else "decode"
    names = [w for w in rig.actors() if f"-{role}-" in w]
    shape = router.admin.status()["workers"]
    d = ch.driver()
    row = f"pool-{op}"
    shots = ch.shots(row, cfg.num_kill)
    info: dict[str, Any] = {}

    async def body() -> list[Outcome]:
        async def inject() -> None:
            await d.wait_ended(cfg.kill_after)
            name, on = await aim(rig, names, cfg.aim_timeout_s)
            info.update(name=name, on=on, at=d.now())
            if op == "drain":
                info["drain"] = await asyncio.to_thread(
                    _admin, ch, lambda: router.admin.drain(name)
                )
                info["add"] = await asyncio.to_thread(
                    _admin, ch, lambda: router.admin.add(Role.DECODE)
                )
            elif op == "flip":
                for to in (Role.DECODE, Role.PREFILL):
                    info[f"to {to.value}"] = await asyncio.to_thread(
                        _admin, ch, functools.partial(router.admin.flip, name, to)
                    )
            else:
                pid = rig.pid(name)
                flip = asyncio.ensure_future(
                    asyncio.to_thread(_admin, ch, lambda: router.admin.flip(name, Role.PREFILL))
                )
                while router.admin.busy.get(name) != "flip" and not flip.done():
                    await asyncio.sleep(0.002)
                os.kill(pid, signal.SIGKILL)
                info["killed_at"] = d.now()
                info["flip"] = await flip
                rec = await ch.recover(d.t0 + info["killed_at"], served_by=name)
                info["recover"] = rec
                if router.prefill.get(name) is not None:  # the flip ran on the restarted actor
                    info["restore"] = await asyncio.to_thread(
                        _admin, ch, lambda: router.admin.flip(name, Role.DECODE)
                    )

        outs, _ = await asyncio.gather(d.run(shots, cfg.kill_concurrency, row), inject())
        return outs

    outs = asyncio.run(body())
    name = info["name"]
    res = ScenarioResult(row, f"{op} of {name} under load", outs, fault_s=[info["at"]])
    res.quiescence = ch.quiesce()
    answers = {k: v for k, v in info.items() if isinstance(v, dict | PoolError)}
    res.figures = {
        k: (v if isinstance(v, dict) else f"HTTP {v.status}: {v.message}")
        for k, v in answers.items()
    }
    after = router.admin.status()["workers"]
    res.figures["pools_before"] = sorted((w["name"], w["role"]) for w in shape)
    res.figures["pools_after"] = sorted((w["name"], w["role"]) for w in after)
    res.base_checks()
    res.fault_hit(f"{len(info['on'])} requests on {name} when it began", len(info["on"]) >= 1)
    res.checks["the pools end as they began"] = (
        res.figures["pools_before"] == res.figures["pools_after"]
    )
    if op == "kill-flip":
        res.recover_s = info.get("recover")
        # Ray restarts the killed actor in its first role; the flip either failed (the
        # worker kept in its pool, down until then) or ran on the restarted actor
        res.checks["the flip answered (an error, or done on the restarted worker)"] = isinstance(
            info["flip"], PoolError | dict
        )
        res.checks["each completes or ends UNAVAILABLE"] = set(o.status for o in outs) <= {
            OK,
            grpc.StatusCode.UNAVAILABLE.name,
        }
        res.checks[f"serves again within {cfg.recover_bound_s:g} s"] = (
            res.recover_s is not None and res.recover_s <= cfg.recover_bound_s
        )
    else:
        ok = [v for v in answers.values() if isinstance(v, dict)]
        res.checks["every operation succeeded"] = len(ok) == len(answers) == 2
        res.checks["no request ended by a drain's bound"] = all(v.get("ended", 0) == 0 for v in ok)
        res.checks["every request completes"] = all(o.status == OK for o in outs)
    return res


def scenario_pool_router_killed(ch: Chaos) -> ScenarioResult:
    """kill -9 of a second router while it drains a decode worker (`POST
    /v1/admin/pool/drain` with a long bound), under load through the first router: the
    worker refuses new requests while the drain holds it (the first router places them
    elsewhere, and sees it draining), then, its drain's lease no longer renewed, serves again
    within `DRAIN_LEASE_S` (plus a stats refresh), instead of staying out of every pool
    with no router left to finish the drain. Nothing is lost."""
    from pdserve.pool_cli import call
    from pdserve.tools.faults import RouterProcess
    from router.membership import DRAIN_LEASE_S

    cfg, rig = ch.cfg, ch.rig
    router = rig.router
    assert router is not None
    d = ch.driver()
    row = "pool-router-killed"
    shots = ch.shots(row, cfg.num_kill)
    info: dict[str, Any] = {}
    proc = RouterProcess(rig.cfg, rig.gcs_address(), http=True)
    try:
        proc.start()
        url = proc.http_url
        assert url is not None

        async def body() -> list[Outcome]:
            async def inject() -> None:
                await d.wait_ended(cfg.kill_after)
                names = [w.name for w in router.decode.workers]
                name, on = await aim(rig, names, cfg.aim_timeout_s)
                info.update(name=name, on=on, at=d.now())
                drain = {"worker": name, "bound_s": 3600}
                drain_call = asyncio.ensure_future(  # ends only once that router is gone
                    asyncio.to_thread(call, url, "POST", "/v1/admin/pool/drain", drain, None, 60)
                )
                w = router.decode.get(name)
                assert w is not None
                t0 = time.monotonic()
                while not w.draining and time.monotonic() - t0 < 30:
                    await asyncio.sleep(0.01)
                info["seen_draining_s"] = round(time.monotonic() - t0, 3)
                info["killed_pid"] = await asyncio.to_thread(proc.kill9)
                with contextlib.suppress(Exception):  # its connection broke with it
                    await asyncio.wait_for(drain_call, 30)
                t1 = time.monotonic()
                while not w.routable and time.monotonic() - t1 < 3 * DRAIN_LEASE_S:
                    await asyncio.sleep(0.01)
                info["serves_again_s"] = round(time.monotonic() - t1, 3) if w.routable else None

            outs, _ = await asyncio.gather(d.run(shots, cfg.kill_concurrency, row), inject())
            return outs

        outs = asyncio.run(body())
    finally:
        proc.close()
    name = info["name"]
    res = ScenarioResult(row, f"kill -9 of a second router draining {name}", outs)
    res.fault_s = [info["at"]]
    res.quiescence = ch.quiesce()
    res.figures = {k: v for k, v in info.items() if k not in ("on", "at")}
    res.base_checks()
    res.fault_hit(f"{len(info['on'])} requests on {name} when the drain began", bool(info["on"]))
    res.checks["the first router saw the worker draining"] = info["seen_draining_s"] < 30
    again = info["serves_again_s"]
    res.checks[f"it serves again within {DRAIN_LEASE_S + 5:g} s of the kill"] = (
        again is not None and again <= DRAIN_LEASE_S + 5
    )
    res.checks["every request completes"] = all(o.status == OK for o in outs)
    return res


SCENARIOS: dict[str, Callable[[Chaos], ScenarioResult]] = {
    "cancel": scenario_cancel,
    "kill-prefill": lambda ch: scenario_kill(ch, "prefill"),
    "kill-decode": lambda ch: scenario_kill(ch, "decode"),
    "kill-decode-n4": lambda ch: scenario_kill(ch, "decode", n=4),
    "freeze-decode": lambda ch: scenario_freeze(ch, "decode"),
    "freeze-prefill": lambda ch: scenario_freeze(ch, "prefill"),
    "redis": scenario_redis,
    "stall": scenario_stall,
    "overload": scenario_overload,
    "kill-router": scenario_kill_router,
    "drain-overrun": scenario_drain_overrun,
    "router-restart-mismatch": scenario_router_mismatch,
    "abusive-client": scenario_abusive_client,
    "pool-drain": lambda ch: scenario_pool(ch, "drain"),
    "pool-flip": lambda ch: scenario_pool(ch, "flip"),
    "pool-kill-flip": lambda ch: scenario_pool(ch, "kill-flip"),
    "pool-router-killed": scenario_pool_router_killed,
}


# ---- report ----------------------------------------------------------------------------------
def _stranded_text(r: ScenarioResult) -> str:
    parts = []
    for name, used in r.stranded.items():
        short = name.replace("pdserve-", "").replace("prefill-", "p").replace("decode-", "d")
        parts.append(f"{short}:{'?' if used is None else used}")
    return " ".join(parts)


def _key_figures(r: ScenarioResult) -> str:
    f = r.figures
    if r.name == "cancel":
        return (
            f"cut {f['cut']}; end after cut max {f['max_end_after_cut_ms']} ms; "
            f"router release max {f['max_release_after_cut_ms']} ms"
        )
    if r.name == "kill-router":
        return (
            f"{f['in_flight_at_kill']} in flight, {f['streams_held_at_kill']} streams held at "
            f"the kill, {f['held_after_kill']} entries after it; "
            f"all freed {f['freed_after_kill_s']} s after the kill (bound {f['free_bound_s']:g})"
        )
    if r.name.startswith("freeze"):
        return (
            f"{f['on_worker_at_freeze']} on {f['frozen']}: {f['on_worker_outcomes']}, last let "
            f"go {f['max_let_go_after_freeze_s']} s after the freeze; "
            f"{f['completed_while_frozen']} completed while frozen; "
            f"decode marked down: {f['decode_workers_marked_down']}"
        )
    if r.name == "drain-overrun":
        return (
            f"{f['ended_by_the_drain']} ended by the drain, last "
            f"{f['max_end_after_sigterm_s']} s after SIGTERM; exit {f['exit_code']} after "
            f"{f['exit_after_sigterm_s']} s; {len(f['log_problems'])} tracebacks"
        )
    if r.name == "router-restart-mismatch":
        return f"exit {f['exit_code']} after {f['failed_after_s']} s: {f['last_line'][:90]}"
    if r.name == "abusive-client":
        a = f["abuse"]
        return (
            f"p50 {f['p50_latency_alone_ms']} → {f['p50_latency_abused_ms']} ms "
            f"(x{f['p50_ratio']}); {a['slowloris_held_at_go']} half heads, "
            f"{sum(sum(v.values()) for v in a['outcomes'].values())} abusive requests"
        )
    if r.name.startswith("kill"):
        return (
            f"{f['in_flight_at_kill']} in flight; last ended "
            f"{f['max_end_after_kill_s']} s after the kill"
        )
    if r.name == "redis":
        return f"{f['requests_ended_while_down']} ended after the kill"
    if r.name == "stall":
        return (
            f"{f['stalled']} stalled, ended by {f['max_latency_failed_s']} s "
            f"(stall {f['stall_s']:g} s, lease {f['lease_s']:g} s)"
        )
    if r.name == "overload":
        rej, o, b = f["rejection_ms"], f["overload"], f["baseline"]
        return (
            f"unloaded TTFT {f['unloaded_ttft_ms']} ms; "
            f"cap {f['capacity_rps']}/s, queue {f['max_queue_len']}; reject p99 "
            f"{rej['p99']} ms max {rej['max']} ms ({rej['max_less_client_stalls']} less the "
            f"client's stalls); p99 TTFT {b['p99_ttft_ms']} → "
            f"{o['p99_ttft_ms']} ms (x{f['p99_ttft_ratio']})"
        )
    return ""


def print_table(results: Sequence[ScenarioResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pdserve chaos", show_lines=True)
    for col in (
        "scenario",
        "sent",
        "ok",
        "status",
        "hung",
        "lost",
        "stranded blocks",
        "recover s",
        "figures",
        "verdict",
    ):
        table.add_column(col, overflow="fold")
    for r in results:
        failed = [k for k, ok in r.checks.items() if not ok]
        verdict = "[green]pass[/]" if not failed else "[red]FAIL[/]: " + "; ".join(failed)
        table.add_row(
            r.name,
            str(r.sent),
            str(r.succeeded),
            " ".join(f"{k} {v}" for k, v in r.statuses.items()) or "-",
            str(r.hung),
            str(r.lost),
            _stranded_text(r),
            "-" if r.recover_s is None else f"{r.recover_s:.2f}",
            _key_figures(r),
            verdict,
        )
    Console(width=200).print(table)


def _y(r: ScenarioResult, o: Outcome) -> float:
    """What a panel plots for a request: its TTFT in the overload panel (the figure the
    scenario is about) when it had one, else its latency (a hung one at the top)."""
    if r.name == "overload" and o.ttft_s is not None:
        return o.ttft_s
    return o.latency_s or r.wall_s


def plot(results: Sequence[ScenarioResult], path: Path) -> None:
    """One panel per scenario: each request's latency (overload: TTFT) against its send
    time, by status; dashed lines mark the faults (overload: the 2x phase)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        OK: "tab:green",
        "CANCELLED": "tab:gray",
        ABORTED: "tab:blue",
        "UNAVAILABLE": "tab:orange",
        "SSE_ERROR": "tab:olive",
        "RESOURCE_EXHAUSTED": "tab:purple",
        HUNG: "tab:red",
        LOST: "black",
    }
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        outs = list(r.outcomes)
        if r.name == "overload":
            outs = [Outcome(**o) for o in r.figures.get("baseline_outcomes", [])] + outs
        for status in sorted({o.status for o in outs}):
            pts = [(o.sent_s, _y(r, o)) for o in outs if o.status == status]
            ax.scatter(
                *zip(*pts, strict=True), s=6, label=status, color=colors.get(status, "tab:brown")
            )
        for t in r.fault_s:
            ax.axvline(t, color="red", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylabel("TTFT / latency (s)" if r.name == "overload" else "latency (s)")
        ax.set_title(f"{r.name}: {r.fault}", fontsize=9)
        if outs:  # router-restart-mismatch sends no request
            ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("send time (s since the load started)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_to(path: Path) -> None:
    """Warnings (a worker died, a call failed: expected here) go to a file, not the table."""
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logs.formatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)


def machine() -> dict[str, Any]:
    import platform

    return {
        "cpus": os.cpu_count(),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# ---- entry points ----------------------------------------------------------------------------
def settle(ch: Chaos, timeout_s: float = 30.0) -> None:
    """Wait until the router has every worker in rotation again, so that one scenario's
    aftermath (a worker still being probed back after a kill or a freeze) is not the next
    one's starting point."""
    router = ch.rig.router
    assert router is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(w.healthy for w in router.prefill.workers + router.decode.workers):
            return
        time.sleep(0.1)


def run_scenarios(ch: Chaos, names: Sequence[str]) -> list[ScenarioResult]:
    results = []
    for name in names:
        settle(ch)
        t0 = time.perf_counter()
        print(f"pdserve chaos: {name} ...", file=sys.stderr, flush=True)
        res = SCENARIOS[name](ch)
        res.wall_s = round(time.perf_counter() - t0, 2)
        results.append(res)
    return results


def run(cfg: ChaosConfig) -> list[ScenarioResult]:
    """Stand up the rig (with redis-server), run `cfg.scenarios`, write and print results."""
    unknown = [s for s in cfg.scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"--scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    from pdserve.tools.faults import RedisProcess, Rig

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    _log_to(cfg.out_dir / "chaos.log")
    redis = RedisProcess(cfg.out_dir / "redis").start()
    rig = Rig(cfg.serve_config(redis.url))
    load_before = os.getloadavg()
    started = time.perf_counter()
    try:
        rig.start()
        ch = Chaos(cfg, rig, redis, random.Random(cfg.seed))
        results = run_scenarios(ch, cfg.scenarios)
    finally:
        rig.close()
        redis.kill()
    report = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": {**machine(), "load_avg_before": [round(x, 2) for x in load_before]},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "wall_s": round(time.perf_counter() - started, 1),
        "passed": all(r.passed for r in results),
        "scenarios": [r.to_json() for r in results],
    }
    (cfg.out_dir / "chaos.json").write_text(json.dumps(report, indent=1, default=str))
    plot(results, cfg.out_dir / "chaos.png")
    print_table(results)
    print(
        f"pdserve chaos: {report['wall_s']} s; results in {cfg.out_dir}/chaos.json, chaos.png",
        file=sys.stderr,
    )
    return results


def add_cli_args(p: argparse.ArgumentParser) -> None:
    d = ChaosConfig()
    p.add_argument("--out", default=str(d.out_dir), help="results directory (chaos.json, .png)")
    p.add_argument(
        "--scenarios", default=",".join(d.scenarios), help=f"comma list of {','.join(SCENARIOS)}"
    )
    p.add_argument(
        "--preset",
        default=d.preset,
        choices=["tiny", "small"],
        help="the generated model the rig serves",
    )
    p.add_argument(
        "--transport",
        default=d.transport,
        choices=SERVE_TRANSPORT_NAMES,
        help="KV transport between the pools",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of prompts, cut points and arrivals"
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=d.num_prefill,
        help="prefill pool size (1: freeze-prefill freezes the only prefill worker)",
    )
    p.add_argument(
        "--num-cancel",
        type=int,
        default=d.num_cancel,
        help="cancel scenario: requests cut at random points",
    )
    p.add_argument(
        "--num-kill",
        type=int,
        default=d.num_kill,
        help="requests per kill scenario and the redis scenario",
    )
    p.add_argument(
        "--overload-s",
        type=float,
        default=d.overload_s,
        help="overload scenario: seconds of arrivals at 2x capacity",
    )
    p.add_argument("--baseline-s", type=float, default=d.baseline_s, help="the 0.8x phase")
    p.add_argument(
        "--freeze-s", type=float, default=d.freeze_s, help="freeze-*: how long the SIGSTOP lasts"
    )
    p.add_argument(
        "--kill-concurrency",
        type=int,
        default=d.kill_concurrency,
        help="kill-* and freeze-*: requests in flight at once",
    )
    p.add_argument("--lease-s", type=float, default=d.lease_s, help="transfer.lease_s")
    p.add_argument(
        "--num-stalled",
        type=int,
        default=d.num_stalled,
        help="transfers the stall scenario holds back (0: the fault is off, the row fails)",
    )
    p.add_argument("--num-abuse", type=int, default=d.num_abuse, help="abusive-client's load")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument(
        "--hang-bound-s",
        type=float,
        default=d.hang_bound_s,
        help="a request with no end after this long counts as hung",
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_chaos(args: argparse.Namespace) -> int:
    """`pdserve chaos`: exit 0 when every scenario met its acceptance figures, else 1."""
    cfg = ChaosConfig(
        preset=args.preset,
        out_dir=Path(args.out),
        scenarios=tuple(s.strip() for s in args.scenarios.split(",") if s.strip()),
        seed=args.seed,
        transport=args.transport,
        num_prefill=args.prefill_workers,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        num_cancel=args.num_cancel,
        num_kill=args.num_kill,
        kill_concurrency=args.kill_concurrency,
        freeze_s=args.freeze_s,
        overload_s=args.overload_s,
        baseline_s=args.baseline_s,
        lease_s=args.lease_s,
        num_stalled=args.num_stalled,
        num_abuse=args.num_abuse,
        hang_bound_s=args.hang_bound_s,
        progress=not args.disable_tqdm,
    )
    return 0 if all(r.passed for r in run(cfg)) else 1
