"""The router's log lines for operators, as vLLM prints them (docs/http.md#metrics).

- `StatsLog`: every `router.stats_log_interval_s`, one line of throughput and load, computed
  from the `/metrics` registry itself (the same counters a scrape reads, never counted
  twice): prompt and generation tokens/s, requests running and waiting at the router, KV
  cache usage per pool, the prefix-cache hit rate and KV transfer GB/s over the interval.
- `RequestLog`: with `router.log_requests`, one INFO line per finished request: its id,
  token counts, finish reason (or failure), TTFT, e2e and workers. Never its prompt or text.

This module imports no other router module but `router.active`, so `router.core` can start
both without depending on `router.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from prometheus_client.core import Metric

from engine.request import FinishReason
from router.active import ActiveRequest, RequestObserver

log = logging.getLogger(__name__)
request_log = logging.getLogger(__name__ + ".requests")

PREFIX = "pdserve:"
ROUTER_ROLE = "router"
POOL_ROLES = ("prefill", "decode", "colocated")

# The router's own totals (role="router"), by sample name, that the line takes rates of.
_TOTALS = {
    PREFIX + "prompt_tokens_total": "prompt_tokens",
    PREFIX + "generation_tokens_total": "generation_tokens",
    PREFIX + "prefix_cache_queries_total": "prefix_queries",
    PREFIX + "prefix_cache_hits_total": "prefix_hits",
    PREFIX + "request_kv_transfer_bytes_sum": "kv_bytes",
}


class MetricSource(Protocol):
    """What the line reads: a prometheus-client registry (`RouterMetrics.registry`)."""

    def collect(self) -> Iterable[Metric]: ...


@dataclass
class Snapshot:
    """The registry's values the line needs, at one moment (`time.monotonic()`)."""

    at_s: float
    totals: dict[str, float] = field(default_factory=dict)
    running: float = 0.0
    waiting: float = 0.0
    usage: dict[str, list[float]] = field(default_factory=dict)  # pool role -> per worker

    @classmethod
    def of(cls, source: MetricSource, at_s: float) -> Snapshot:
        snap = cls(at_s, dict.fromkeys(_TOTALS.values(), 0.0))
        for family in source.collect():
            for s in family.samples:
                role = s.labels.get("role")
                if s.name in _TOTALS and role == ROUTER_ROLE:
                    snap.totals[_TOTALS[s.name]] += s.value
                elif s.name == PREFIX + "num_requests_running" and role == ROUTER_ROLE:
                    snap.running += s.value
                elif s.name == PREFIX + "num_requests_waiting" and role == ROUTER_ROLE:
                    snap.waiting += s.value
                elif s.name == PREFIX + "kv_cache_usage_perc" and role in POOL_ROLES:
                    snap.usage.setdefault(str(role), []).append(s.value)
        return snap

    def rate(self, prev: Snapshot, key: str) -> float:
        """Per second since `prev`."""
        elapsed = self.at_s - prev.at_s
        return (self.totals[key] - prev.totals[key]) / elapsed if elapsed > 0 else 0.0

    def active(self, prev: Snapshot) -> bool:
        """Anything happened since `prev`, or anything is in flight."""
        return bool(self.running or self.waiting) or any(
            self.totals[k] != prev.totals[k] for k in ("prompt_tokens", "generation_tokens")
        )


def stats_line(prev: Snapshot, cur: Snapshot) -> str:
    """vLLM's periodic line, plus pdserve's per-pool KV usage and KV transfer rate."""
    queries = cur.totals["prefix_queries"] - prev.totals["prefix_queries"]
    hits = cur.totals["prefix_hits"] - prev.totals["prefix_hits"]
    usage = ", ".join(
        f"{role} {100 * sum(v) / len(v):.1f}%" for role, v in sorted(cur.usage.items()) if v
    )
    return (
        f"Avg prompt throughput: {cur.rate(prev, 'prompt_tokens'):.1f} tokens/s, "
        f"Avg generation throughput: {cur.rate(prev, 'generation_tokens'):.1f} tokens/s, "
        f"Running: {cur.running:.0f} reqs, Waiting: {cur.waiting:.0f} reqs, "
        f"KV cache usage: {usage or 'n/a'}, "
        f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%, "
        f"KV transfer: {byte_rate(cur.rate(prev, 'kv_bytes'))}"
    )


def byte_rate(bytes_per_s: float) -> str:
    """1.2e9 -> '1.200 GB/s', 3.4e5 -> '340.0 kB/s': a small model's transfers (kilobytes a
    request) read as what they are, not as 0.000 GB/s."""
    for scale, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.{3 if unit == 'GB/s' else 1}f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


class StatsLog:
    """Logs `stats_line` every `interval_s` (INFO while there is traffic and one interval
    after; DEBUG when idle, as vLLM does); `Router.start` runs it."""

    def __init__(self, source: MetricSource, interval_s: float) -> None:
        assert interval_s > 0, "a stats log needs a positive interval"
        self.source = source
        self.interval_s = interval_s

    def snapshot(self) -> Snapshot:
        return Snapshot.of(self.source, time.monotonic())

    async def run(self) -> None:
        prev, was_active = self.snapshot(), False
        while True:
            await asyncio.sleep(self.interval_s)
            prev, was_active = self.log_once(prev, was_active)

    def log_once(self, prev: Snapshot, was_active: bool) -> tuple[Snapshot, bool]:
        """One line since `prev`; returns the new snapshot and whether it was active."""
        cur = self.snapshot()
        active = cur.active(prev)
        level = logging.INFO if active or was_active else logging.DEBUG
        log.log(level, "%s", stats_line(prev, cur))
        return cur, active


class RequestLog(RequestObserver):
    """One line per finished request at INFO (`router.log_requests`); never prompt text.
    The id is quoted (`%r`): a client-chosen id cannot forge a log line."""

    def on_complete(self, act: ActiveRequest, reason: FinishReason, now: float) -> None:
        fields = self._fields(act, now)
        request_log.info("request %r finished: %s, %s", act.request_id, reason.value, fields)

    def on_fail(self, act: ActiveRequest, code: grpc.StatusCode, now: float) -> None:
        request_log.info(
            "request %r failed: %s, %s", act.request_id, code.name, self._fields(act, now)
        )

    @staticmethod
    def _fields(act: ActiveRequest, now: float) -> str:
        first = act.first_sent_s
        ttft = f"{first - act.arrival_s:.3f}s" if first is not None else "-"
        return (
            f"prompt_tokens={act.num_prompt_tokens}, "
            f"cached_tokens={act.cached_tokens}, completion_tokens={act.num_sent}, "
            f"ttft={ttft}, e2e={now - act.arrival_s:.3f}s, "
            f"prefill_worker={act.prefill.name if act.prefill else '-'}, "
            f"decode_worker={act.decode.name if act.decode else '-'}"
        )
