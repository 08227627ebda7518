"""Workloads: request arrivals with their lengths and prefix sharing, built in or from a file.

A workload is a list of `WorkloadRequest`s. The simulator (`pdserve.plan.sim`) and the real
load (`make bench-plan` replays the same list through `pdserve bench`) read the same one,
so a prediction and its measurement are of one set of requests.

The trace file format (`--workload FILE.jsonl`), one request per line:

    {"arrival_s": 0.42, "prompt_tokens": 812, "output_tokens": 64,
     "prefix_group": 3, "prefix_tokens": 512}

`prefix_group` and `prefix_tokens` are optional: requests of one group share their first
`prefix_tokens` tokens (a system prompt, a document, an agent's context so far); without a
group a prompt shares nothing.

The built-in workloads (Poisson arrivals at `rate` requests per second; agentic sessions
start at `rate / AGENTIC_TURNS`, so that their turns come at `rate` on average):
- `chat`: prompts of 64-1024 tokens (log-uniform) after a 64-token system prompt shared by
  all, 32-192 tokens out;
- `documents`: a long document each, 1024-2048 tokens, nothing shared, 16-96 tokens out;
- `agentic`: sessions of 3-6 turns on a 512-token tool preamble, each turn's prompt the last
  one's plus 64-256 tokens of new context (its prefix: the whole last prompt), 16-64 out.

What must hold: a workload is a pure function of (name, rate, duration, seed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.plan.args import WORKLOADS as BUILT_IN

AGENTIC_TURNS = 4.5  # the mean turns of an agentic session (3-6)


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens: at least 1")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError("prefix_tokens: between 0 and prompt_tokens")
        if self.arrival_s < 0:
            raise ValueError("arrival_s: not negative")


def _arrivals(rng: np.random.Generator, rate: float, duration_s: float) -> list[float]:
    times: list[float] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            return times
        times.append(t)


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def built_in(name: str, rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    if name not in BUILT_IN:
        raise ValueError(f"workload: one of {', '.join(BUILT_IN)} or a .jsonl file, not {name!r}")
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration: positive")
    rng = np.random.default_rng(seed)
    times = _arrivals(rng, rate, duration_s)
    if name == "chat":
        return [
            WorkloadRequest(t, 64 + _log_uniform(rng, 64, 1024), int(rng.integers(32, 193)), 0, 64)
            for t in times
        ]
    if name == "documents":
        return [
            WorkloadRequest(t, int(rng.integers(1024, 2049)), int(rng.integers(16, 97)))
            for t in times
        ]
    # agentic: sessions start at rate / AGENTIC_TURNS (so `rate` is requests per second, as
    # for the others); a session's later turns follow its own think time
    out: list[WorkloadRequest] = []
    sessions = _arrivals(np.random.default_rng([seed, 3]), rate / AGENTIC_TURNS, duration_s)
    for group, start in enumerate(sessions):
        prompt, t = 512 + int(rng.integers(64, 257)), start
        prefix = 512
        for _ in range(int(rng.integers(3, 7))):
            out.append(WorkloadRequest(t, prompt, int(rng.integers(16, 65)), group, prefix))
            t += float(rng.uniform(1.0, 4.0))
            prefix, prompt = prompt, prompt + int(rng.integers(64, 257))
    out = [r for r in out if r.arrival_s < duration_s]
    return sorted(out, key=lambda r: r.arrival_s)


def load(path: str | Path) -> list[WorkloadRequest]:
    """A JSONL trace (module docstring); errors name the line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(
                WorkloadRequest(
                    float(d["arrival_s"]),
                    int(d["prompt_tokens"]),
                    int(d["output_tokens"]),
                    None if d.get("prefix_group") is None else int(d["prefix_group"]),
                    int(d.get("prefix_tokens", 0)),
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival_s)


def dump(requests: Iterable[WorkloadRequest], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in requests))


def rescaled(requests: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """The same requests at another mean rate: every arrival time scaled (a trace read from a
    file is swept this way)."""
    if not requests:
        return []
    span = max(r.arrival_s for r in requests) or 1.0
    factor = (len(requests) / span) / rate
    return [
        WorkloadRequest(r.arrival_s * factor, r.prompt_tokens, r.output_tokens, r.prefix_group,
                        r.prefix_tokens)
        for r in requests
    ]  # fmt: skip


def token_ids(
    requests: Sequence[WorkloadRequest], vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Prompt token ids for each request (in the order given, which is arrival order).

    A grouped request's first `prefix_tokens` are those of the last earlier request of its
    group (a conversation's next turn: its whole last prompt), or, where that one is
    shorter or there is none, of the group's own fixed sequence (a shared system prompt or
    document); every later token is drawn for it alone. So requests of a group hit each
    other's cached blocks exactly where the workload says. Ids are drawn from [4, vocab)
    (clear of the usual special tokens)."""
    longest: dict[int, int] = {}
    for r in requests:
        if r.prefix_group is not None:
            longest[r.prefix_group] = max(longest.get(r.prefix_group, 0), r.prefix_tokens)
    shared = {
        g: np.random.default_rng([seed, 1, g]).integers(4, vocab_size, size=n).tolist()
        for g, n in longest.items()
    }
    last: dict[int, list[int]] = {}
    out = []
    for i, r in enumerate(requests):
        rng = np.random.default_rng([seed, 2, i])
        head: list[int] = []
        if r.prefix_group is not None:
            before = last.get(r.prefix_group, [])
            source = before if len(before) >= r.prefix_tokens else shared[r.prefix_group]
            head = source[: r.prefix_tokens]
        ids = head + rng.integers(4, vocab_size, size=r.prompt_tokens - len(head)).tolist()
        if r.prefix_group is not None:
            last[r.prefix_group] = ids
        out.append(ids)
    return out
