"""The step-time model: what one engine step costs, from the shape of its batch.

A step (`engine.scheduler.SchedulerOutput`) runs prompt chunks and decode rows in one
forward. Its wall time is modelled as a linear function of the batch's shape:

    t = a + k·chunks + b·Σn + c·Σn² + d·Σ(n·ctx) + e·B + f·Σctx_decode

- a prompt chunk of `n` tokens after `ctx` tokens already in the cache (a cached prefix, or
  the chunks before it) costs the body GEMMs (`Σn`), causal attention within itself (`Σn²`)
  and attention to what came before (`Σ(n·ctx)`), plus a fixed part per chunk (`chunks`: its
  logits row, its sampling, its bookkeeping);
- a decode row costs its GEMM row and sampling (`B`) and reads its context's K/V (`Σctx`).

A pure prefill step is `a + k + b·Σn + c·Σn² + d·Σ(n·ctx)`, a pure decode step
`a + e·B + f·Σctx`, a mixed step the sum: one model covers all three, so a mixed step needs
no terms of its own. Coefficients are fitted by least squares on the relative error (each
sample weighted by 1/t, what MAPE scores) and held non-negative: a negative cost fitted to
noise would predict a negative time off the grid.

What must hold: `features` reads only the batch's shape, so the profile, the simulator and
the validation compute it the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

TERMS = ("a", "chunks", "sum_n", "sum_n2", "sum_n_ctx", "batch", "sum_ctx")
"""The model's terms, in the order of `features` and `StepModel.coef`."""


@dataclass(frozen=True)
class StepShape:
    """One step's batch: (tokens, cached context) per prompt chunk, context per decode row."""

    chunks: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()

    def features(self) -> list[float]:
        ns = [n for n, _ in self.chunks]
        return [
            1.0,
            float(len(self.chunks)),
            float(sum(ns)),
            float(sum(n * n for n in ns)),
            float(sum(n * c for n, c in self.chunks)),
            float(len(self.decode)),
            float(sum(self.decode)),
        ]

    @property
    def kind(self) -> str:
        if self.chunks and self.decode:
            return "mixed"
        return "prefill" if self.chunks else "decode"

    def to_json(self) -> dict[str, list[int] | list[list[int]]]:
        return {"chunks": [list(c) for c in self.chunks], "decode": list(self.decode)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepShape:
        return cls(tuple((int(n), int(c)) for n, c in d["chunks"]), tuple(d["decode"]))


class StepCost(Protocol):
    """What the simulator needs of a step-time model: a fitted `StepModel`, or a device's
    `pdserve.plan.device.RooflineModel`."""

    def predict(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class StepModel:
    """Fitted coefficients (seconds per unit of each of `TERMS`)."""

    coef: tuple[float, ...]

    def predict(self, shape: StepShape) -> float:
        return float(np.dot(self.coef, shape.features()))

    def to_json(self) -> dict[str, float]:
        return dict(zip(TERMS, self.coef, strict=True))

    @classmethod
    def from_json(cls, d: dict[str, float]) -> StepModel:
        return cls(tuple(float(d[t]) for t in TERMS))


def fit(shapes: Sequence[StepShape], times_s: Sequence[float]) -> StepModel:
    """The step-time model of these samples (`fit_relative`)."""
    return StepModel(tuple(fit_relative([s.features() for s in shapes], times_s)))


def fit_relative(
    features: Sequence[Sequence[float]], times_s: Sequence[float], relative: bool = True
) -> list[float]:
    """Least squares on relative error (`relative`; else on absolute error, which keeps the
    mean), non-negative (terms a negative fit would give are dropped and the rest refitted,
    until none is negative). Terms no sample exercises (all zero) get 0."""
    x = np.array(features, dtype=np.float64)
    y = np.array(times_s, dtype=np.float64)
    if len(y) == 0 or np.any(y <= 0):
        raise ValueError("fit needs positive times")
    w = 1.0 / y if relative else np.ones_like(y)
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    while True:
        cols = x[:, active] * w[:, None]
        scale = np.abs(cols).max(axis=0)  # the terms differ by 10^7 in size
        sol, *_ = np.linalg.lstsq(cols / scale, y * w, rcond=None)
        sol = sol / scale
        negative = [active[i] for i, v in enumerate(sol) if v < 0]
        if not negative:
            break
        # drop the most negative relative to its size first; the rest may then turn positive
        worst = min(range(len(sol)), key=lambda i: sol[i] * scale[i])
        active.pop(worst)
    coef = [0.0] * x.shape[1]
    for j, v in zip(active, sol, strict=True):
        coef[j] = float(v)
    return coef


def ape(predicted: Iterable[float], measured: Iterable[float]) -> list[float]:
    """Absolute percentage errors, in percent."""
    return [abs(p - m) / m * 100.0 for p, m in zip(predicted, measured, strict=True)]


def mape(predicted: Iterable[float], measured: Iterable[float]) -> float:
    errors = ape(predicted, measured)
    return float(np.mean(errors)) if errors else float("nan")
