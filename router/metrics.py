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

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.request import FinishReason
from router.active import ActiveRequest, RequestObserver

if TYPE_CHECKING:
    from router.core import Router

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


_ROUTER_LABELS = ("model_name", "role")
_WORKER_LABELS = ("model_name", "role", "worker")


class RouterMetrics(RequestObserver):
    """prometheus-client metrics of one router; `install` attaches them.

    The per-request metrics are labelled ``(model_name, role="router")``; the counters of
    finish reasons and rejections add one label each. They are registered histograms first,
    then counters, then the worker collector: the order a scrape lists them in.
    """

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    transfer: Histogram
    success: Counter
    rejected: Counter
    prefix_queries: Counter
    prefix_hits: Counter

    def __init__(self, router: Router) -> None:
        self.router = router
        self.model_name = router.model_info.served_model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._add_histograms()
        self._add_counters()
        self.registry.register(WorkerCollector(router, self.model_name))
        self._lv = (self.model_name, ROUTER_ROLE)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            PREFIX + name, doc, list(_ROUTER_LABELS), buckets=buckets, registry=self.registry
        )

    def _counter(self, name: str, doc: str, *extra_labels: str) -> Counter:
        labels = [*_ROUTER_LABELS, *extra_labels]
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _add_histograms(self) -> None:
        """The per-request latencies, in seconds."""
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Arrival at the router until the first token was sent.",
            TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between successive tokens sent (a batch of n tokens counts n gaps of 1/n).",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Arrival at the router until the request completed.",
            LATENCY_BUCKETS,
        )
        self.queue = self._histogram(
            "request_queue_time_seconds",
            "Waiting for KV room on a decode worker plus waiting on the prefill worker.",
            LATENCY_BUCKETS,
        )
        self.prefill = self._histogram(
            "request_prefill_time_seconds",
            "The prompt pass on a prefill worker (disaggregated requests).",
            LATENCY_BUCKETS,
        )
        self.transfer = self._histogram(
            "kv_transfer_seconds",
            "KV transfer time not hidden behind the prompt pass (disaggregated requests).",
            LATENCY_BUCKETS,
        )

    def _add_counters(self) -> None:
        """Completions, rejections and prefix-cache tokens."""
        self.success = self._counter(
            "request_success", "Requests that completed, by finish reason.", "finished_reason"
        )
        self.rejected = self._counter(
            "request_rejected", "Requests refused at admission, by gRPC status code name.", "code"
        )
        self.prefix_queries = self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in a prefix cache (completed requests).",
        )
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens served from a prefix cache (completed requests)."
        )

    @classmethod
    def install(cls, router: Router) -> RouterMetrics:
        """Attach metrics to `router` (idempotent) and return them."""
        if isinstance(router.metrics, RouterMetrics):
            return router.metrics
        m = cls(router)
        router.metrics = m
        return m

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- hooks ---------------------------------------------------------------------------
    def on_reject(self, code: grpc.StatusCode) -> None:
        self.rejected.labels(*self._lv, code.name).inc()

    def on_tokens(self, act: ActiveRequest, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        if act.first_sent_s is None:
            self.ttft.labels(*self._lv).observe(max(now - act.arrival_s, 0.0))
            num_tokens -= 1
            prev = now
        else:
            prev = act.last_sent_s if act.last_sent_s is not None else now
        if num_tokens > 0:
            gap = max(now - prev, 0.0) / num_tokens
            itl = self.itl.labels(*self._lv)
            for _ in range(num_tokens):
                itl.observe(gap)

    def on_complete(self, act: ActiveRequest, reason: FinishReason, now: float) -> None:
        lv = self._lv
        self.e2e.labels(*lv).observe(max(now - act.arrival_s, 0.0))
        self.success.labels(*lv, reason.value).inc()
        t = act.timings
        stages = (
            (self.queue, t.queue_ms),
            (self.prefill, t.prefill_ms),
            (self.transfer, t.transfer_ms),
        )
        for hist, ms in stages:
            if ms is not None:
                hist.labels(*lv).observe(ms / 1e3)
        self.prefix_queries.labels(*lv).inc(len(act.request.prompt_token_ids))
        self.prefix_hits.labels(*lv).inc(act.cached_tokens)


class _WorkerFamilies:
    """One scrape's worker metric families, labelled ``(model_name, role, worker)``; built
    fresh per scrape (a family holds the samples added to it)."""

    def __init__(self) -> None:
        self.running = _gauge(
            "num_requests_running",
            "Requests in a worker's running batch (role=router: admitted, past the queue).",
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

    def all(self) -> tuple[Metric, ...]:
        """Every family, in the order a scrape lists them."""
        return (
            self.running,
            self.waiting,
            self.usage,
            self.preempt,
            self.xbytes,
            self.xfail,
            self.ws_bytes,
            self.ws_fallbacks,
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
        for w in r.prefill.workers + r.decode.workers:
            s = w.stats
            if s is None:
                continue
            lv = [self.model_name, s.role, s.name]
            f.running.add_metric(lv, s.num_running)
            f.waiting.add_metric(lv, s.num_waiting)
            used = s.num_total_blocks - s.num_free_blocks
            f.usage.add_metric(lv, used / s.num_total_blocks if s.num_total_blocks else 0.0)
            f.preempt.add_metric(lv, s.num_preemptions_total)
            if s.role == "prefill" or "transfer_bytes_total" in s.extra:
                f.xbytes.add_metric(lv, s.extra.get("transfer_bytes_total", 0.0))
            if s.role == "prefill" or "transfer_failures_total" in s.extra:
                f.xfail.add_metric(lv, s.extra.get("transfer_failures_total", 0.0))
            if s.role != "prefill" and "decode_workspace_bytes" in s.extra:
                f.ws_bytes.add_metric(lv, s.extra["decode_workspace_bytes"])
                f.ws_fallbacks.add_metric(lv, s.extra.get("decode_workspace_fallbacks_total", 0.0))
        yield from f.all()
