"""SLO attainment and goodput (DistServe's measure), shared by `pdserve plan` and the
benchmarks that measure it (`benchmarks/serving.py`, `make bench-plan`).

Attainment at a rate: the share of requests that met both the TTFT and the TPOT bound (a
failed request misses). Goodput: the highest rate whose attainment is at least the target
(90 %), the first downward crossing of the curve, interpolated between the two rates around
it.
"""

from __future__ import annotations

from typing import Any

TARGET = 0.9


def goodput(rates: list[float], attained: list[float], target: float = TARGET) -> dict[str, Any]:
    """Highest rate with attainment >= target: the first downward crossing, interpolated.
    `bound`: "interpolated", "below_sweep" (the lowest rate already misses) or "lower" (the
    highest rate still meets it: goodput is at least that)."""
    if attained[0] < target:
        return {"rps": None, "bound": "below_sweep", "note": f"< {rates[0]:.3g} req/s"}
    for k in range(1, len(rates)):
        if attained[k] < target:
            r0, r1, a0, a1 = rates[k - 1], rates[k], attained[k - 1], attained[k]
            rps = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
            return {"rps": rps, "bound": "interpolated", "note": f"{rps:.3g} req/s"}
    return {"rps": rates[-1], "bound": "lower", "note": f">= {rates[-1]:.3g} req/s"}


def parse_slo(text: str) -> tuple[float, float]:
    """`ttft=MS,tpot=MS` -> (TTFT bound s, TPOT bound s); an error names what is wrong."""
    got: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot"):
            raise ValueError(f"--slo: expected ttft=MS,tpot=MS, got {text!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} is not a number: {value!r}") from None
        if ms <= 0:
            raise ValueError(f"--slo: {key} must be positive")
        got[key] = ms / 1e3
    if set(got) != {"ttft", "tpot"}:
        raise ValueError("--slo: both ttft and tpot are needed, e.g. ttft=2000,tpot=100")
    return got["ttft"], got["tpot"]
