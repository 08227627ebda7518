"""The KV transfer's cost, measured and fitted: `pdserve profile`'s validation lane B.

A transfer of `bytes` is modelled as `α + bytes/β` (`pdserve.plan.sim.Transfer`): α the
fixed cost (the ticket's frame, the receiver's checks, the acknowledgement), β the rate.
For each transport that crosses processes, this process sends the pages of `blocks` KV blocks
of the profiled model to a receiving process (`kv_transfer.probe`), as a prefill worker
sends to a decode worker: `KVSender.send` to the receiver's acknowledgement, on a warm pair.
Sender and receiver are pinned to one core each where the host has two, as a 1P1D
deployment places them.

α and β are fitted on the `FIT` sizes alone; the `HELD_OUT` sizes, fixed here in advance and
never fitted, score the fit (MAPE with n). Both are measured in one run, interleaved in a new
order each round, so a drift of the machine's speed falls on both alike.

What must hold: a held-out size is none of the fitted sizes; each timed transfer lands in
full (a checksum of the pages is compared once per transport and size).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.config import ModelConfig
from pdserve.plan.measure import pinned
from pdserve.plan.stepmodel import ape, fit_relative

FIT: tuple[int, ...] = (1, 4, 16, 64, 256)
"""Blocks per fitted transfer (16 tokens each: 16 to 4096 prompt tokens)."""
HELD_OUT: tuple[int, ...] = (2, 8, 32, 128)
"""Blocks per held-out transfer: never fitted."""
QUICK_FIT: tuple[int, ...] = (1, 16, 64)
QUICK_HELD_OUT: tuple[int, ...] = (8,)
REPEATS_PER_STEP_REPEAT = 4
"""Transfers are timed this many times more often than step shapes: a small one takes a few
milliseconds, where a thread's wake-up is a large share, so its median needs more samples."""
TRANSPORTS: tuple[str, ...] = ("torch_dist", "grpc")
"""The transports that cross processes (`local` is one process's copy)."""


Row = dict[str, Any]


def _fit_errors(rows: list[Row]) -> dict[str, Any]:
    errs = ape([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    return {
        "n": len(rows),
        "mape": round(float(np.mean(errs)), 2) if errs else None,
        "max_ape": round(max(errs), 2) if errs else None,
        "noise_pct": round(float(np.mean([r["spread_pct"] for r in rows])), 2) if rows else None,
    }


def fit_transfer(rows: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(α seconds, β bytes/s) from (bytes, seconds) medians, on relative error."""
    alpha, inv_beta = fit_relative([(1.0, float(b)) for b, _ in rows], [t for _, t in rows])
    return alpha, (1.0 / inv_beta if inv_beta > 0 else float("inf"))


def profile_transfer(
    model: ModelConfig,
    dtype: str,
    block_size: int,
    kv_bytes_per_block: int,
    transports: Sequence[str] = TRANSPORTS,
    quick: bool = False,
    repeats: int = 20,
    progress: Callable[[str], None] = lambda _: None,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure, fit and score each transport; the record `pdserve profile` writes."""
    from kv_transfer.probe import PageReceiver, PageSender, PeerProcess
    from protos.pdserve.v1 import kv_transfer_pb2 as pb

    fit_sizes, held_sizes = (QUICK_FIT, QUICK_HELD_OUT) if quick else (FIT, HELD_OUT)
    sizes = [*fit_sizes, *held_sizes]
    blocks = max(sizes)
    allowed = sorted(os.sched_getaffinity(0))
    rx_cores = [allowed[1 if len(allowed) > 1 else 0]]
    times: dict[tuple[str, int], list[float]] = {(t, n): [] for t in transports for n in sizes}
    rng = random.Random(seed)
    tx = PageSender()
    with pinned(1):
        rx = PeerProcess(mp.get_context("spawn"), "profile-kv-rx", PageReceiver, 1, rx_cores)
        try:
            pages: dict[str, Any] = {
                "model": model,
                "block_size": block_size,
                "num_blocks": blocks,
                "dtype": dtype,
            }
            rx.call("setup_pages", **pages)
            tx.setup_pages(seed=seed, **pages)
            for t in transports:
                rx.call("listen", key=t, transport=t)

            def once(t: str, n: int, check: bool = False) -> float:
                ticket = rx.call("reserve", key=t, num_tokens=n * block_size)
                tid = pb.TransferTicket.FromString(ticket).transfer_id
                src = list(range(n))
                dt = tx.send(t, ticket, src)
                got = rx.call("release", key=t, transfer_id=tid, want_checksum=check)
                if check and got != tx.checksum(src):
                    raise RuntimeError(f"{t}: {n} blocks arrived corrupted")
                return dt

            for t in transports:  # warm-up: connect, first frames; checked once per size
                for n in sizes:
                    once(t, n, check=True)
            order = [(t, n) for t in transports for n in sizes]
            for r in range(repeats):
                rng.shuffle(order)
                for t, n in order:
                    progress(f"{t} {n} blocks ({r + 1}/{repeats})")
                    times[(t, n)].append(once(t, n))
        finally:
            tx.close()
            rx.stop()
    out: dict[str, Any] = {}
    for t in transports:
        stats = {n: _median_spread(times[(t, n)]) for n in sizes}
        alpha, beta = fit_transfer([(n * kv_bytes_per_block, stats[n][0]) for n in fit_sizes])

        fit_rows, held_rows = (
            _rows(ns, stats, kv_bytes_per_block, alpha, beta) for ns in (fit_sizes, held_sizes)
        )
        out[t] = {
            "alpha_s": alpha,
            "beta_bytes_per_s": beta,
            "fit": _fit_errors(fit_rows),
            "held_out": _fit_errors(held_rows),
            "samples": {"fit": fit_rows, "held_out": held_rows},
        }
    return out


def _rows(
    blocks: Sequence[int],
    stats: dict[int, tuple[float, float]],
    kv_bytes_per_block: int,
    alpha: float,
    beta: float,
) -> list[Row]:
    return [
        {
            "blocks": n,
            "bytes": n * kv_bytes_per_block,
            "measured_ms": round(stats[n][0] * 1e3, 3),
            "spread_pct": round(stats[n][1] * 100, 1),
            "predicted_ms": round((alpha + n * kv_bytes_per_block / beta) * 1e3, 3),
        }
        for n in blocks
    ]


def _median_spread(xs: Sequence[float]) -> tuple[float, float]:
    """The median, and the interquartile range over it (the machine's noise)."""
    m = float(np.median(xs))
    q1, q3 = np.percentile(xs, [25, 75])
    return m, float((q3 - q1) / m)
