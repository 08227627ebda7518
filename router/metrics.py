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

if TYPE_CHECKING:
    from router.service import ActiveRequest, Router

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


class RequestObserver:
    """The router's per-request hooks; this base does nothing (metrics off).

    `on_tokens` runs before the router updates `act.first_sent_s` / `act.last_sent_s`, so an
    observer sees the previous send time; `now` is `time.perf_counter()` like `act.arrival_s`.
    """

    def on_admit(self, act: ActiveRequest) -> None:
        pass

    def on_reject(self, code: grpc.StatusCode) -> None:
        pass

    def on_tokens(self, act: ActiveRequest, num_tokens: int, now: float) -> None:
        pass

    def on_complete(self, act: ActiveRequest, reason: str, now: float) -> None:
        pass


class RouterMetrics(RequestObserver):
    """prometheus-client metrics of one router; `install` attaches them."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.model_name = router.model_info.served_model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "role"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "Arrival at the router until the first token was sent.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between successive tokens sent (a batch of n tokens counts n gaps of 1/n).",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Arrival at the router until the request completed.",
            LATENCY_BUCKETS,
        )
        self.queue = hist(
            "request_queue_time_seconds",
            "Waiting for KV room on a decode worker plus waiting on the prefill worker.",
            LATENCY_BUCKETS,
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "The prompt pass on a prefill worker (disaggregated requests).",
            LATENCY_BUCKETS,
        )
        self.transfer = hist(
            "kv_transfer_seconds",
            "KV transfer time not hidden behind the prompt pass (disaggregated requests).",
            LATENCY_BUCKETS,
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Requests that completed, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused at admission, by gRPC status code name.",
            [*labels, "code"],
            registry=r,
        )
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries",
            "Prompt tokens looked up in a prefix cache (completed requests).",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits",
            "Prompt tokens served from a prefix cache (completed requests).",
            labels,
            registry=r,
        )
        self.registry.register(WorkerCollector(router, self.model_name))
        self._lv = (self.model_name, ROUTER_ROLE)

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

    def on_complete(self, act: ActiveRequest, reason: str, now: float) -> None:
        lv = self._lv
        self.e2e.labels(*lv).observe(max(now - act.arrival_s, 0.0))
        self.success.labels(*lv, reason).inc()
        t = act.timings
        if "queue_ms" in t:
            self.queue.labels(*lv).observe(t["queue_ms"] / 1e3)
        if "prefill_ms" in t:
            self.prefill.labels(*lv).observe(t["prefill_ms"] / 1e3)
        if "transfer_ms" in t:
            self.transfer.labels(*lv).observe(t["transfer_ms"] / 1e3)
        self.prefix_queries.labels(*lv).inc(len(act.request.prompt_token_ids))
        self.prefix_hits.labels(*lv).inc(act.cached_tokens)


class WorkerCollector(Collector):
    """Worker gauges and counters from the router's latest `WorkerStats`, at scrape time."""

    def __init__(self, router: Router, model_name: str) -> None:
        self.router = router
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # unchecked: names are produced by collect() only

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "role", "worker"]
        running = GaugeMetricFamily(
            PREFIX + "num_requests_running",
            "Requests in a worker's running batch (role=router: admitted, past the queue).",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting",
            "Requests waiting in a worker's scheduler (role=router: admitted, no token sent yet).",
            labels=labels,
        )
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of a worker's KV blocks in use (0..1; cached-free blocks count as free).",
            labels=labels,
        )
        preempt = CounterMetricFamily(
            PREFIX + "num_preemptions",
            "Requests preempted (recompute) on a worker.",
            labels=labels,
        )
        xbytes = CounterMetricFamily(
            PREFIX + "kv_transfer_bytes",
            "KV bytes pushed by a prefill worker.",
            labels=labels,
        )
        xfail = CounterMetricFamily(
            PREFIX + "kv_transfer_failures",
            "KV transfers that failed on a prefill worker.",
            labels=labels,
        )
        ws_bytes = GaugeMetricFamily(
            PREFIX + "decode_workspace_bytes",
            "Memory a worker's decode workspace holds (the batch's K/V, contiguous).",
            labels=labels,
        )
        ws_fallbacks = CounterMetricFamily(
            PREFIX + "decode_workspace_fallbacks",
            "Decode steps whose batch did not fit cache.decode_workspace_mib (pages gathered).",
            labels=labels,
        )
        r = self.router
        queued = r.num_queued
        running.add_metric(
            [self.model_name, ROUTER_ROLE, ROUTER_ROLE], max(len(r.active) - queued, 0)
        )
        waiting.add_metric([self.model_name, ROUTER_ROLE, ROUTER_ROLE], queued)
        for w in r.prefill.workers + r.decode.workers:
            s = w.stats
            if s is None:
                continue
            lv = [self.model_name, s.role, s.name]
            running.add_metric(lv, s.num_running)
            waiting.add_metric(lv, s.num_waiting)
            used = s.num_total_blocks - s.num_free_blocks
            usage.add_metric(lv, used / s.num_total_blocks if s.num_total_blocks else 0.0)
            preempt.add_metric(lv, s.num_preemptions_total)
            if s.role == "prefill" or "transfer_bytes_total" in s.extra:
                xbytes.add_metric(lv, s.extra.get("transfer_bytes_total", 0.0))
            if s.role == "prefill" or "transfer_failures_total" in s.extra:
                xfail.add_metric(lv, s.extra.get("transfer_failures_total", 0.0))
            if s.role != "prefill" and "decode_workspace_bytes" in s.extra:
                ws_bytes.add_metric(lv, s.extra["decode_workspace_bytes"])
                ws_fallbacks.add_metric(lv, s.extra.get("decode_workspace_fallbacks_total", 0.0))
        yield from (running, waiting, usage, preempt, xbytes, xfail, ws_bytes, ws_fallbacks)
