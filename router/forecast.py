"""The planner's forecast floor: the fewest workers per role that a measured profile says
the observed load needs (`planner.profile`; the issue's second loop, beside the reactive
+-1 correction in `router.planner`).

From `pdserve profile`'s step-time model (`StepTimes`, built from the profile above the
router: `pdserve.plan.plan.forecast_floor`) and the window's load
(arrival rate, prompt tokens not served from the prefix cache, output tokens):

- a prefill worker runs one prompt pass per step in the worst case, so its busy share is
  rate x the mean pass time; the floor keeps it at `UTILIZATION` at most, with the prompt
  tokens already queued worked off within `BACKLOG_S` on top (after a load step the queue
  it built must drain, not only stop growing);
- a decode worker holds the largest batch whose step, at the mean context, stays within the
  TPOT bound; it then emits batch / step tokens a second, and the floor keeps the tokens
  asked for (rate x mean output) at `UTILIZATION` of that.

What must hold: the floor never exceeds a role's `max_*` nor falls below its `min_*` (the
planner clamps it), and it is advisory as much as the planner is: it asks through the same
decision path, one decision at a time (a decision may start several workers at once). Its
rate is the window's arrivals, not its completions, which lag a step by the queue it
builds. It is a steady-state model apart from the backlog term: no burst term (the
reactive loop covers it), and it says so in its reason. Where no profile is given the
planner runs the reactive loop alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

UTILIZATION = 0.7
"""The busy share the floor sizes each role for: headroom for bursts and queueing."""
MAX_BATCH = 512
"""The largest decode batch the floor considers."""
BACKLOG_S = 10.0
"""The prompt tokens queued now are worked off within this long, on top of the arrivals."""


@dataclass(frozen=True)
class Floor:
    """The workers each role needs at `rate_rps`, and why."""

    prefill: int
    decode: int
    rate_rps: float
    reason: str


class StepTimes(Protocol):
    """A worker's step times, as a profile's model predicts them (`pdserve.plan.plan.
    forecast_floor` builds one from a `pdserve profile` JSON; the router reads no profile)."""

    def prefill_s(self, tokens: int) -> float:
        """One step that computes a prompt of `tokens` uncached tokens."""
        ...

    def decode_s(self, batch: int, ctx: int) -> float:
        """One decode step of `batch` rows at `ctx` tokens of context each."""
        ...


@dataclass(frozen=True)
class ForecastFloor:
    """A worker size's step times, and the TPOT bound it sizes decode for."""

    times: StepTimes
    tpot_s: float
    threads: int

    def floor(
        self,
        rate_rps: float,
        uncached_prompts: Sequence[int],
        outputs: Sequence[int],
        queued_tokens: int | None = None,
    ) -> Floor:
        """Workers per role for `rate_rps` requests a second of these lengths (the window's
        requests: their uncached prompt tokens and output tokens), and `queued_tokens`
        prompt tokens waiting for a prefill worker now."""
        if rate_rps <= 0 or not outputs:
            return Floor(0, 0, rate_rps, "no load")
        passes = [self.times.prefill_s(max(n, 1)) for n in uncached_prompts]
        pass_s = sum(passes) / len(passes) if passes else 0.0
        mean_prompt = sum(uncached_prompts) / max(len(uncached_prompts), 1)
        queued = (queued_tokens or 0) / max(mean_prompt, 1.0)  # prompts waiting, about
        backlog_s = queued * pass_s
        prefill = math.ceil((rate_rps * pass_s + backlog_s / BACKLOG_S) / UTILIZATION)
        mean_out = sum(outputs) / len(outputs)
        ctx = max(1, round(mean_prompt + mean_out / 2))
        batch, step_s = self._batch_within(ctx)
        tokens_per_s = batch / step_s
        # the queued prompts reach decode as the backlog is worked off: on top of the rate
        decode_rps = rate_rps + queued / BACKLOG_S
        decode = math.ceil(decode_rps * mean_out / tokens_per_s / UTILIZATION)
        backlog = f", {backlog_s:.1f} s of prompts queued" if backlog_s > 0 else ""
        reason = (
            f"{rate_rps:.2f} req/s{backlog}: prompt pass {pass_s * 1e3:.0f} ms, decode "
            f"batch {batch} in {step_s * 1e3:.0f} ms steps at {ctx} tokens of context "
            f"({self.threads}-thread workers at {UTILIZATION:.0%}, steady state)"
        )
        return Floor(prefill, decode, rate_rps, reason)

    def _batch_within(self, ctx: int) -> tuple[int, float]:
        """The largest batch (at least 1) whose step at `ctx` tokens each stays within the
        TPOT bound, and that step's time (the step time grows with the batch)."""

        def step(b: int) -> float:
            return self.times.decode_s(b, ctx)

        lo, hi = 1, MAX_BATCH
        if step(hi) <= self.tpot_s:
            return hi, step(hi)
        while lo < hi:  # the largest b with step(b) <= bound (or 1)
            mid = (lo + hi + 1) // 2
            if step(mid) <= self.tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo, step(lo)
