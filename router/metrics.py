"""Prometheus metrics for the router's `/metrics` (docs/http.md), vLLM-style names.

Two sources, one scrape target:

- Per-request metrics are recorded by the router itself: `Router.metrics` is a
  `RequestObserver` whose hooks the router calls at admit, reject, each batch of tokens sent,
  and completion. `RouterMetrics` implements them with prometheus-client histograms and
  counters, labelled ``model_name`` and ``role="router"``.
- Worker metrics (running, waiting, preemptions, KV usage, transfer bytes and failures) are
  read at scrape time from the `WorkerStats` the router's background refresh already keeps
  for routing, labelled ``role=prefill|decode|colocated`` and ``worker=<name>``.

Every name carries the ``pdserve:`` prefix. Each `RouterMetrics` has its own registry, so
several routers in one process (tests) never collide.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.request import FinishReason
from pool_api.messages import Role, StatKey
from router.active import ActiveRequest, RequestObserver
from router.stats_log import StatsLog

if TYPE_CHECKING:
    from router.core import Router
    from router.membership import PoolAdmin
    from router.planner import Planner

PREFIX = "pdserve:"
ROUTER_ROLE = "router"

# vLLM's buckets, extended downwards: a tiny model on CPU answers in milliseconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


TOKEN_BUCKETS_MAX = 1 << 20  # cap on the 1-2-5 token-count buckets (max_context_length)
# 1 kB .. 50 GB: one request's KV (a small model's short prompt .. a long context's).
BYTES_BUCKETS = tuple(float(m * 10**e) for e in range(3, 11) for m in (1, 2, 5))

_ROUTER_LABELS = ("model_name", "role")
_WORKER_LABELS = ("model_name", "role", "worker")
# vLLM's cache_config_info label names where they apply (plus who the row is).
_CACHE_INFO_LABELS = (
    *_WORKER_LABELS,
    "block_size",
    "num_gpu_blocks",
    "cache_dtype",
    "enable_prefix_caching",
)


def one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > limit:
                return tuple(out)
            out.append(float(v))
        exponent += 1


class RouterMetrics(RequestObserver):
    """prometheus-client metrics of one router; `install` attaches them.

    The per-request metrics are labelled ``(model_name, role="router")``; the counters of
    finish reasons and rejections add one label each. They are registered histograms first,
    then counters, then the worker collector: the order a scrape lists them in.
    """

    ttft: Histogram
    ttst: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    transfer: Histogram
    req_transfer_s: Histogram
    req_transfer_bytes: Histogram
    req_prompt: Histogram
    req_generation: Histogram
    success: Counter
    rejected: Counter
    failed: Counter
    placement: Counter
    prefix_queries: Counter
    prefix_hits: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    computed_tokens: Counter
    cached_tokens: Counter

    def __init__(self, router: Router) -> None:
        self.router = router
        self.model_name = router.model_info.served_model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._lv = (self.model_name, ROUTER_ROLE)
        self._add_latency_histograms()
        self._add_request_histograms()
        self._add_counters()
        self._add_token_counters()
        self.registry.register(WorkerCollector(router, self.model_name))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            PREFIX + name, doc, list(_ROUTER_LABELS), buckets=buckets, registry=self.registry
        )

    def _counter(self, name: str, doc: str, *extra_labels: str) -> Counter:
        labels = [*_ROUTER_LABELS, *extra_labels]
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _add_latency_histograms(self) -> None:
        """The per-request latencies, in seconds."""
        h = self._histogram
        self.ttft = h(
            "time_to_first_token_seconds",
            "Arrival at the router until the first token was sent.",
            TTFT_BUCKETS,
        )
        self.ttst = h(
            "time_to_second_token_seconds",
            "First token sent until the second was (the prefill-to-decode handover).",
            TTFT_BUCKETS,
        )
        self.itl = h(
            "inter_token_latency_seconds",
            "Time between successive tokens sent (a batch of n tokens counts n gaps of 1/n).",
            ITL_BUCKETS,
        )
        self.tpot = h(
            "request_time_per_output_token_seconds",
            "Per request: (e2e - TTFT) / (output tokens - 1); requests of 2+ tokens.",
            ITL_BUCKETS,
        )
        self.e2e = h(
            "e2e_request_latency_seconds",
            "Arrival at the router until the request completed.",
            LATENCY_BUCKETS,
        )
        self.queue = h(
            "request_queue_time_seconds",
            "Waiting for KV room on a decode worker plus waiting on the prefill worker.",
            LATENCY_BUCKETS,
        )
        self.prefill = h(
            "request_prefill_time_seconds",
            "The prompt pass on a prefill worker (disaggregated requests).",
            LATENCY_BUCKETS,
        )
        self.transfer = h(
            "kv_transfer_seconds",
            "KV transfer time not hidden behind the prompt pass (disaggregated requests).",
            LATENCY_BUCKETS,
        )

    def _add_request_histograms(self) -> None:
        """Per-request sizes, and the whole KV transfer of a disaggregated request."""
        tokens = one_two_five(
            min(max(self.router.model_info.max_context_length, 1), TOKEN_BUCKETS_MAX)
        )
        self.req_prompt = self._histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", tokens
        )
        self.req_generation = self._histogram(
            "request_generation_tokens", "Tokens sent for a finished request.", tokens
        )
        self.req_transfer_bytes = self._histogram(
            "request_kv_transfer_bytes",
            "KV payload bytes a prefill worker pushed for one request (disaggregated).",
            BYTES_BUCKETS,
        )
        self.req_transfer_s = self._histogram(
            "request_kv_transfer_seconds",
            "One request's whole KV transfer, first push until acknowledged (overlaps the "
            "prompt pass; disaggregated requests).",
            TTFT_BUCKETS,
        )

    def _add_counters(self) -> None:
        """Completions, rejections and prefix-cache tokens."""
        self.success = self._counter(
            "request_success",
            "Requests finished, by finish reason (abort: aborted, or its client left).",
            "finished_reason",
        )
        self.rejected = self._counter(
            "request_rejected", "Requests refused at admission, by gRPC status code name.", "code"
        )
        self.failed = self._counter(
            "request_failure",
            "Admitted requests that ended with an error status instead of a completion (a "
            "worker failure, a drain that ran out), by gRPC status code name.",
            "code",
        )
        # exported at 0 from the start, so that a rate over it has a series before the first
        # failure (the dashboard's)
        self.failed.labels(*self._lv, grpc.StatusCode.UNAVAILABLE.name)
        self.placement = self._counter(
            "request_prefill_placement",
            "Finished requests by where their prompt pass ran (router.active.Placement): "
            "disaggregated, or on the decode worker: colocated, short_prompt, overflow, "
            "no_prefill_worker.",
            "placement",
        )
        self.prefix_queries = self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in a prefix cache (finished requests).",
        )
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens served from a prefix cache (finished requests)."
        )

    def _add_token_counters(self) -> None:
        """Token throughput: prompts at their first token, output tokens as they are sent."""
        self.prompt_tokens = self._counter(
            "prompt_tokens", "Prompt tokens prefilled (counted at a request's first token)."
        )
        self.generation_tokens = self._counter(
            "generation_tokens", "Output tokens sent to clients."
        )
        self.computed_tokens = self._counter(
            "prefill_tokens_computed",
            "Prompt tokens the prompt pass computed (prompt_tokens less the cached ones).",
        )
        self.cached_tokens = self._counter(
            "prefill_tokens_cached", "Prompt tokens the prompt pass reused from a prefix cache."
        )

    @classmethod
    def install(cls, router: Router) -> RouterMetrics:
        """Attach metrics to `router` (idempotent) and return them; with
        `router.stats_log_interval_s`, also the stats line `Router.start` runs."""
        found = router.metrics.find(cls)
        if found is not None:
            return found
        m = cls(router)
        router.metrics.add(m, first=True)
        if router.cfg.stats_log_interval_s > 0 and router.stats_log is None:
            router.stats_log = StatsLog(m.registry, router.cfg.stats_log_interval_s)
        return m

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- hooks ---------------------------------------------------------------------------
    def on_reject(self, code: grpc.StatusCode) -> None:
        self.rejected.labels(*self._lv, code.name).inc()

    def on_fail(self, act: ActiveRequest, code: grpc.StatusCode, now: float) -> None:
        self.failed.labels(*self._lv, code.name).inc()

    def on_tokens(self, act: ActiveRequest, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        self.generation_tokens.labels(*self._lv).inc(num_tokens)
        if act.first_sent_s is None:
            self._first_token(act, now)
            num_tokens -= 1
            prev = now
            if num_tokens > 0:  # the second token came in the same batch
                self.ttst.labels(*self._lv).observe(0.0)
        else:
            prev = act.last_sent_s if act.last_sent_s is not None else now
            if act.num_sent == 1:
                self.ttst.labels(*self._lv).observe(max(now - act.first_sent_s, 0.0))
        if num_tokens > 0:
            gap = max(now - prev, 0.0) / num_tokens
            itl = self.itl.labels(*self._lv)
            for _ in range(num_tokens):
                itl.observe(gap)

    def _first_token(self, act: ActiveRequest, now: float) -> None:
        """TTFT, and the prompt's tokens: the prompt pass is done."""
        lv = self._lv
        self.ttft.labels(*lv).observe(max(now - act.arrival_s, 0.0))
        n = act.num_prompt_tokens
        cached = min(act.cached_tokens, n)
        self.prompt_tokens.labels(*lv).inc(n)
        self.cached_tokens.labels(*lv).inc(cached)
        self.computed_tokens.labels(*lv).inc(n - cached)

    def on_complete(self, act: ActiveRequest, reason: FinishReason, now: float) -> None:
        lv = self._lv
        self.e2e.labels(*lv).observe(max(now - act.arrival_s, 0.0))
        self.success.labels(*lv, reason.value).inc()
        if act.placement is not None:
            self.placement.labels(*lv, act.placement).inc()
        t = act.timings
        stages = (
            (self.queue, t.queue_ms),
            (self.prefill, t.prefill_ms),
            (self.transfer, t.transfer_ms),
            (self.req_transfer_s, t.transfer_total_ms),
        )
        for hist, ms in stages:
            if ms is not None:
                hist.labels(*lv).observe(ms / 1e3)
        if t.transfer_ms is not None:  # it was disaggregated
            self.req_transfer_bytes.labels(*lv).observe(act.kv_transfer_bytes)
        self.prefix_queries.labels(*lv).inc(act.num_prompt_tokens)
        self.prefix_hits.labels(*lv).inc(act.cached_tokens)
        self.req_prompt.labels(*lv).observe(act.num_prompt_tokens)
        self.req_generation.labels(*lv).observe(act.num_sent)
        if act.first_sent_s is not None and act.num_sent > 1:
            decode_s = max(now - act.first_sent_s, 0.0)
            # n > 1: the choices decode side by side; a sequence's tokens set the pace
            per_seq = act.num_sent / act.num_seqs
            if per_seq > 1:
                self.tpot.labels(*lv).observe(decode_s / (per_seq - 1))


class _WorkerFamilies:
    """One scrape's worker metric families, labelled ``(model_name, role, worker)``; built
    fresh per scrape (a family holds the samples added to it)."""

    def __init__(self) -> None:
        self.running = _gauge(
            "num_requests_running",
            "Requests in a worker's running batch (role=router: admitted, past the queue).",
        )
        self.degraded = _gauge(
            "router_degraded",
            "1 while the router serves with part of its deployment down (GET /health says why).",
        )
        self.waiting = _gauge(
            "num_requests_waiting",
            "Requests waiting in a worker's scheduler (role=router: admitted, no token sent yet).",
        )
        self.usage = _gauge(
            "kv_cache_usage_perc",
            "Fraction of a worker's KV blocks in use (0..1; cached-free blocks count as free).",
        )
        self.preempt = _counter_family(
            "num_preemptions", "Requests preempted (recompute) on a worker."
        )
        self.xbytes = _counter_family("kv_transfer_bytes", "KV bytes pushed by a prefill worker.")
        self.xfail = _counter_family(
            "kv_transfer_failures", "KV transfers that failed on a prefill worker."
        )
        self.ws_bytes = _gauge(
            "decode_workspace_bytes",
            "Memory a worker's decode workspace holds (the batch's K/V, contiguous).",
        )
        self.ws_fallbacks = _counter_family(
            "decode_workspace_fallbacks",
            "Decode steps whose batch did not fit cache.decode_workspace_mib (pages gathered).",
        )
        self.steps = _counter_family(
            "engine_steps", "Engine steps that ran a forward pass on a worker."
        )
        self.step_seconds = _counter_family(
            "engine_step_seconds",
            "Wall time of those steps (schedule, forward, sampling, detokenize); against "
            "the worker's token counts it is the engine's share of the serving time.",
        )
        self.grammar_checked = _counter_family(
            "grammar_first_tokens_checked",
            "Constrained requests whose token #1, sampled under the grammar by a prefill "
            "worker, a decode worker's matcher accepted (checked, never recomputed).",
        )
        self.grammar_rejected = _counter_family(
            "grammar_rejections",
            "Constrained requests whose token #1 a decode worker's matcher refused (the two "
            "sides' grammars differ): they fail instead of decoding.",
        )
        self.kernel_ms = _kernel_family()
        self.cache_info = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "A worker's KV cache configuration, in its labels (value 1), as vLLM's.",
            labels=list(_CACHE_INFO_LABELS),
        )

    def all(self) -> tuple[Metric, ...]:
        """Every family, in the order a scrape lists them."""
        return (
            self.running,
            self.waiting,
            self.degraded,
            self.usage,
            self.preempt,
            self.xbytes,
            self.xfail,
            self.ws_bytes,
            self.ws_fallbacks,
            self.steps,
            self.step_seconds,
            self.grammar_checked,
            self.grammar_rejected,
            self.kernel_ms,
            self.cache_info,
        )


def _kernel_family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        PREFIX + "kernel_candidate_milliseconds",
        "A kernel candidate's median time at the model's shapes, as the worker's start-up "
        "selection measured it (chosen=true: the kernel it runs; untimed candidates, outside "
        "tolerance or not batch-invariant, are absent).",
        labels=[*_WORKER_LABELS, "op", "kernel", "chosen"],
    )


def _gauge(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(_WORKER_LABELS))


def _counter_family(name: str, doc: str) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=list(_WORKER_LABELS))


class WorkerCollector(Collector):
    """Worker gauges and counters from the router's latest `WorkerStats`, at scrape time."""

    def __init__(self, router: Router, model_name: str) -> None:
        self.router = router
        self.model_name = model_name

    def _cache_labels(self, num_blocks: int) -> tuple[str, ...]:
        """block_size, num_gpu_blocks, cache_dtype, enable_prefix_caching (always on)."""
        info = self.router.model_info
        return (str(info.block_size), str(num_blocks), info.dtype or "auto", "True")

    def describe(self) -> list[Metric]:
        return []  # unchecked: names are produced by collect() only

    def collect(self) -> Iterator[Metric]:
        """The router's own row (role=router), then one row per worker with stats. A worker
        reports transfer counters if it is a prefill worker or has them, and decode
        workspace metrics if it is not a prefill worker and has them."""
        f = _WorkerFamilies()
        r = self.router
        queued = r.num_queued
        router_lv = [self.model_name, ROUTER_ROLE, ROUTER_ROLE]
        f.running.add_metric(router_lv, max(len(r.active) - queued, 0))
        f.waiting.add_metric(router_lv, queued)
        f.degraded.add_metric(router_lv, 1.0 if r.serviceable() and r.degraded() else 0.0)
        for w in r.prefill.workers + r.decode.workers:
            s = w.stats
            if s is None:
                continue
            lv = [self.model_name, s.role.value, s.name]
            f.running.add_metric(lv, s.num_running)
            f.waiting.add_metric(lv, s.num_waiting)
            used = s.num_total_blocks - s.num_free_blocks
            f.usage.add_metric(lv, used / s.num_total_blocks if s.num_total_blocks else 0.0)
            f.preempt.add_metric(lv, s.num_preemptions_total)
            f.cache_info.add_metric([*lv, *self._cache_labels(s.num_total_blocks)], 1.0)
            for kt in s.kernels:
                if kt.median_ms is not None:
                    chosen = "true" if kt.chosen else "false"
                    f.kernel_ms.add_metric([*lv, kt.op, kt.kernel, chosen], kt.median_ms)
            x, k = s.extra, StatKey
            f.steps.add_metric(lv, x.get(k.ENGINE_STEPS_TOTAL.value, 0.0))
            f.step_seconds.add_metric(lv, x.get(k.ENGINE_STEP_SECONDS_TOTAL.value, 0.0))
            if s.role is Role.PREFILL or k.TRANSFER_BYTES_TOTAL.value in x:
                f.xbytes.add_metric(lv, x.get(k.TRANSFER_BYTES_TOTAL.value, 0.0))
            if s.role is Role.PREFILL or k.TRANSFER_FAILURES_TOTAL.value in x:
                f.xfail.add_metric(lv, x.get(k.TRANSFER_FAILURES_TOTAL.value, 0.0))
            if s.role is not Role.PREFILL:
                checked = x.get(k.GRAMMAR_FIRST_TOKENS_CHECKED_TOTAL.value, 0.0)
                f.grammar_checked.add_metric(lv, checked)
                f.grammar_rejected.add_metric(lv, x.get(k.GRAMMAR_REJECTIONS_TOTAL.value, 0.0))
            if s.role is not Role.PREFILL and k.DECODE_WORKSPACE_BYTES.value in x:
                f.ws_bytes.add_metric(lv, x[k.DECODE_WORKSPACE_BYTES.value])
                f.ws_fallbacks.add_metric(lv, x.get(k.DECODE_WORKSPACE_FALLBACKS_TOTAL.value, 0.0))
        yield from f.all()
        yield from _pool_families(self.model_name, r.admin)
        if r.planner is not None:
            yield from _planner_families(self.model_name, r.planner)


def _planner_families(model: str, planner: Planner) -> tuple[Metric, ...]:
    """The planner's decisions, its last signals and what it could not read."""
    decisions = CounterMetricFamily(
        PREFIX + "planner_decisions",
        "Planner decisions (hold, flip, add, drain) by mode (advisory: not carried out).",
        labels=["model_name", "action", "mode"],
    )
    for (action, mode), n in sorted(planner.decisions.items()):
        decisions.add_metric([model, action, mode], n)
    signal = GaugeMetricFamily(
        PREFIX + "planner_signal",
        "The planner's last signals (attainment shares, queued prompt tokens, decode KV "
        "free share, decode step ms, transfer backlog, length percentiles).",
        labels=["model_name", "signal"],
    )
    missing = GaugeMetricFamily(
        PREFIX + "planner_signal_missing",
        "1 for each signal the planner's last tick could not read (it held).",
        labels=["model_name", "signal"],
    )
    s = planner.last_signals
    if s is not None:
        for name, value in sorted(s.gauges().items()):
            signal.add_metric([model, name], value)
        for name in s.missing:
            missing.add_metric([model, name], 1.0)
    tick = GaugeMetricFamily(PREFIX + "planner_tick_seconds", "The last tick's time.",
                             labels=["model_name"])  # fmt: skip
    tick.add_metric([model], planner.tick_s)
    return decisions, signal, missing, tick


def _pool_families(model: str, admin: PoolAdmin) -> tuple[Metric, ...]:
    """The pools' shape (workers by role and state) and the operations on them
    (docs/operations.md), as an operator's dashboard or a planner reads them."""
    workers = GaugeMetricFamily(
        PREFIX + "pool_workers",
        "Workers in the router's pools, by role and state (serving, joining, draining, down).",
        labels=["model_name", "role", "state"],
    )
    counts = Tally((w["role"], w["state"]) for w in admin.status()["workers"])
    for (role, state), n in sorted(counts.items()):
        workers.add_metric([model, role, state], n)
    ops = CounterMetricFamily(
        PREFIX + "pool_operations",
        "Pool operations (add, drain, flip) by outcome.",
        labels=["model_name", "operation", "outcome"],
    )
    for (op, outcome), n in sorted(admin.num_ops.items()):
        ops.add_metric([model, op, outcome], n)
    return workers, ops
