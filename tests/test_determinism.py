"""The short determinism census (`pdserve.tools.determinism`, 16 prompts; `make
bench-determinism` runs 64): on the real model, a greedy request's tokens are the same cold,
cached, batched with 7 others, chunked at 16 tokens, disaggregated, as choice 0 of n = 4 and
preempted.

It asserts equality without a margin, which only batch-invariant kernels can promise: where
this machine has none (the kernel selection says so), it skips, naming why."""

from __future__ import annotations

import pytest

from engine import cpu
from pdserve.models import DEFAULT_MODEL, resolve_model
from pdserve.tools import determinism

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def census() -> determinism.Census:
    if not cpu.has_bf16_hardware():
        pytest.skip(f"the census runs in bf16, which this CPU lacks ({cpu.describe()})")
    texts = determinism.prompts(16)
    # chunked and disaggregated with every prompt at once: still each must equal cold
    return determinism.run(resolve_model(DEFAULT_MODEL), texts, 12, "bfloat16", at_once=True)


def test_greedy_tokens_are_identical_under_every_condition(census: determinism.Census) -> None:
    if "not batch-invariant" in census.kernels:
        pytest.skip(f"no batch-invariant kernels on this machine: {census.kernels}")
    assert set(census.tokens) == set(determinism.CONDITIONS)
    assert all(len(t) == 12 for toks in census.tokens.values() for t in toks)
    assert census.identical(), census.summary()


def test_the_census_would_see_a_difference() -> None:
    """The comparison is token for token: one changed token in one condition is reported."""
    c = determinism.Census(
        "bfloat16", "k", 2, {"cold": [[1, 2], [3, 4]], "cached": [[1, 2], [3, 5]]}
    )
    assert c.mismatches() == {"cached": [1]} and not c.identical()
    assert "cached: 1/2 identical (differ: [1])" in c.summary()
