"""Step times of the real engine at chosen batch shapes (what `pdserve profile` fits).

Each scenario sets up the engine's state without running a step (cached prefixes and
running streams admitted as a decode worker admits them, `Driver`), then times the steps it
is about: `LLMEngine.step`
whole (schedule, forward, sampling, postprocess), the shape read from the scheduler's own
output. Prompts are random token ids, fresh for every repeat, so a repeat never hits the
cache a previous one wrote except where a scenario means it to (its prefix).

What must hold: a timed step's shape is the one the scheduler ran (`StepResult.shape`, not
assumed from the scenario), so a scenario that the scheduler splits differently still
yields true samples.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from pdserve.plan.stepmodel import StepShape

_IDS = itertools.count()


@dataclass(frozen=True)
class Scenario:
    """`prefill`: one step of prompt chunks, each (new tokens, cached prefix tokens);
    `decode`: `steps` decode steps of `batch` streams whose prompts have `ctx` tokens;
    `mixed`: the same streams plus one prompt of `chunk` tokens, one step."""

    kind: str
    chunks: tuple[tuple[int, int], ...] = ()
    batch: int = 0
    ctx: int = 0
    chunk: int = 0
    steps: int = 1

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return "prefill " + "+".join(f"{n}@{c}" for n, c in self.chunks)
        if self.kind == "decode":
            return f"decode B={self.batch} ctx={self.ctx}"
        return f"mixed B={self.batch} ctx={self.ctx} + {self.chunk}"


@dataclass(frozen=True)
class Sample:
    shape: StepShape
    seconds: float
    scenario: str
    spread: float = 0.0  # its scenario's repeats: interquartile range / median (noise)


def timed_step(engine: LLMEngine, scenario: Scenario) -> Sample | None:
    """One `LLMEngine.step`, whole; its sample with the shape the scheduler ran."""
    t0 = time.perf_counter()
    result = engine.step()
    dt = time.perf_counter() - t0
    if result.phase is None:
        return None
    return Sample(StepShape(*result.shape), dt, scenario.label)


class Driver:
    """Runs scenarios on one engine; `rng` draws the prompts.

    Context is set up the way a decode worker admits a request prefilled elsewhere
    (`LLMEngine.add_prefilled` into blocks allocated for it): its K/V pages hold whatever
    they held, which costs a step the same time as computed K/V, and no prompt pass is run
    to build it. A cached prefix is such a request's blocks, committed and let go."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.model_config.vocab_size
        self.bs = engine.cache_config.block_size

    def _ids(self, n: int) -> list[int]:
        return self.rng.integers(4, self.vocab, size=n).tolist()

    def _params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"profile-{next(_IDS)}"
        self.engine.add_request(rid, prompt, self._params(max_tokens))
        return rid

    def _prefilled(self, prompt: list[int]) -> str:
        """A running stream whose prompt's K/V is (taken to be) in the cache already."""
        rid = f"profile-{next(_IDS)}"
        room = self.engine.max_model_len - len(prompt)
        req = self.engine.make_request(rid, prompt, self._params(room))
        self.engine.blocks.allocate(rid, [], len(prompt))
        self.engine.add_prefilled(req, [int(self._ids(1)[0])])
        return rid

    def _drain(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()

    def run(self, s: Scenario) -> list[Sample]:
        try:
            return self._run(s)
        finally:
            self._drain()

    def _run(self, s: Scenario) -> list[Sample]:
        if s.kind == "prefill":
            prompts = []
            for n, ctx in s.chunks:
                prefix = self._ids(ctx)
                if ctx:  # its blocks committed, then let go: cached, evictable
                    self.engine.abort(self._prefilled([*prefix, *self._ids(1)]))
                prompts.append([*prefix, *self._ids(n)])
            for p in prompts:
                self._add(p, 1)
            sample = timed_step(self.engine, s)
            return [sample] if sample else []
        for _ in range(s.batch):
            self._prefilled(self._ids(s.ctx))
        if s.kind == "mixed":
            self._add(self._ids(s.chunk), 1)
        samples = [timed_step(self.engine, s) for _ in range(s.steps if s.kind == "decode" else 1)]
        return [x for x in samples if x is not None]


def median_by_scenario(samples: Sequence[Sample]) -> list[Sample]:
    """One sample per scenario: its median time, with the shape of the step that took it
    (a decode scenario's steps differ by one token of context per row). A noisy machine's
    outliers fall out."""
    groups: dict[str, list[Sample]] = {}
    for x in samples:
        groups.setdefault(x.scenario, []).append(x)
    out = []
    for xs in groups.values():
        ordered = sorted(xs, key=lambda x: x.seconds)
        mid = ordered[(len(ordered) - 1) // 2]
        q1, q3 = np.percentile([x.seconds for x in xs], [25, 75])
        out.append(Sample(mid.shape, mid.seconds, mid.scenario, float((q3 - q1) / mid.seconds)))
    return out


def measure(
    driver: Driver,
    scenarios: Sequence[Scenario],
    repeats: int,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Sample]:
    """Every scenario `repeats` times, the scenarios interleaved in a new order each round
    (a drift of the machine's speed falls on all of them alike), then the median per
    scenario."""
    raw: list[Sample] = []
    order = list(scenarios)
    for r in range(repeats):
        driver.rng.shuffle(order)  # type: ignore[arg-type,unused-ignore]  # no fixed first
        for s in order:
            progress(f"{s.label} ({r + 1}/{repeats})")
            raw += driver.run(s)
    return median_by_scenario(raw)


@contextmanager
def pinned(cores: int) -> Iterator[list[int]]:
    """Run on the first `cores` CPUs this process may use (a worker pinned to its share of
    the host), restoring the affinity after."""
    before = sorted(os.sched_getaffinity(0))
    chosen = before[:cores]
    os.sched_setaffinity(0, chosen)
    try:
        yield chosen
    finally:
        os.sched_setaffinity(0, before)
