"""LLMEngine end to end on the tiny preset (float32): batching, chunking, prefix caching,
preemption, validation, stop conditions, sampling and detokenization.

Greedy equality across execution paths (batched vs alone, chunked vs not, cache hit vs miss,
recompute after preemption) is only meaningful when no step is a near tie, so the tests assert
a top1-top2 logit gap along the reference trajectory instead of loosening the comparison.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine import native
from engine.config import CacheConfig, SchedulerConfig
from engine.engine import ContextLengthError, EngineConfig, LLMEngine
from engine.kernels import KernelSet
from engine.request import FinishReason, Request, RequestOutput, RequestStatus
from engine.sampling import InvalidParameterError, SamplingParams, SamplingState, sample
from engine.scheduler import PrefillChunk
from engine.structured import StructuredOutput
from engine.tokenizer import Tokenizer
from pdserve.checkpoint import write_checkpoint

VOCAB = 512
MIN_GAP = 1e-4

MakeEngine = Callable[..., LLMEngine]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model is faster on one thread, and far faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


def build_engine(
    checkpoint: Path,
    block_size: int = 16,
    num_blocks: int = 512,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 1024,
    decode_workspace_mib: int = 1024,
    mixed_steps: bool = True,
    kernels: str = "reference",
) -> LLMEngine:
    """torch's own kernels unless `kernels` says otherwise: these tests hold the engine's
    bookkeeping (the decode workspace included) to HF's tokens, the same on every CPU."""
    return LLMEngine.from_config(
        EngineConfig(
            model=str(checkpoint),
            dtype="float32",
            kernels=kernels,
            cache=CacheConfig(block_size, num_blocks, decode_workspace_mib),
            scheduler=SchedulerConfig(
                max_num_seqs, max_num_batched_tokens, max_model_len, mixed_steps
            ),
        )
    )


@pytest.fixture
def make_engine(tiny: Path) -> Iterator[MakeEngine]:
    """Engines built here are checked on teardown: integrity holds and nothing is left used."""
    made: list[LLMEngine] = []

    def make(**kw: Any) -> LLMEngine:
        eng = build_engine(tiny, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.blocks.check_integrity()
        assert not eng.has_unfinished()
        assert eng.blocks.num_used_blocks == 0, "blocks neither free nor cached at the end"


class Recorder:
    """Wraps the engine's runner to keep every logits row, per request, in sampling order,
    and what each step ran (a mixed step counts in both lists)."""

    def __init__(self, eng: LLMEngine) -> None:
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.prefill_steps: list[list[tuple[str, int, int]]] = []
        self.decode_batches: list[int] = []
        self.workspace_held: list[bool] = []  # per step with decode rows: after it, held?
        self.mixed_steps = 0
        step, ws = eng.runner.step, eng.runner.workspace

        def recording_step(
            chunks: Sequence[PrefillChunk], decode: Sequence[Request], hook: object = None
        ) -> torch.Tensor:
            out = step(chunks, decode, hook)  # type: ignore[arg-type]
            if chunks:
                self.prefill_steps.append([(c.request.request_id, c.start, c.end) for c in chunks])
            if decode:
                self.decode_batches.append(len(decode))
                self.workspace_held.append(ws is not None and ws.data is not None)
            self.mixed_steps += bool(chunks and decode)
            done = [c.request.request_id for c in chunks if c.completes_prompt]
            done += [r.request_id for r in decode if not r.replaying]
            assert out.shape[0] == len(done)
            for rid, row in zip(done, out, strict=True):
                self.logits[rid].append(row.clone())
            return out

        eng.runner.step = recording_step  # type: ignore[method-assign]


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]  # 0-3 are special tokens


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})  # type: ignore[arg-type]


def min_gap(rows: Sequence[torch.Tensor]) -> float:
    return min(float(v[0] - v[1]) for v in (r.topk(2).values for r in rows))


def run_alone(
    make_engine: MakeEngine, prompt: list[int], params: SamplingParams, **kw: int
) -> tuple[Request, list[torch.Tensor]]:
    eng = make_engine(**kw)
    rec = Recorder(eng)
    [req] = eng.generate([prompt], params)
    return req, rec.logits[req.request_id]


# ---- batching, chunking, prefix cache, preemption ----------------------------------------


def test_chunked_batched_prefill_matches_unchunked(make_engine: MakeEngine) -> None:
    rng = random.Random(1)
    prompts = [rand_prompt(rng, n) for n in (40, 75, 120)]
    eng = make_engine(max_num_batched_tokens=32)
    rec = Recorder(eng)
    reqs = eng.generate(prompts, greedy(max_tokens=1))
    # The prompts really were cut into chunks and packed several to a step.
    assert all(sum(e - s for _, s, e in step) <= 32 for step in rec.prefill_steps)
    assert any(len(step) > 1 for step in rec.prefill_steps)
    assert all(
        sum(1 for st in rec.prefill_steps for r, _, _ in st if r == q.request_id) > 1 for q in reqs
    )
    for prompt, req in zip(prompts, reqs, strict=True):
        ref, ref_logits = run_alone(make_engine, prompt, greedy(max_tokens=1))
        [got] = rec.logits[req.request_id]
        torch.testing.assert_close(got, ref_logits[0], atol=1e-5, rtol=0)
        assert req.output_token_ids == ref.output_token_ids


def test_prefix_cache_hit_matches_miss(make_engine: MakeEngine) -> None:
    rng = random.Random(2)
    shared = rand_prompt(rng, 100)
    p1, p2 = shared + rand_prompt(rng, 7), shared + rand_prompt(rng, 13)
    params = greedy(max_tokens=32)
    eng = make_engine()
    rec = Recorder(eng)
    r1 = eng.add_request("r1", p1, params)
    eng.step()  # r1's prompt is in; r2 shares its blocks while r1 still decodes
    assert r1.status is RequestStatus.RUNNING
    r2 = eng.add_request("r2", p2, params)
    while eng.has_unfinished():
        eng.step()
    assert r1.num_cached_tokens == 0
    assert r2.num_cached_tokens == 96  # six full blocks of the shared 100 tokens
    miss, miss_logits = run_alone(make_engine, p2, params)
    assert miss.num_cached_tokens == 0
    assert min_gap(miss_logits) > MIN_GAP
    assert r2.output_token_ids == miss.output_token_ids
    torch.testing.assert_close(rec.logits["r2"][0], miss_logits[0], atol=1e-5, rtol=0)

    # A prompt that is all cached full blocks still recomputes its last block for logits.
    p3 = shared[:96]
    [r3] = eng.generate([p3], params)
    assert r3.num_cached_tokens == 80
    fresh, _ = run_alone(make_engine, p3, params)
    assert r3.output_token_ids == fresh.output_token_ids

    # Another tenant's salt sees none of it.
    r4 = eng.add_request("r4", p2, params, cache_salt="tenant-b")
    while eng.has_unfinished():
        eng.step()
    assert r4.num_cached_tokens == 0
    assert r4.output_token_ids == miss.output_token_ids


def test_batch_of_8_matches_alone(make_engine: MakeEngine) -> None:
    rng = random.Random(3)
    prompts = [rand_prompt(rng, rng.randint(5, 60)) for _ in range(8)]
    params = greedy(max_tokens=40)
    eng = make_engine()
    rec = Recorder(eng)
    batched = eng.generate(prompts, params)
    assert max(rec.decode_batches) == 8
    for prompt, req in zip(prompts, batched, strict=True):
        alone, alone_logits = run_alone(make_engine, prompt, params)
        assert len(alone_logits) == 40
        assert min_gap(alone_logits) > MIN_GAP
        assert req.output_token_ids == alone.output_token_ids
        assert req.finish_reason is FinishReason.LENGTH
        for a, b in zip(rec.logits[req.request_id], alone_logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_preemption_by_recompute_keeps_outputs(make_engine: MakeEngine) -> None:
    rng = random.Random(4)
    prompts = [rand_prompt(rng, rng.randint(10, 40)) for _ in range(8)]
    params = greedy(max_tokens=48)
    ref = make_engine()
    ref_rec = Recorder(ref)
    expected = ref.generate(prompts, params)
    assert ref.scheduler.num_preemptions == 0
    for r in expected:
        assert min_gap(ref_rec.logits[r.request_id]) > MIN_GAP

    # Each request grows to ceil((40 + 47) / 16) = 6 blocks; 8 of them cannot share 12.
    eng = make_engine(num_blocks=12)
    got = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert any(r.num_preemptions for r in got)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in expected]
    assert all(r.finish_reason is FinishReason.LENGTH for r in got)
    eng.blocks.check_integrity()
    assert eng.blocks.num_used_blocks == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_preempted_request_replays_its_tokens_bit_for_bit(tiny: Path, dtype: str) -> None:
    """Preemption by recompute under batch-invariant kernels: the prompt is computed again
    by a prompt pass and the generated tokens by decode rows, as they first were, so every
    logits row a request samples from is the unpreempted run's bit for bit. No margin is
    assumed (the tiny model's random weights have near-ties: a prompt pass over the
    generated tokens changed them in bf16)."""

    def engine(num_blocks: int) -> tuple[LLMEngine, Recorder]:
        eng = LLMEngine.from_config(
            EngineConfig(
                model=str(tiny),
                dtype=dtype,
                kernels="auto",
                cache=CacheConfig(16, num_blocks, 1024),
            )
        )
        if not eng.kernel_selection.kernels.batch_invariant:
            pytest.skip(f"no batch-invariant {dtype} kernels here: {eng.kernel_selection.line()}")
        return eng, Recorder(eng)

    rng = random.Random(7)
    prompts = [rand_prompt(rng, rng.randint(10, 40)) for _ in range(8)]
    params = greedy(max_tokens=48)
    ref, ref_rec = engine(512)
    expected = ref.generate(prompts, params)
    assert ref.scheduler.num_preemptions == 0
    # Each request grows to ceil((40 + 47) / 16) = 6 blocks; 8 of them cannot share 12.
    eng, rec = engine(12)
    got = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    preempted = [i for i, r in enumerate(got) if r.num_preemptions]
    assert preempted
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in expected]
    for r, e in zip(got, expected, strict=True):
        rows, ref_rows = rec.logits[r.request_id], ref_rec.logits[e.request_id]
        assert len(rows) == len(ref_rows) == 48
        assert all(torch.equal(a, b) for a, b in zip(rows, ref_rows, strict=True)), (
            f"{r.request_id} (preempted {r.num_preemptions}x): logits differ"
        )
    for e in (ref, eng):
        e.blocks.check_integrity()
        assert e.blocks.num_used_blocks == 0


@pytest.mark.skipif(native.load() is None, reason=f"no pdserve kernels: {native.why_not()}")
def test_flash_prefill_on_the_pages_matches_torchs_kernels(make_engine: MakeEngine) -> None:
    """pdserve's paged flash prefill (`prefill_attention=flash`) in the engine: prompts cut
    into 32-token chunks and packed several to a step, mixed steps, a cached prefix, the last
    layer's pruned rows; the same tokens as torch's kernels, logits within float32 noise."""
    rng = random.Random(11)
    shared = rand_prompt(rng, 70)
    prompts = [shared + rand_prompt(rng, 5)]
    prompts += [shared + rand_prompt(rng, 40)] + [rand_prompt(rng, n) for n in (1, 17, 130)]
    params = greedy(max_tokens=6)
    ref = make_engine()
    ref_rec = Recorder(ref)
    expected = ref.generate(prompts, params)
    eng = make_engine(kernels="prefill_attention=flash", max_num_batched_tokens=32)
    assert eng.runner.model.kernels.prefill_reads_pages
    rec = Recorder(eng)
    got = eng.generate(prompts[:1], params) + eng.generate(prompts[1:], params)
    assert got[1].num_cached_tokens == 64  # the shared prefix's four full blocks
    assert any(len(step) > 1 for step in rec.prefill_steps) and rec.mixed_steps
    for want, have in zip(expected, got, strict=True):
        assert min_gap(ref_rec.logits[want.request_id]) > MIN_GAP
        assert have.output_token_ids == want.output_token_ids
        for a, b in zip(rec.logits[have.request_id], ref_rec.logits[want.request_id], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_packed_projections_free_the_plain_matrices(make_engine: MakeEngine, tiny: Path) -> None:
    """An engine serving with packed projections holds each matrix once: the plain ones are
    freed (shapes kept), its logits are those of an engine that keeps them, and switching it
    to projections that read the plain matrices is refused, naming the way to keep them."""
    rng = random.Random(3)
    prompts = [rand_prompt(rng, n) for n in (5, 40)]
    params = greedy(max_tokens=4)
    eng = make_engine(kernels="projections=packed")
    w = eng.runner.model.w
    assert w.matrices_released and w.layers[0].qkv.is_meta
    mc = eng.model_config
    assert w.layers[0].qkv.shape == (mc.q_size + 2 * mc.kv_size, mc.hidden_size)
    kept = LLMEngine.from_config(
        EngineConfig(
            model=str(tiny), dtype="float32", kernels="projections=packed", keep_plain_weights=True
        )
    )
    assert not kept.runner.model.w.matrices_released
    rec, kept_rec = Recorder(eng), Recorder(kept)
    got, want = eng.generate(prompts, params), kept.generate(prompts, params)
    for a, b in zip(got, want, strict=True):
        assert a.output_token_ids == b.output_token_ids
        for x, y in zip(rec.logits[a.request_id], kept_rec.logits[b.request_id], strict=True):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="keep_plain_weights"):
        eng.runner.model.set_kernels(KernelSet.reference())
    kept.runner.model.set_kernels(KernelSet.reference())  # it kept them: allowed


def staggered_run(eng: LLMEngine, prompts: list[list[int]]) -> tuple[list[Request], Recorder]:
    """Requests join a few steps apart and leave at different lengths (continuous batching)."""
    rec = Recorder(eng)
    reqs: list[Request] = []
    for step in range(10_000):
        if step % 3 == 0 and len(reqs) < len(prompts):
            i = len(reqs)
            reqs.append(eng.add_request(f"s{i}", prompts[i], greedy(max_tokens=10 + 7 * (i % 5))))
        eng.step()
        if len(reqs) == len(prompts) and not eng.has_unfinished():
            return reqs, rec
    raise AssertionError("did not finish")


def test_mixed_steps_match_prefill_first_and_keep_the_workspace(
    make_engine: MakeEngine, reference: Callable[[list[int]], tuple[list[int], list[float]]]
) -> None:
    """Mixed steps (the default): running requests take one token each of the step's budget
    first and prompt chunks fill the rest, so long prompts are cut into chunks that share
    steps with decode rows. The tokens are what each prompt gives alone and what
    prefill-first steps give, the logits within fp32 noise; and the decode rows of a mixed
    step read the decode workspace like any decode step: each request is copied into it
    once, when it joins the batch, never again however many mixed steps follow."""
    rng = random.Random(11)
    prompts = [rand_prompt(rng, rng.randint(20, 150)) for _ in range(10)]
    budget = 48
    eng = make_engine(max_num_batched_tokens=budget)
    ws = eng.runner.workspace
    assert ws is not None
    fills: list[int] = []
    fill = ws._fill

    def counting_fill(row: int, table: Sequence[int], n: int) -> None:
        fills.append(n)
        fill(row, table, n)

    ws._fill = counting_fill  # type: ignore[method-assign]
    got, rec = staggered_run(eng, prompts)
    assert rec.mixed_steps >= 10, rec.mixed_steps
    assert all(sum(e - s for _, s, e in st) <= budget for st in rec.prefill_steps)
    assert eng.scheduler.num_preemptions == 0 and ws.fallbacks == 0
    assert len(fills) == len(prompts), f"{len(fills)} workspace fills for {len(prompts)} requests"
    first = make_engine(max_num_batched_tokens=budget, mixed_steps=False)
    ref, ref_rec = staggered_run(first, prompts)
    assert ref_rec.mixed_steps == 0
    for prompt, a, b in zip(prompts, got, ref, strict=True):
        want, gaps = reference(prompt)  # its first RANDOM_MAX_TOKENS tokens alone
        assert min(gaps) > MIN_GAP
        assert a.output_token_ids == b.output_token_ids
        n = min(len(want), len(a.output_token_ids))
        assert a.output_token_ids[:n] == want[:n]
        for x, y in zip(rec.logits[a.request_id], ref_rec.logits[b.request_id], strict=True):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=0)


def test_mixed_step_budget_goes_to_decode_rows_first(make_engine: MakeEngine) -> None:
    """With k requests running and a budget of B, a waiting prompt gets a chunk of B - k
    tokens in the same step; with prefill-first steps it gets B and the k wait."""
    rng = random.Random(12)
    budget = 32
    for mixed in (True, False):
        eng = make_engine(max_num_batched_tokens=budget, mixed_steps=mixed)
        for i in range(3):
            eng.add_request(f"run{i}", rand_prompt(rng, 10), greedy(max_tokens=20))
        assert eng.step().phase == "prefill"  # the three short prompts in one step
        eng.add_request("long", rand_prompt(rng, 100), greedy(max_tokens=1))
        out = eng.scheduler.schedule()
        if mixed:
            assert out.phase == "mixed" and len(out.decode) == 3
            assert [(c.start, c.end) for c in out.prefill] == [(0, budget - 3)]
        else:
            assert out.phase == "prefill" and [(c.start, c.end) for c in out.prefill] == [
                (0, budget)
            ]
        for r in list(eng.requests):
            eng.abort(r)


@pytest.mark.parametrize("fill_runs", [16, 0], ids=["fill-by-runs", "fill-by-gather"])
def test_decode_workspace_matches_page_gather(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, fill_runs: int
) -> None:
    """The decode workspace (a contiguous copy of the batch's K/V, rows reshuffled as
    requests come and go) gives decode exactly what gathering the pages gives, whether it
    copies a new request in run by run of consecutive blocks or through one gather.

    Its buffers are handed out full of NaN here: attention reads every row up to the longest
    context, so any position a row leaves uninitialised would turn the logits into NaN."""
    from engine import decode_workspace

    def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(decode_workspace, "_uninitialized", poisoned)
    monkeypatch.setattr(decode_workspace, "_MAX_FILL_RUNS", fill_runs)
    rng = random.Random(5)
    prompts = [rand_prompt(rng, rng.randint(3, 90)) for _ in range(12)]
    # s4 decodes from 236 to 274 tokens: the workspace grows past 256 positions while
    # shorter rows stay in the batch (their new positions are read, masked, from then on).
    prompts[4] = rand_prompt(rng, 236)
    ws_eng = make_engine()
    ws = ws_eng.runner.workspace
    assert ws is not None
    capacities: list[int] = []
    seen_rows: list[list[tuple[str, int]]] = []
    prepare = ws.prepare

    def recording_prepare(*args: Any) -> list[int] | None:
        order = prepare(*args)
        assert order is not None and sorted(order) == list(range(len(args[0])))
        assert ws.keys == [args[0][i] for i in order]  # rows 0 .. B-1 are the batch
        seen_rows.append(list(ws.keys))
        capacities.append(ws.capacity)
        return order

    ws.prepare = recording_prepare  # type: ignore[method-assign]
    got, got_rec = staggered_run(ws_eng, prompts)
    assert ws.bytes_held == 0  # given back once the last request finished
    # Rows really were reshuffled: a request left from the middle and another moved into
    # its row; and a leaver's row went to a newcomer in the same step.
    pairs = list(itertools.pairwise(seen_rows))
    assert any(any(k in b and b.index(k) != a.index(k) for k in a) for a, b in pairs), (
        "no row ever moved"
    )
    assert any(set(a) - set(b) and set(b) - set(a) for a, b in pairs), "no row was reused"
    grew = [i + 1 for i, (a, b) in enumerate(itertools.pairwise(capacities)) if b > a]
    assert any(len(seen_rows[i]) > 1 for i in grew), "never grew with other rows in use"
    gather_eng = make_engine(decode_workspace_mib=0)
    assert gather_eng.runner.workspace is None
    ref, ref_rec = staggered_run(gather_eng, prompts)
    for a, b in zip(got, ref, strict=True):
        assert a.output_token_ids == b.output_token_ids
        for x, y in zip(got_rec.logits[a.request_id], ref_rec.logits[b.request_id], strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fill_runs", [16, 0], ids=["fill-by-runs", "fill-by-gather"])
def test_decode_workspace_copies_scattered_pages_in_order(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, fill_runs: int
) -> None:
    """A request whose blocks are three runs of consecutive ids, the last one partly used:
    its workspace row holds every position of every layer as the pages do, and the rest of
    the row is zero (finite), though the buffer started as NaN."""
    from engine import decode_workspace

    def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(decode_workspace, "_uninitialized", poisoned)
    monkeypatch.setattr(decode_workspace, "_MAX_FILL_RUNS", fill_runs)
    eng = make_engine()
    ws, cache = eng.runner.workspace, eng.cache
    assert ws is not None
    cache.data.copy_(torch.randn_like(cache.data))
    table = [7, 8, 3, 4, 5, 11]  # runs: 7-8, 3-5, 11
    n = 5 * cache.block_size + 3  # the context; the step's own token makes it n + 1
    assert ws.prepare([("r", 0)], [n + 1], [table]) == [0]
    for layer in range(cache.num_layers):
        kp, vp = cache.gather_blocks(layer, torch.tensor([table]))
        k, v = ws.layer(layer, 1, ws.capacity)  # [1, Hkv, capacity, D]
        assert torch.equal(k[0, :, :n], kp[0, :n].transpose(0, 1))
        assert torch.equal(v[0, :, :n], vp[0, :n].transpose(0, 1))
        assert not k[0, :, n:].any() and not v[0, :, n:].any()


@pytest.mark.parametrize("cap_mib", [1024, 1])
def test_decode_workspace_is_sized_for_where_its_requests_end(
    make_engine: MakeEngine, cap_mib: int
) -> None:
    """Prompts of 100 tokens that may grow to 400 (max_tokens 300): the workspace is
    allocated once, at 512 positions, instead of at 256 and again (every row copied) past
    token 256; under a cap that 512 positions do not fit, it starts at what the batch needs
    now and falls back to the pages later, with the same tokens either way."""
    rng = random.Random(8)
    prompts = [rand_prompt(rng, 100) for _ in range(4)]
    params = greedy(max_tokens=300)
    # tiny: 512 B per row and position; 8 rows x 512 positions is 2 MiB, x 256 is 1 MiB.
    eng = make_engine(decode_workspace_mib=cap_mib)
    ws = eng.runner.workspace
    assert ws is not None
    capacities: list[int] = []
    grow = ws._grow

    def watching_grow(*args: Any) -> None:
        grow(*args)
        capacities.append(ws.capacity)

    ws._grow = watching_grow  # type: ignore[method-assign]
    got = eng.generate(prompts, params)
    if cap_mib == 1024:
        assert set(capacities) == {512} and ws.fallbacks == 0
    else:
        assert capacities[0] == 256 and ws.fallbacks > 0
    ref = make_engine(decode_workspace_mib=0).generate(prompts, params)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in ref]


def test_worker_stats_report_the_decode_workspace(make_engine: MakeEngine) -> None:
    """What a worker's stats (and so /metrics) say about the workspace while requests decode
    and after they finish."""
    from pool_api.messages import Role, WorkerStats

    eng = make_engine()
    ws = eng.runner.workspace
    assert ws is not None
    rng = random.Random(7)
    for i in range(3):
        eng.add_request(f"w{i}", rand_prompt(rng, 40), greedy(max_tokens=8))
    eng.step()  # prefill
    eng.step()  # the first decode step fills the workspace
    stats = WorkerStats.of("w", Role.DECODE, eng.stats(), 0, 3, {})
    assert stats.extra["decode_workspace_bytes"] == ws.bytes_held > 0
    assert stats.extra["decode_workspace_fallbacks_total"] == 0
    while eng.has_unfinished():
        eng.step()
    assert (
        WorkerStats.of("w", Role.DECODE, eng.stats(), 0, 3, {}).extra["decode_workspace_bytes"] == 0
    )


def test_decode_workspace_over_its_cap_falls_back_to_pages(make_engine: MakeEngine) -> None:
    """A batch that outgrows the cap mid-run is decoded from the pages; the workspace lets
    its memory go and the tokens do not change."""
    rng = random.Random(6)
    prompts = [rand_prompt(rng, 200) for _ in range(12)]
    params = greedy(max_tokens=100)
    # tiny: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes = 512 B per row and position:
    # 16 rows x 256 positions is 2 MiB; past position 256 the batch needs 4 MiB.
    eng = make_engine(decode_workspace_mib=2)
    ws = eng.runner.workspace
    assert ws is not None
    rec = Recorder(eng)
    got = eng.generate(prompts, params)
    used = rec.workspace_held
    # Used at first, given up once the batch outgrew it (with mixed steps the last two
    # requests end a step after the others, a batch small enough to take it up again).
    assert used[0] and False in used, used
    assert ws.data is None and ws.keys == [] and ws.bytes_held == 0
    assert ws.fallbacks == used.count(False)
    ref = make_engine(decode_workspace_mib=0).generate(prompts, params)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in ref]


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Callable[[list[int]], tuple[list[int], list[float]]]:
    """Greedy tokens of a prompt run alone (big pool, no chunking), with each step's gap."""
    memo: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}
    eng = build_engine(tiny)
    rec = Recorder(eng)

    def ref(prompt: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in memo:
            eng.blocks.reset_prefix_cache()  # a clean miss every time
            eng.blocks.take_events()
            [r] = eng.generate([prompt], greedy(max_tokens=RANDOM_MAX_TOKENS))
            gaps = [
                float(v[0] - v[1]) for v in (x.topk(2).values for x in rec.logits[r.request_id])
            ]
            memo[key] = (r.output_token_ids, gaps)
        return memo[key]

    return ref


RANDOM_MAX_TOKENS = 16
SHARED = rand_prompt(random.Random(99), 40)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_workloads_keep_blocks_consistent(
    tiny: Path, reference: Callable[[list[int]], tuple[list[int], list[float]]], data: st.DataObject
) -> None:
    """Random arrivals, aborts, shared prefixes, chunking and a tight pool: integrity holds
    after every step, nothing leaks, and every finished request has its alone-greedy tokens
    (compared up to the first near-tie of the reference)."""
    block_size = data.draw(st.sampled_from([4, 8, 16]), "block_size")
    specs = data.draw(
        st.lists(
            st.tuples(
                st.integers(1, 40),  # tokens of SHARED (identical prompts happen too)
                st.lists(st.integers(4, VOCAB - 1), max_size=12),  # own tail
                st.integers(1, RANDOM_MAX_TOKENS) | st.just(RANDOM_MAX_TOKENS),  # max_tokens
                st.integers(0, 8) | st.just(0),  # arrival step
                st.none() | st.none() | st.none() | st.integers(0, 12),  # abort step
            ),
            min_size=2,
            max_size=6,
        ),
        "requests",
    )
    peak = max(k + len(tail) + max(n - 1, 1) for k, tail, n, _, _ in specs)
    eng = build_engine(
        tiny,
        block_size=block_size,
        num_blocks=-(-peak // block_size) + data.draw(st.integers(0, 2), "spare blocks"),
        max_num_seqs=data.draw(st.sampled_from([1, 3, 8, 8]), "max_num_seqs"),
        max_num_batched_tokens=data.draw(st.sampled_from([8, 16, 64, 2048]), "budget"),
    )
    reqs: dict[int, Request] = {}
    aborted: set[int] = set()
    for step in range(1000):
        for i, (k, tail, n, arrive, abort_at) in enumerate(specs):
            if arrive == step:
                reqs[i] = eng.add_request(f"q{i}", SHARED[:k] + tail, greedy(max_tokens=n))
            if abort_at is not None and arrive + abort_at == step and eng.abort(f"q{i}"):
                aborted.add(i)
        eng.step()
        eng.blocks.check_integrity()
        if len(reqs) == len(specs) and not eng.has_unfinished():
            break
    assert not eng.has_unfinished() and not eng.requests
    assert eng.blocks.num_used_blocks == 0
    event(f"preempted: {eng.scheduler.num_preemptions > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"prefix hit: {any(r.num_cached_tokens for r in reqs.values())}")
    for i, req in reqs.items():
        assert req.is_finished
        if i in aborted:
            assert req.finish_reason is FinishReason.ABORT
            continue
        assert req.finish_reason is FinishReason.LENGTH
        assert len(req.output_token_ids) == specs[i][2]
        tokens, gaps = reference(req.prompt_token_ids)
        # up to the first near-tie step, not the token picked there
        trusted = next((j for j, g in enumerate(gaps) if g < MIN_GAP), len(gaps))
        m = min(trusted, len(req.output_token_ids))
        assert req.output_token_ids[:m] == tokens[:m]


def test_request_that_cannot_fit_the_pool_alone_is_rejected(make_engine: MakeEngine) -> None:
    """Preemption cannot make room for a request larger than the whole pool: reject it."""
    eng = make_engine(num_blocks=4)  # 64 tokens
    with pytest.raises(ContextLengthError) as e:
        eng.add_request("big", list(range(10, 20)), greedy(max_tokens=100))
    assert e.value.field == "max_tokens"
    with pytest.raises(ContextLengthError) as e:
        eng.add_request("huge", list(range(10, 80)), greedy(max_tokens=1))
    assert e.value.field == "prompt"
    # The largest request that fits runs to completion on its own.
    [r] = eng.generate([list(range(10, 20))], greedy(max_tokens=55))
    assert len(r.output_token_ids) == 55
    assert not eng.requests


def test_abort_frees_blocks(make_engine: MakeEngine) -> None:
    rng = random.Random(5)
    eng = make_engine(max_num_batched_tokens=32)
    long = eng.add_request("long", rand_prompt(rng, 100), greedy(max_tokens=8))
    short = eng.add_request("short", rand_prompt(rng, 20), greedy(max_tokens=50))
    queued = eng.add_request("queued", rand_prompt(rng, 20), greedy(max_tokens=8))
    eng.step()  # "long" is partly prefilled, the others wait
    assert eng.blocks.has("long") and not eng.blocks.has("short")
    assert eng.abort("long")
    assert not eng.blocks.has("long")
    eng.blocks.check_integrity()
    for _ in range(4):  # "short" and "queued" are admitted and decode
        eng.step()
    assert short.status is RequestStatus.RUNNING and len(short.output_token_ids) > 1
    assert eng.abort("short") and eng.abort("queued")
    assert not eng.abort("short") and not eng.abort("nope")
    for r in (long, short, queued):
        assert r.finish_reason is FinishReason.ABORT and r.is_finished
    assert not eng.has_unfinished() and not eng.requests
    assert eng.blocks.num_used_blocks == 0
    eng.blocks.check_integrity()


# ---- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=0), "top_k"),
        (SamplingParams(min_p=2), "min_p"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(frequency_penalty=3), "frequency_penalty"),
        (SamplingParams(presence_penalty=-3), "presence_penalty"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(logprobs=50), "logprobs"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(stop=("",)), "stop"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_name_the_field(
    make_engine: MakeEngine, params: SamplingParams, field: str
) -> None:
    eng = make_engine()
    with pytest.raises(InvalidParameterError) as e:
        eng.add_request("r", [5, 6, 7], params)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")
    assert not eng.requests and not eng.has_unfinished()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_bad_prompts_name_the_field(make_engine: MakeEngine) -> None:
    eng = make_engine(max_model_len=256)
    with pytest.raises(InvalidParameterError) as e:
        eng.add_request("r", [], greedy())
    assert e.value.field == "prompt"
    with pytest.raises(InvalidParameterError) as e:
        eng.add_request("r", [5, VOCAB], greedy())
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(ContextLengthError) as ce:
        eng.add_request("r", [5] * 250, greedy(max_tokens=16))
    assert ce.value.field == "prompt"
    assert "This model's maximum context length is 256 tokens. However, you requested 266 " in (
        str(ce.value)
    )
    assert "(250 in the messages, 16 in the completion)" in str(ce.value)
    eng.add_request("r", [5] * 240, greedy(max_tokens=16))  # exactly fits
    with pytest.raises(InvalidParameterError) as e:
        eng.add_request("r", [5, 6], greedy())
    assert e.value.field == "request_id"
    while eng.has_unfinished():
        eng.step()


# ---- stop conditions ---------------------------------------------------------------------


def test_eos_stops_unless_ignored_and_min_tokens_suppresses_it(make_engine: MakeEngine) -> None:
    eng = make_engine()
    rec = Recorder(eng)
    eos = set(eng.eos_token_ids)
    assert eos
    rng = random.Random(6)
    prompts = [rand_prompt(rng, 12) for _ in range(64)]
    free_runs = eng.generate(prompts, greedy(max_tokens=48))
    found = [
        (p, r.output_token_ids, k)
        for p, r in zip(prompts, free_runs, strict=True)
        for k in [next((i for i, t in enumerate(r.output_token_ids) if t in eos), -1)]
        if k >= 0 and min_gap(rec.logits[r.request_id]) > MIN_GAP
    ]
    assert found, "no greedy trajectory reached EOS; pick other prompts"
    prompt, out, k = found[0]
    [stopped] = eng.generate([prompt], greedy(max_tokens=48, ignore_eos=False))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_token_ids == out[: k + 1]  # EOS is the last token...
    [upto] = eng.generate([prompt], greedy(max_tokens=k))
    assert stopped.text == upto.text  # ...and is not in the text

    [ignored] = eng.generate([prompt], greedy(max_tokens=48, ignore_eos=True))
    assert ignored.finish_reason is FinishReason.LENGTH and len(ignored.output_token_ids) == 48

    [late] = eng.generate([prompt], greedy(max_tokens=48, ignore_eos=False, min_tokens=k + 2))
    assert len(late.output_token_ids) >= k + 2
    assert not eos & set(late.output_token_ids[: k + 2])
    assert late.output_token_ids[:k] == out[:k]


def test_stop_token_ids(make_engine: MakeEngine) -> None:
    eng = make_engine()
    rec = Recorder(eng)
    prompt = rand_prompt(random.Random(7), 20)
    [full] = eng.generate([prompt], greedy(max_tokens=40))
    assert min_gap(rec.logits[full.request_id]) > MIN_GAP
    out = full.output_token_ids
    tok = out[12]
    k = out.index(tok)
    [stopped] = eng.generate([prompt], greedy(max_tokens=40, stop_token_ids=(tok,)))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_token_ids == out[: k + 1]
    [upto] = eng.generate([prompt], greedy(max_tokens=k)) if k else [None]
    assert stopped.text == (upto.text if upto else "")
    # min_tokens bans stop tokens too, until it is reached.
    [late] = eng.generate([prompt], greedy(max_tokens=40, stop_token_ids=(tok,), min_tokens=k + 1))
    assert tok not in late.output_token_ids[: k + 1]
    assert len(late.output_token_ids) > k + 1 or late.finish_reason is FinishReason.LENGTH


def test_stop_strings_truncate_the_text(make_engine: MakeEngine) -> None:
    eng = make_engine()
    rec = Recorder(eng)
    prompt = rand_prompt(random.Random(8), 20)
    [full] = eng.generate([prompt], greedy(max_tokens=48))
    assert min_gap(rec.logits[full.request_id]) > MIN_GAP
    text = full.text
    stop = next(
        text[i : i + 3]
        for i in range(8, len(text) - 3)
        if text[i : i + 3].strip() and "\ufffd" not in text[i : i + 3]
    )
    cut = text.index(stop)
    [stopped] = eng.generate([prompt], greedy(max_tokens=48, stop=("zzzzzz", stop)))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == text[:cut]
    n = len(stopped.output_token_ids)
    assert n < 48 and stopped.output_token_ids == full.output_token_ids[:n]


def stream(eng: LLMEngine, request_id: str) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs.extend(o for o in eng.step().outputs if o.request_id == request_id)
    return outs


def split_stop_string(deltas: list[str]) -> str:
    """A 4-char piece of the streamed text that straddles a token boundary (first occurrence)."""
    text = "".join(deltas)
    bounds = [sum(len(d) for d in deltas[:i]) for i in range(1, len(deltas))]
    return next(
        text[b - 2 : b + 2]
        for b in bounds
        if 8 <= b <= len(text) - 2
        and text.find(text[b - 2 : b + 2]) == b - 2
        and text[b - 2 : b + 2].strip()
        and "\ufffd" not in text[b - 2 : b + 2]
    )


STOP_PROMPT = rand_prompt(random.Random(8), 20)


def test_streamed_text_never_shows_the_stop_string(make_engine: MakeEngine) -> None:
    """A stop string split across tokens: its head must be held back, never streamed."""
    eng = make_engine()
    rec = Recorder(eng)
    full = eng.add_request("full", STOP_PROMPT, greedy(max_tokens=48))
    deltas = [o.text_delta for o in stream(eng, "full")]
    assert min_gap(rec.logits["full"]) > MIN_GAP
    text = full.text
    assert "".join(deltas) == text
    stop = split_stop_string(deltas)
    for stops in [(stop,), (stop, stop[:3] + "\x00")]:  # a second, never-matching stop string
        req = eng.add_request("s", STOP_PROMPT, greedy(max_tokens=48, stop=stops))
        outs = stream(eng, "s")
        assert req.finish_reason is FinishReason.STOP
        assert req.text == text[: text.index(stop)]
        assert "".join(o.text_delta for o in outs) == req.text
        assert [t for o in outs for t in o.new_token_ids] == req.output_token_ids
    # A stop string completed before min_tokens is ignored, not cut at later.
    n_before = next(i for i in range(len(deltas)) if stop in "".join(deltas[: i + 1])) + 1
    late = eng.add_request(
        "late", STOP_PROMPT, greedy(max_tokens=48, stop=(stop,), min_tokens=n_before + 1)
    )
    outs = stream(eng, "late")
    assert late.text.startswith(text[: text.index(stop) + len(stop)])
    assert "".join(o.text_delta for o in outs) == late.text


@pytest.mark.parametrize("with_stop", [False, True])
def test_prefill_decode_handoff_matches_colocated(make_engine: MakeEngine, with_stop: bool) -> None:
    """Prefill-only on one engine, K/V copied, `add_prefilled` on another: the joined stream
    (the prefill side's first delta, then the decode side's) equals the colocated run."""
    eng = make_engine()
    eng.add_request("full", STOP_PROMPT, greedy(max_tokens=48))
    stop = split_stop_string([o.text_delta for o in stream(eng, "full")])
    params = greedy(max_tokens=48, stop=(stop,) if with_stop else ())
    colocated = eng.add_request("c", STOP_PROMPT, params)
    stream(eng, "c")
    assert colocated.finish_reason is (FinishReason.STOP if with_stop else FinishReason.LENGTH)

    pre, dec = make_engine(), make_engine()
    pre.add_request("x", STOP_PROMPT, params, prefill_only=True)
    [first] = stream(pre, "x")
    assert first.finished and first.finish_reason is None  # handed on
    req = dec.make_request("x", STOP_PROMPT, params)
    dst = dec.blocks.allocate("x", [], len(STOP_PROMPT) + 1).block_ids  # what `reserve` does
    n = -(-len(STOP_PROMPT) // dec.cache_config.block_size)
    pre.cache.copy_blocks(pre.blocks.block_table("x")[:n], dec.cache, list(dst[:n]))
    pre.release("x")
    [head] = dec.add_prefilled(req, first.new_token_ids)
    assert head.text_delta == first.text_delta  # both sides hold back the same tail
    rest = stream(dec, "x")
    assert list(first.new_token_ids) + [t for o in rest for t in o.new_token_ids] == (
        colocated.output_token_ids
    )
    assert first.text_delta + "".join(o.text_delta for o in rest) == colocated.text == req.text
    assert req.finish_reason is colocated.finish_reason


def test_max_tokens_gives_length(make_engine: MakeEngine) -> None:
    eng = make_engine()
    reqs = eng.generate([[5, 6, 7], [8, 9]], [greedy(max_tokens=1), greedy(max_tokens=7)])
    assert [len(r.output_token_ids) for r in reqs] == [1, 7]
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)


def test_stream_outputs_add_up(make_engine: MakeEngine) -> None:
    eng = make_engine()
    req = eng.add_request("s", rand_prompt(random.Random(9), 30), greedy(max_tokens=20))
    outs = stream(eng, "s")
    assert [t for o in outs for t in o.new_token_ids] == req.output_token_ids
    assert "".join(o.text_delta for o in outs) == req.text
    assert [o.finished for o in outs] == [False] * 19 + [True]
    assert outs[-1].finish_reason is FinishReason.LENGTH


# ---- sampling ----------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine: MakeEngine) -> None:
    rng = random.Random(10)
    prompt = rand_prompt(rng, 25)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    [alone] = make_engine().generate([prompt], seeded)
    others = [rand_prompt(rng, rng.randint(5, 50)) for _ in range(4)]
    batch = make_engine().generate(
        [others[0], others[1], prompt, others[2], others[3]],
        [
            SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=7, max_tokens=10, ignore_eos=True),
            seeded,
            greedy(max_tokens=24),
            SamplingParams(temperature=1.3, top_p=0.9, max_tokens=24, ignore_eos=True),
        ],
    )
    assert batch[2].output_token_ids == alone.output_token_ids
    eng = make_engine()
    [again] = eng.generate([prompt], seeded)
    assert again.output_token_ids == alone.output_token_ids
    [other] = eng.generate([prompt], replace(seeded, seed=4321))
    assert other.output_token_ids != alone.output_token_ids


def test_top_k_1_is_greedy(make_engine: MakeEngine) -> None:
    eng = make_engine()
    rec = Recorder(eng)
    prompts = [rand_prompt(random.Random(11), 30), rand_prompt(random.Random(12), 17)]
    g = eng.generate(prompts, greedy(max_tokens=24))
    assert all(min_gap(rec.logits[r.request_id]) > MIN_GAP for r in g)
    s = eng.generate(
        prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True)
    )
    assert [r.output_token_ids for r in s] == [r.output_token_ids for r in g]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_match_log_softmax(make_engine: MakeEngine, temperature: float) -> None:
    eng = make_engine()
    rec = Recorder(eng)
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=10, logprobs=5, ignore_eos=True
    )
    prompt = rand_prompt(random.Random(13), 30)
    [r] = eng.generate([prompt], params)
    rows = rec.logits[r.request_id]
    assert len(r.logprobs) == len(rows) == 10
    for tok, lp, row in zip(r.output_token_ids, r.logprobs, rows, strict=True):
        ref = torch.log_softmax(row, dim=-1)
        assert lp.token_id == tok
        assert abs(lp.logprob - float(ref[tok])) < 1e-5
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()
        for t, v in lp.top:
            assert abs(v - float(ref[t])) < 1e-5
        if temperature == 0.0:
            assert lp.top[0][0] == tok
    [zero] = eng.generate([prompt], replace(params, logprobs=0))
    assert all(lp.top == () for lp in zero.logprobs) and len(zero.logprobs) == 10
    [none] = eng.generate([prompt], replace(params, logprobs=None))
    assert none.logprobs == []


def test_repetition_penalty_reduces_repeats(make_engine: MakeEngine) -> None:
    rng = random.Random(14)
    prompts = [rand_prompt(rng, 20) for _ in range(8)]

    def repeats(reqs: list[Request]) -> int:
        n = 0
        for r in reqs:
            seen = set(r.prompt_token_ids)
            for t in r.output_token_ids:
                n += t in seen
                seen.add(t)
        return n

    eng = make_engine()
    plain = eng.generate(prompts, greedy(max_tokens=40))
    penalized = eng.generate(prompts, greedy(max_tokens=40, repetition_penalty=1.3))
    assert [r.output_token_ids for r in plain] != [r.output_token_ids for r in penalized]
    assert repeats(penalized) < repeats(plain) // 2


def test_penalties_push_the_sampler_away_from_seen_tokens() -> None:
    def pick(
        logits: list[float],
        params: SamplingParams,
        prompt: Sequence[int] = (),
        output: Sequence[int] = (),
    ) -> int:
        state = SamplingState(params, list(prompt), list(output), None)
        return sample(torch.tensor([logits]), [state])[0][0]

    row = [0.0, 5.0, 4.9, -1.0, -1.05]
    base = SamplingParams(temperature=0.0)
    assert pick(row, base, output=[1]) == 1
    assert pick(row, replace(base, presence_penalty=0.5), output=[1]) == 2
    assert pick(row, replace(base, frequency_penalty=0.06), output=[1, 1]) == 2
    assert pick(row, replace(base, frequency_penalty=0.06), output=[1]) == 1
    assert pick(row, replace(base, repetition_penalty=1.1), prompt=[1]) == 2
    # Negative logits are multiplied, so a penalized token still moves down.
    neg = [-9.0, -9.0, -9.0, -1.0, -1.05]
    assert pick(neg, replace(base, repetition_penalty=1.1), prompt=[3]) == 4
    assert pick(neg, replace(base, frequency_penalty=-0.5), output=[4]) == 4


# ---- detokenization ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny)


def check_incremental(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_incremental_detokenization_never_splits_characters(tokenizer: Tokenizer) -> None:
    text = "héllo wörld € 你好"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    check_incremental(tokenizer, text)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab ,.éöü€你好🙂\n", max_size=24))
def test_incremental_detokenization_property(tokenizer: Tokenizer, text: str) -> None:
    check_incremental(tokenizer, text)


def _masked_min_gap(
    eng: LLMEngine, so: StructuredOutput, rows: list[torch.Tensor], tokens: list[int]
) -> float:
    """The smallest top-1/top-2 margin among the tokens the grammar allowed at each step
    (a replay of the request's matcher over its recorded logits)."""
    from engine.structured import apply_bitmask, fill_bitmask

    assert eng.grammars is not None
    matcher = eng.grammars.matcher(eng.grammars.compile(so))
    gaps = []
    for row, tok in zip(rows, tokens, strict=False):
        masked = row.clone().unsqueeze(0)
        bitmask, idx = fill_bitmask([(0, matcher)], 1, masked.shape[1])
        apply_bitmask(masked, bitmask, idx)
        top = masked[0].topk(2).values
        gaps.append(float(top[0] - top[1]))
        assert matcher.accept_token(tok)
    return min(gaps)


def test_preemption_by_recompute_keeps_a_constrained_request_on_its_grammar(
    make_engine: MakeEngine,
) -> None:
    """Preempted constrained requests resume with their matcher where it was (it accepted
    every output token, which preemption keeps): the same tokens as without preemption,
    every one allowed by the grammar."""
    rng = random.Random(5)
    prompts = [rand_prompt(rng, rng.randint(10, 40)) for _ in range(8)]
    so = StructuredOutput("regex", "[a-z ]{40,60}")
    params = greedy(max_tokens=48, structured=so)
    ref = make_engine()
    ref_rec = Recorder(ref)
    expected = ref.generate(prompts, params)
    assert ref.scheduler.num_preemptions == 0
    for r in expected:
        assert _masked_min_gap(ref, so, ref_rec.logits[r.request_id], r.output_token_ids) > MIN_GAP
        assert all(c in "abcdefghijklmnopqrstuvwxyz " for c in r.text)

    eng = make_engine(num_blocks=12)
    got = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0 and any(r.num_preemptions for r in got)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in expected]
    assert all(r.matcher is None for r in got)  # finished: each matcher let go
    assert eng.blocks.num_used_blocks == 0


def test_an_aborted_constrained_request_lets_its_matcher_go(make_engine: MakeEngine) -> None:
    eng = make_engine()
    params = greedy(max_tokens=8, structured=StructuredOutput("regex", "[a-z]+"))
    req = eng.add_request("constrained", rand_prompt(random.Random(6), 12), params)
    assert req.matcher is not None
    eng.step()
    assert eng.abort("constrained") and req.matcher is None and req.is_finished


def test_allowed_token_ids_pick_the_best_allowed_token(make_engine: MakeEngine) -> None:
    """vLLM's allowed_token_ids: every sampled token is one of them, and greedy picks the
    best of them by the model's own logits."""
    eng = make_engine()
    rec = Recorder(eng)
    prompt = rand_prompt(random.Random(7), 20)
    allowed = (5, 17, 42, 99, 300)
    (out,) = eng.generate([prompt], greedy(max_tokens=12, allowed_token_ids=allowed))
    assert set(out.output_token_ids) <= set(allowed)
    for row, tok in zip(rec.logits[out.request_id], out.output_token_ids, strict=True):
        assert tok == allowed[int(row[list(allowed)].argmax())]


def test_bad_words_never_complete(make_engine: MakeEngine) -> None:
    """vLLM's bad_words rule: a one-token word is never sampled; a longer word's last token
    is never sampled right after the rest of it. The words are taken from the unconstrained
    greedy output itself, so each would have appeared."""
    eng = make_engine()
    prompt = rand_prompt(random.Random(8), 20)
    (free,) = eng.generate([prompt], greedy(max_tokens=24))
    toks = free.output_token_ids
    one, two = (toks[3],), (toks[6], toks[7])
    (out,) = eng.generate([prompt], greedy(max_tokens=24, bad_words_token_ids=(one, two)))
    got = out.output_token_ids
    assert one[0] not in got
    assert all(tuple(got[i : i + 2]) != two for i in range(len(got) - 1))
    assert got[:3] == toks[:3] and got != toks  # the same until the first ban bites


def test_the_grammar_wins_over_bans_that_leave_it_no_token(make_engine: MakeEngine) -> None:
    """min_tokens past a complete grammar (only EOS is allowed then, and min_tokens bans
    it), and allowed_token_ids the grammar never allows: the row falls back to the
    grammar's own mask, so the request ends on its grammar instead of sampling a token its
    matcher refuses (which would kill the engine thread)."""
    eng = make_engine()
    tok = eng.tokenizer
    assert tok is not None
    choice = StructuredOutput("choice", '["yes", "no"]')
    prompt = rand_prompt(random.Random(9), 12)
    late = greedy(max_tokens=8, ignore_eos=False, min_tokens=8, structured=choice)
    allowed = tuple(tok.encode("zzz qqq", False))
    outside = greedy(max_tokens=8, ignore_eos=False, structured=choice, allowed_token_ids=allowed)
    for params in (late, outside):
        (out,) = eng.generate([prompt], params)
        assert out.text in ("yes", "no") and out.finish_reason is FinishReason.STOP, out.text
    assert not eng.has_unfinished()


def test_the_step_log_records_each_served_step_with_its_shape(
    make_engine: MakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PDSERVE_STEP_LOG`: the engine loop writes one line per step that ran, with the shape
    the scheduler ran: a 40-token prompt's pass, then decode rows reading 40, 41, ... tokens."""
    from engine.loop import STEP_LOG_ENV, EngineLoop

    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "steps"))
    eng = make_engine(max_num_batched_tokens=64)
    done = threading.Event()

    def on_outputs(outs: list[RequestOutput]) -> None:
        if any(o.finished for o in outs):
            done.set()

    loop = EngineLoop(eng, on_outputs, name="logged")
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        loop.call(lambda: eng.add_request("r", list(range(5, 45)), params)).result(10)
        assert done.wait(30)
        deadline = time.monotonic() + 10
        log = tmp_path / "steps" / f"logged-{os.getpid()}.jsonl"
        while time.monotonic() < deadline and len(log.read_text().splitlines()) < 4:
            time.sleep(0.05)  # flushed once the loop goes idle
    finally:
        loop.stop()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["chunks"], x["decode"]) for x in lines] == [
        ([[40, 0]], []), ([], [40]), ([], [41]), ([], [42])
    ]  # fmt: skip
    assert all(x["step_s"] > 0 and x["out_s"] >= 0 and x["gap_s"] >= 0 for x in lines)
    assert [x["rows"] for x in lines] == [1, 1, 1, 1]  # one token out per step
    assert lines[0]["gap_s"] == 0  # it followed an idle wait
