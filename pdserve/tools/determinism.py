"""The determinism census: a request's greedy tokens must depend on the request alone.

Each prompt (a chat turn on the real model) is decoded greedily under seven conditions, and
every condition's tokens are compared with the cold run's, token for token:

- ``cold``: alone, nothing cached (a fresh `cache_salt`);
- ``cached``: alone again, its prompt blocks now served by the prefix cache;
- ``batched``: with 7 other prompts in the same steps (fresh salts: no cache hits);
- ``chunked``: alone, the prompt pass cut into 16-token chunks;
- ``disaggregated``: through a prefill worker and a decode worker (in process, the `local`
  KV transport), the first token sampled on one side and the rest on the other;
- ``n4``: choice 0 of ``n = 4`` seeded greedy choices, forked over shared blocks;
- ``preempted``: every prompt at once, a running request preempted (as by an empty KV
  pool) every third step and recomputed.

`make bench-determinism` runs 64 prompts (`pdserve.tools.determinism`); `make test` runs 16
(`tests/test_determinism.py`).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUBJECTS = (
    "France", "the moon", "photosynthesis", "a bicycle", "the ocean", "volcanoes", "honey bees",
    "the piano", "gravity", "rainbows", "coffee", "the Roman Empire", "electricity", "snow",
    "chess", "the internet",
)  # fmt: skip
TEMPLATES = (
    "What is {}?",
    "Explain {} in one sentence.",
    "Write a short poem about {}.",
    "Give me three facts about {}.",
)
CONDITIONS = ("cold", "cached", "batched", "chunked", "disaggregated", "n4", "preempted")


def prompts(count: int) -> list[str]:
    """`count` distinct chat questions (at most 64), the first 16 one per subject."""
    grid = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    assert count <= len(grid), f"at most {len(grid)} prompts"
    return ["What is the capital of France?", *grid[1:count]]


@dataclass
class Census:
    """Each condition's tokens per prompt, and where they differ from the cold run's."""

    dtype: str
    kernels: str
    max_tokens: int
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def mismatches(self) -> dict[str, list[int]]:
        """condition -> indices of the prompts whose tokens differ from the cold run's."""
        cold = self.tokens["cold"]
        return {
            c: [i for i, (a, b) in enumerate(zip(cold, toks, strict=True)) if a != b]
            for c, toks in self.tokens.items()
            if c != "cold"
        }

    def identical(self) -> bool:
        return not any(self.mismatches().values())

    def summary(self) -> str:
        n = len(self.tokens["cold"])
        rows = [f"{c}: {n - len(bad)}/{n} identical" + (f" (differ: {bad})" if bad else "")
                for c, bad in self.mismatches().items()]  # fmt: skip
        return f"census ({self.dtype}, {self.kernels}): " + "; ".join(rows)


def run(
    model_dir: Path,
    texts: Sequence[str],
    max_tokens: int = 16,
    dtype: str = "auto",
    progress: Callable[[str], None] | None = None,
    at_once: bool = False,
) -> Census:
    """The census over `texts` on the checkpoint in `model_dir` (module docstring).

    `at_once`: the chunked and disaggregated conditions (and the cache fill before the
    cached one) send every prompt together instead of one at a time. Their tokens must
    still equal the cold ones, which is the stronger claim (chunks or the handover, and
    batching), in a fraction of the time: the short census of `make test`. The full census
    keeps them apart, so that a difference names one cause."""
    from engine.config import CacheConfig, SchedulerConfig
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    def engine(num_blocks: int = 256, **sched: Any) -> LLMEngine:
        cfg = EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            cache=CacheConfig(num_blocks=num_blocks),
            scheduler=SchedulerConfig(**sched),
        )
        return LLMEngine.from_config(cfg)

    eng = engine()
    assert eng.tokenizer is not None, "the census needs a tokenizer (chat prompts)"
    ids = [eng.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    census = Census(
        str(eng.runner.model.dtype).removeprefix("torch."),
        eng.kernel_selection.line(),
        max_tokens,
    )
    counter = itertools.count()

    def generate(
        e: LLMEngine,
        batch: Sequence[list[int]],
        salted: bool,
        params: Any,
        after_step: Callable[[int], None] | None = None,
    ) -> list[Any]:
        reqs = [
            e.add_request(
                f"census-{next(counter)}", p, params, f"salt-{next(counter)}" if salted else ""
            )
            for p in batch
        ]
        steps = 0
        while e.has_unfinished():
            e.step()
            steps += 1
            if after_step is not None:
                after_step(steps)
        return reqs

    def one_by_one(e: LLMEngine, salted: bool) -> list[list[int]]:
        return [list(generate(e, [p], salted, greedy)[0].output_token_ids) for p in ids]

    def alone_or_at_once(e: LLMEngine, salted: bool) -> list[list[int]]:
        if not at_once:
            return one_by_one(e, salted)
        return [list(r.output_token_ids) for r in generate(e, ids, salted, greedy)]

    def batched() -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(ids), 8):
            out += [list(r.output_token_ids) for r in generate(eng, ids[i : i + 8], True, greedy)]
        return out

    def n4() -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=4,
                                seed=1234)  # fmt: skip
        out = []
        for p in ids:
            parent = generate(eng, [p], True, params)[0]
            out.append(list(parent.output_token_ids))  # choice 0 is the request itself
        return out

    def preempted() -> list[list[int]]:
        """Every prompt at once; every third step the most recently admitted running
        request that has generated a token is preempted (what an empty KV pool does to it:
        `Scheduler.preempt`) and recomputed, its prompt by a prompt pass and its output by
        decode rows. Once each: a request preempted again before its recompute ends would
        never finish."""
        sched = eng.scheduler

        def preempt_one(steps: int) -> None:
            started = [r for r in sched.running if r.output_token_ids and not r.num_preemptions]
            if steps % 3 == 0 and started:
                sched.preempt(started[-1])

        before = sched.num_preemptions
        reqs = generate(eng, ids, True, greedy, preempt_one)
        assert sched.num_preemptions > before, "nothing was preempted"
        return [list(r.output_token_ids) for r in reqs]

    steps: dict[str, Callable[[], list[list[int]]]] = {
        "cold": lambda: one_by_one(eng, True),
        "cached": lambda: one_by_one(eng, False),
        "batched": batched,
        "chunked": lambda: alone_or_at_once(engine(max_num_batched_tokens=16), True),
        "disaggregated": lambda: _disaggregated(model_dir, ids, max_tokens, dtype, at_once),
        "n4": n4,
        "preempted": preempted,
    }
    for name in CONDITIONS:
        if progress is not None:
            progress(name)
        if name == "cached":  # fill the cache first: the cold run salted its blocks away
            alone_or_at_once(eng, False)
        t = time.perf_counter()
        census.tokens[name] = steps[name]()
        census.seconds[name] = time.perf_counter() - t
        gc.collect()  # a condition's own engines (chunked, disaggregated) go before the next
    return census


def _disaggregated(
    model_dir: Path, ids: Sequence[list[int]], max_tokens: int, dtype: str, at_once: bool
) -> list[list[int]]:
    """Each prompt through an in-process prefill worker and decode worker, one at a time
    (or all together: `at_once`)."""
    import asyncio

    from pdserve.client import make_request
    from pdserve.config import ServeConfig
    from pdserve.launch import run_with_workers

    cfg = ServeConfig.load(
        None,
        {
            "model": {"model": str(model_dir), "dtype": dtype},
            "transfer": {"transport": "local"},
            "colocated": False,
            "cache": {"num_blocks": 256},
        },
    )
    out: list[list[int]] = [[] for _ in ids]

    async def one(router: Any, i: int) -> None:
        request = make_request(ids[i], f"census-d{i}", max_tokens=max_tokens, temperature=0.0,
                               ignore_eos=True, cache_salt=f"d{i}")  # fmt: skip
        act = await router.admit(request)
        completed = False
        try:
            async for resp in router.run(act):
                if resp.HasField("chunk"):
                    out[i].extend(resp.chunk.token_ids)
                else:
                    completed = True
        finally:
            router.finish(act, completed)

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        if at_once:
            await asyncio.gather(*(one(router, i) for i in range(len(ids))))
        else:
            for i in range(len(ids)):
                await one(router, i)
        assert prefill.num_requests_total == len(ids), "every prompt pass ran on the prefill side"

    run_with_workers(cfg, model_dir, body)
    return out


def main(argv: list[str] | None = None) -> int:
    """`make bench-determinism`: the whole census (64 prompts), its report in
    ``benchmarks/results/determinism-latest.json``; exit 1 unless every token matches."""
    from tqdm import tqdm

    from pdserve.models import DEFAULT_MODEL, resolve_model

    p = argparse.ArgumentParser(description="greedy tokens across seven conditions")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", help="float32 has no invariant kernels yet")
    p.add_argument("--out", default="benchmarks/results/determinism-latest.json")
    args = p.parse_args(argv)
    model_dir = resolve_model(DEFAULT_MODEL)
    with tqdm(total=len(CONDITIONS), desc="census") as bar:

        def step(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update(0 if name == CONDITIONS[0] else 1)

        census = run(model_dir, prompts(args.prompts), args.max_tokens, args.dtype, step)
        bar.update(1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from engine import cpu

    extra = {"mismatches": census.mismatches(), "cpu": cpu.identity(), "date": time.ctime()}
    Path(args.out).write_text(json.dumps(asdict(census) | extra))
    print(f"CPU: {cpu.identity()}")
    print(census.summary())
    print("seconds per condition: " + ", ".join(f"{k} {v:.1f}" for k, v in census.seconds.items()))
    return 0 if census.identical() else 1


if __name__ == "__main__":
    sys.exit(main())
