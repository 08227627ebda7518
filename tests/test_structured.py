"""Structured outputs across the prefill -> decode handover, on the real default model.

In-process workers (`tests.in_process.run_with_workers`, the `local` KV transport) behind a
started Router: JSON schemas of every common shape give output that parses and validates
(`jsonschema`), in colocated and disaggregated mode, token for token the same in both; in the
disaggregated mode token #1 is sampled on the prefill worker under the grammar and only
checked on the decode worker (its matcher accepts it; its engine runs no prompt pass). The
grammar's fingerprint guards the pairing. A constrained row leaves the unconstrained rows of
its batch untouched, a preempted constrained request resumes its matcher, and a grammar that
does not compile, or not in time, is a 400 at the edge.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from decode_workers.worker import DecodeWorker
from engine.config import CacheConfig
from engine.engine import EngineConfig, LLMEngine
from engine.request import GrammarRejected
from engine.sampling import InvalidParameterError, SamplingParams
from engine.structured import StructuredOutput
from pdserve.client import make_request
from pdserve.config import ServeConfig
from pdserve.models import DEFAULT_MODEL, resolve_model
from prefill_workers.worker import PrefillWorker
from protos.pdserve.v1 import generation_pb2 as gen
from router.active import RequestFailed
from tests.in_process import all_of, run_with_workers
from tests.structured_data import PROMPTS, SCHEMAS, SLOW_SCHEMA

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def real_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


def config(model: Path, colocated: bool) -> ServeConfig:
    return ServeConfig.load(
        None,
        {
            "model": {"model": str(model)},
            "transfer": {"transport": "local"},
            "colocated": colocated,
            "cache": {"num_blocks": 128},  # room enough; the default is 754 MiB a worker
        },
    )


def chat_ids(real_dir: Path, prompt: str) -> list[int]:
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(real_dir)
    return tok.encode_chat([{"role": "user", "content": prompt}])


def json_request(ids: list[int], rid: str, schema: dict[str, Any]) -> gen.GenerateRequest:
    r = make_request(ids, rid, temperature=0.0, max_tokens=MAX_TOKENS)
    r.structured_output.json_schema = json.dumps(schema)
    return r


async def drive(router: Any, request: gen.GenerateRequest) -> tuple[str, list[int], int]:
    """One request to its end: (text, token ids, finish reason)."""
    act = await router.admit(request)
    text, ids, reason, completed = "", [], 0, False
    try:
        async for resp in router.run(act):
            if resp.HasField("chunk"):
                text += resp.chunk.text
                ids += resp.chunk.token_ids
            else:
                reason, completed = resp.complete.finish_reason, True
    finally:
        router.finish(act, completed)
    return text, ids, reason


def run_schemas(real_dir: Path, colocated: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Every (schema, prompt) once, all at once where the kernels are batch-invariant
    (`tests.in_process.all_of`: both modes compute the same tokens either way); the
    results, and the decode worker's counters."""
    prompts = [chat_ids(real_dir, p) for p in PROMPTS]
    out: dict[str, Any] = {}
    counts: dict[str, float] = {}

    async def body(router: Any, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        prompt_chunks = 0
        forward = decode.engine.runner.step

        def counted(chunks: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal prompt_chunks
            prompt_chunks += len(chunks)  # prompt chunks in this step (mixed or not)
            return forward(chunks, *args, **kwargs)

        decode.engine.runner.step = counted  # type: ignore[method-assign]
        calls = {
            f"s{i}-p{j}": drive(router, json_request(ids, f"s{i}-p{j}", schema))
            for i, schema in enumerate(SCHEMAS)
            for j, ids in enumerate(prompts)
        }
        out.update(await all_of((prefill, decode), calls))
        counts["decode_prompt_chunks"] = prompt_chunks
        counts["first_tokens_checked"] = decode.num_first_tokens_checked
        counts["prefill_requests"] = prefill.num_requests_total

    run_with_workers(config(real_dir, colocated), real_dir, body)
    return out, counts


@pytest.fixture(scope="module")
def both_modes(real_dir: Path) -> dict[str, tuple[dict[str, Any], dict[str, float]]]:
    return {"colocated": run_schemas(real_dir, True), "disaggregated": run_schemas(real_dir, False)}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_every_json_schema_output_parses_and_validates(
    both_modes: dict[str, tuple[dict[str, Any], dict[str, float]]], mode: str
) -> None:
    results, _ = both_modes[mode]
    assert len(results) == len(SCHEMAS) * len(PROMPTS)
    for key, (text, _, reason) in results.items():
        schema = SCHEMAS[int(key[1 : key.index("-")])]
        assert reason == gen.FINISH_REASON_STOP, (key, text)
        jsonschema.validate(json.loads(text), schema)


def test_colocated_and_disaggregated_are_equal_token_for_token(
    both_modes: dict[str, tuple[dict[str, Any], dict[str, float]]],
) -> None:
    colocated, _ = both_modes["colocated"]
    disaggregated, _ = both_modes["disaggregated"]
    for key in colocated:
        assert colocated[key][1] == disaggregated[key][1], key


def test_token_one_is_checked_on_the_decode_side_never_recomputed(
    both_modes: dict[str, tuple[dict[str, Any], dict[str, float]]],
) -> None:
    """Disaggregated: every request's prompt pass ran on the prefill worker, and the decode
    worker's matcher accepted its token #1 without a prompt pass of its own."""
    _, counts = both_modes["disaggregated"]
    n = len(SCHEMAS) * len(PROMPTS)
    assert counts == {
        "decode_prompt_chunks": 0,
        "first_tokens_checked": n,
        "prefill_requests": n,
    }, counts
    _, colocated = both_modes["colocated"]
    assert colocated["first_tokens_checked"] == 0 and colocated["decode_prompt_chunks"] >= n


# ---- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(real_dir: Path) -> LLMEngine:
    cache = CacheConfig(num_blocks=128)  # the test process keeps its peak heap
    return LLMEngine.from_config(EngineConfig(str(real_dir), dtype="float32", cache=cache))


def test_a_constrained_row_leaves_the_others_in_its_batch_untouched(
    engine: LLMEngine, real_dir: Path
) -> None:
    """The same four-row batch twice, its last row constrained or not: the first three rows'
    tokens are equal (each run keeps four rows through their 8 tokens, so both compute the
    same batch shapes: the free last row runs its 8 tokens whatever it samples), and the
    constrained row's output validates."""
    ids = [chat_ids(real_dir, p) for p in [*PROMPTS, "Name three primary colors.", PROMPTS[0]]]
    free = SamplingParams(temperature=0.0, max_tokens=8)
    long_free = replace(free, ignore_eos=True)
    constrained = replace(
        free, max_tokens=MAX_TOKENS, structured=StructuredOutput("json", json.dumps(SCHEMAS[0]))
    )
    reference = engine.generate(ids, [free, free, free, long_free])
    mixed = engine.generate(ids, [free, free, free, constrained])
    assert [r.output_token_ids for r in mixed[:3]] == [r.output_token_ids for r in reference[:3]]
    assert len(mixed[3].output_token_ids) > 8
    jsonschema.validate(json.loads(mixed[3].text), SCHEMAS[0])
    assert mixed[3].text != reference[3].text


def test_logit_bias_moves_only_its_own_row(engine: LLMEngine, real_dir: Path) -> None:
    ids = chat_ids(real_dir, PROMPTS[0])
    free = SamplingParams(temperature=0.0, max_tokens=8)
    forced = replace(free, logit_bias=((engine.tokenizer.encode("!", False)[0], 100.0),))
    plain, biased = engine.generate([ids, ids], [free, forced])
    assert biased.text == "!" * 8 and plain.text != biased.text
    reference = engine.generate([ids, ids], [free, free])[0]
    assert plain.output_token_ids == reference.output_token_ids


def test_a_token_one_that_breaks_the_grammar_is_refused_and_frees_its_blocks(
    engine: LLMEngine, real_dir: Path
) -> None:
    """The decode side's check of a prefill worker's token #1 (here: a token no JSON object
    may start with) refuses it before anything runs, and lets the reserved blocks go."""
    ids = chat_ids(real_dir, PROMPTS[0])
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured=StructuredOutput("json_object")
    )
    req = engine.make_request("bad-first", ids, params)
    free_before = engine.blocks.num_free_blocks
    engine.blocks.allocate("bad-first", [], len(ids) + 1)
    bad = engine.tokenizer.encode("hello", False)[0]
    with pytest.raises(GrammarRejected, match="breaks its grammar"):
        engine.add_prefilled(req, [bad])
    assert engine.blocks.num_free_blocks == free_before and not engine.has_unfinished()


# ---- the edge -----------------------------------------------------------------------------
def test_a_grammar_that_is_wrong_or_too_slow_is_refused_at_the_edge(real_dir: Path) -> None:
    """A regex that does not parse is INVALID_ARGUMENT naming the field; a schema whose
    compile outlasts the bound (1 s here) too, at the bound, with the other requests served
    meanwhile; its repeat is refused at once. No worker sees either."""
    ids = chat_ids(real_dir, PROMPTS[0])

    async def body(router: Any, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        assert router.grammar_check is not None
        router.grammar_check.timeout_s = 1.0
        bad = make_request(ids, "bad-regex", max_tokens=4)
        bad.structured_output.regex = "(unclosed"
        with pytest.raises(RequestFailed) as e:
            await router.admit(bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details.startswith("structured_output: does not compile")
        # warm: the checker's child is up, so the slow schema meets the compile bound alone
        await drive(router, json_request(ids, "warm", SCHEMAS[1]))

        slow = make_request(ids, "slow", max_tokens=4)
        slow.structured_output.json_schema = json.dumps(SLOW_SCHEMA)
        t0 = time.perf_counter()
        refused = asyncio.ensure_future(router.admit(slow))
        others = [
            await drive(router, make_request(ids, f"other-{i}", max_tokens=4, temperature=0.0))
            for i in range(3)
        ]
        with pytest.raises(RequestFailed, match="did not compile within 1 s"):
            await refused
        assert time.perf_counter() - t0 < 5.0
        assert all(reason == gen.FINISH_REASON_LENGTH for _, _, reason in others)
        t1 = time.perf_counter()
        with pytest.raises(RequestFailed, match="did not compile within 1 s"):
            await router.admit(slow)
        assert time.perf_counter() - t1 < 0.5  # remembered
        assert prefill.num_requests_total == 4  # warm and the three others: never the slow one

    cfg = config(real_dir, colocated=False)
    run_with_workers(cfg, real_dir, body)


@pytest.mark.parametrize("case", ["bad-regex", "slow-schema"])
def test_a_cold_checker_times_the_compile_alone(real_dir: Path, case: str) -> None:
    """A checker whose child has never started (the router's first structured request, or
    the first after a killed child): a regex that does not parse is refused as not
    compiling and a slow schema as too complex, whatever the child's start-up costs (it is
    not counted against the 1 s bound)."""
    from engine.tokenizer import Tokenizer
    from router.grammar_check import GrammarChecker, TokenizerSpec

    tok = Tokenizer.from_dir(real_dir)
    spec = TokenizerSpec(tok.to_str(), 49152, tok.eos_token_ids)
    checker = GrammarChecker(spec, timeout_s=1.0)
    try:
        if case == "bad-regex":
            so = StructuredOutput("regex", "(unclosed", "structured_output")
            with pytest.raises(InvalidParameterError, match="does not compile"):
                asyncio.run(checker.check(so))
        else:
            so = StructuredOutput("json", json.dumps(SLOW_SCHEMA), "structured_output")
            with pytest.raises(InvalidParameterError, match="did not compile within 1 s"):
                asyncio.run(checker.check(so))
    finally:
        checker.close()


def test_closing_the_router_while_its_checker_starts_is_quiet(
    real_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The router starts its checker at start-up, in the background; a router stopped while
    the child still starts (a SIGTERM seconds after start) kills it, and the start-up thread
    ends quietly: no uncaught exception's traceback, and no warning (the stop was asked
    for) in the server's log."""
    import threading

    from engine.tokenizer import Tokenizer
    from router.grammar_check import GrammarChecker, TokenizerSpec

    tok = Tokenizer.from_dir(real_dir)
    checker = GrammarChecker(TokenizerSpec(tok.to_str(), 49152, tok.eos_token_ids), 1.0)
    uncaught: list[object] = []
    hook = threading.excepthook
    threading.excepthook = uncaught.append
    try:
        starting = checker.start()
        deadline = time.monotonic() + 30
        while checker._proc is None:  # the child is being started
            assert time.monotonic() < deadline
            time.sleep(0.01)
        checker.close()
        starting.join(30)
    finally:
        threading.excepthook = hook
    assert not starting.is_alive() and uncaught == []
    if checker._proc is not None:  # killed: it exits at once
        checker._proc.join(10)
        assert not checker._proc.is_alive()
    assert "did not start" not in caplog.text


def test_ctrl_c_while_the_checker_starts_reaches_only_the_server(
    real_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A terminal's Ctrl-C goes to the whole process group, the checker's child included,
    which starts at the router's start-up and spends a second importing before its loop
    ignores SIGINT. SIGINTs sent to it all through its start-up: it starts, compiles, and
    no KeyboardInterrupt traceback reaches the terminal."""
    import signal

    from engine.tokenizer import Tokenizer
    from router.grammar_check import GrammarChecker, TokenizerSpec

    tok = Tokenizer.from_dir(real_dir)
    checker = GrammarChecker(TokenizerSpec(tok.to_str(), 49152, tok.eos_token_ids), 5.0)
    try:
        starting = checker.start()
        deadline = time.monotonic() + 60
        sent = 0
        while starting.is_alive():
            assert time.monotonic() < deadline
            proc = checker._proc
            if proc is not None and proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGINT)
                sent += 1
            time.sleep(0.005)
        assert sent >= 10, sent
        asyncio.run(checker.check(StructuredOutput("regex", "[a-z]+", "structured_output")))
        assert checker._proc is not None and checker._proc.is_alive()
    finally:
        checker.close()
    err = capfd.readouterr().err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err


def test_structural_tags_in_both_forms_constrain_the_tagged_part(
    engine: LLMEngine, real_dir: Path
) -> None:
    """vLLM's `structures`/`triggers` form and xgrammar's `format` form: text is free until
    a trigger, then the tagged part follows its schema."""
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<weather>", "schema": weather, "end": "</weather>"}],
        "triggers": ["<weather>"],
    }
    modern = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "<weather>"},
                {"type": "json_schema", "json_schema": weather},
                {"type": "const_string", "value": "</weather>"},
            ],
        },
    }
    ids = chat_ids(real_dir, "What is the weather in Paris?")
    assert engine.grammars is not None
    for tag in (legacy, modern):
        so = StructuredOutput("structural_tag", json.dumps(tag))
        engine.grammars.compile(so)  # compiles
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        structured=StructuredOutput("structural_tag", json.dumps(modern)),
    )
    (out,) = engine.generate([ids], params)
    assert out.text.startswith("<weather>") and out.text.endswith("</weather>"), out.text
    jsonschema.validate(json.loads(out.text[len("<weather>") : -len("</weather>")]), weather)
