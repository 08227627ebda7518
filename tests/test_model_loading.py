"""Checkpoints the way users have them, on generated tiny models (the real one: test_real_model).

- weights: `pytorch_model.bin` (weights-only) gives the logits of the same weights as
  safetensors;
- tokenizers: a sentencepiece `tokenizer.model` is converted once and encodes as
  sentencepiece does;
- chat templates: `chat_template.jinja`, `--chat-template`, rendering equal to HF's
  `apply_chat_template` (special tokens, `raise_exception`, loop controls, `tojson`), and the
  template's own error reaching the client as a 400;
- `generation_config.json` defaults for unset fields, `max_model_len` from the checkpoint;
- what cannot load says so in one line: a Hub id offline, the named model offline, a
  checkpoint without a tokenizer; presets say they are random weights;
- every x86 CPU: `--dtype auto` and `--dtype bfloat16` choose their path by capability, the
  portable path is forced on every machine, the packed bf16 path runs where it exists.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import cpu  # noqa: E402
from engine.chat_template import ChatTemplateError  # noqa: E402
from engine.config import GenerationDefaults, ModelConfig, SchedulerConfig  # noqa: E402
from engine.engine import EngineConfig, LLMEngine, resolve_dtype  # noqa: E402
from engine.model import OneDnnProjections, Projections  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from pdserve.checkpoint import write_checkpoint  # noqa: E402
from pdserve.cli import main  # noqa: E402
from pdserve.models import ModelError, resolve_model  # noqa: E402
from protos.pdserve.v1 import generation_pb2 as gen  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.validation import ModelLimits, sampling_from_proto  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

MISTRAL_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# trim_blocks/lstrip_blocks matter here (the newlines after block tags vanish), as do loop
# controls, namespace() and a tojson that keeps non-ASCII text.
WHITESPACE_AND_LOOPS = """{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<{{ message['role'] }}>{{ message['content'] | tojson }}</s>
{% endfor %}
{% if add_generation_prompt %}<assistant>{{ ns.n }}{% endif %}"""
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüße, café?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "And again."},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


def _copy(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    return dst


def _greedy(path: Path, dtype: str = "float32", prompts: Any = None) -> list[list[int]]:
    engine = LLMEngine.from_config(EngineConfig(model=str(path), dtype=dtype))
    prompts = prompts or [[0, 5, 9, 31, 7], [0, 44, 3]]
    return [r.output_token_ids for r in engine.generate(prompts, GREEDY)]


# ---- weights -------------------------------------------------------------------------------
def test_pytorch_model_bin_loads_like_safetensors(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    binary = _copy(tiny, tmp_path / "bin", drop=("model.safetensors",))
    torch.save(load_file(str(tiny / "model.safetensors")), binary / "pytorch_model.bin")
    assert _greedy(binary) == _greedy(tiny)


def test_a_directory_without_weights_names_the_formats(tiny: Path, tmp_path: Path) -> None:
    bare = _copy(tiny, tmp_path / "bare", drop=("model.safetensors",))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*\.gguf"):
        LLMEngine.from_config(EngineConfig(model=str(bare)))


# ---- tokenizers ----------------------------------------------------------------------------
def test_sentencepiece_tokenizer_model_is_converted_once(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spm = pytest.importorskip("sentencepiece")
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the cache block {i} holds tokens of worker {i % 7}" for i in
                                range(400)))  # fmt: skip
    ckpt = _copy(tiny, tmp_path / "spm", drop=("tokenizer.json", "tokenizer_config.json"))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(ckpt / "tokenizer"), vocab_size=120,
        model_type="bpe", bos_id=0, eos_id=1, unk_id=2, pad_id=-1,
    )  # fmt: skip
    (ckpt / "tokenizer_config.json").write_text(
        json.dumps(  # as Llama 2's: the converted tokenizer must keep add_bos_token
            {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
             "add_bos_token": True}
        )
    )  # fmt: skip
    view = resolve_model(str(ckpt))
    assert view != ckpt and (view / "tokenizer.json").is_file()
    assert (view / "model.safetensors").resolve() == (ckpt / "model.safetensors").resolve()
    assert resolve_model(str(ckpt)) == view  # converted once
    ours = Tokenizer.from_dir(view)
    sp = spm.SentencePieceProcessor(model_file=str(ckpt / "tokenizer.model"))
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    for text in ("the cache block 12 holds tokens", "worker 3 of the cache"):
        assert ours.encode(text) == hf(text)["input_ids"] == [0, *sp.encode(text)]
        assert ours.decode(ours.encode(text)) == text


# ---- chat templates ------------------------------------------------------------------------
def _hf_render(ckpt: Path, template: str, messages: list[dict[str, str]], **special: str) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(ckpt, **special)
    return str(
        tok.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    )


@pytest.mark.parametrize("name", ["preset", "mistral_style", "whitespace_and_loops"])
def test_rendering_equals_hf_apply_chat_template(tiny: Path, tmp_path: Path, name: str) -> None:
    template = {
        "preset": None,
        "mistral_style": MISTRAL_STYLE,
        "whitespace_and_loops": WHITESPACE_AND_LOOPS,
    }[name]
    ckpt = tiny
    if template is not None:
        ckpt = _copy(tiny, tmp_path / name)
        (ckpt / "chat_template.jinja").write_text(template)
    ours = Tokenizer.from_dir(ckpt, ModelConfig.from_hf(ckpt))
    assert ours.chat_template is not None
    messages = CONVERSATION[1:] if name == "mistral_style" else CONVERSATION
    got = ours.apply_chat_template(messages)
    assert got == _hf_render(ckpt, ours.chat_template, messages)
    if name == "mistral_style":  # the real special tokens, not ""
        assert got.startswith("<s>[INST]") and "Hello.</s>[INST]" in got


def test_raise_exception_carries_the_templates_message(tiny: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny, tmp_path / "mistral")
    (ckpt / "chat_template.jinja").write_text(MISTRAL_STYLE)
    tok = Tokenizer.from_dir(ckpt)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match=r"^Conversation roles must alternate"):
        tok.apply_chat_template(bad)

    from router.http import HTTPError, chat_request

    router = SimpleNamespace(tokenizer=tok, limits=ModelLimits("m", 512, 2048), cfg=RouterConfig())
    with pytest.raises(HTTPError) as info:
        chat_request(router, {"model": "m", "messages": bad}, "r1")  # type: ignore[arg-type]
    assert (info.value.status, info.value.param) == (400, "messages")
    assert str(info.value).startswith("Conversation roles must alternate")


def test_chat_template_jinja_alone_and_the_override_flag(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers 5 writes the template to chat_template.jinja only; `--chat-template FILE`
    wins over the checkpoint's."""
    ckpt = _copy(tiny, tmp_path / "jinja-only")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    (ckpt / "chat_template.jinja").write_text(template)
    assert Tokenizer.from_dir(ckpt).chat_template == template
    override = tmp_path / "override.jinja"
    override.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    tok = Tokenizer.from_dir(ckpt, chat_template=override)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "Q: hi\nA:"
    base = ["generate", "--model", str(ckpt), "--chat", "--json", "--max-tokens", "3"]
    for extra in ([], ["--chat-template", str(override)]):
        assert main([*base, *extra, "hi"]) == 0
        (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        tok = Tokenizer.from_dir(ckpt, chat_template=override if extra else None)
        rendered = tok.encode_chat([{"role": "user", "content": "hi"}])
        assert record["prompt_token_ids"] == rendered


def test_chat_without_max_tokens_gets_the_rest_of_the_context(tiny: Path) -> None:
    from router.http import chat_request

    tok = Tokenizer.from_dir(tiny)
    router = SimpleNamespace(tokenizer=tok, limits=ModelLimits("m", 512, 2048), cfg=RouterConfig())
    messages = [{"role": "user", "content": "hello there"}]
    req = chat_request(router, {"model": "m", "messages": messages}, "r1")  # type: ignore[arg-type]
    ids = tok.encode_chat(messages)
    assert list(req.token_ids.ids) == ids  # BOS from the template only, not added again
    assert req.sampling.max_tokens == 2048 - len(ids)
    capped = chat_request(  # type: ignore[arg-type]
        router, {"model": "m", "messages": messages, "max_tokens": 5}, "r2"
    )
    assert capped.sampling.max_tokens == 5
    defaults = GenerationDefaults(max_tokens=100)  # generation_config's max_new_tokens
    router.limits = ModelLimits("m", 512, 2048, sampling_defaults=defaults)
    req = chat_request(router, {"model": "m", "messages": messages}, "r3")  # type: ignore[arg-type]
    assert req.sampling.max_tokens == 100


# ---- generation defaults, context length -------------------------------------------------------
def test_generation_config_defaults_apply_to_unset_fields(tiny: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny, tmp_path / "gencfg")
    gc = json.loads((ckpt / "generation_config.json").read_text())
    gc.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=0, repetition_penalty=1.1,
              max_new_tokens=77)  # fmt: skip
    (ckpt / "generation_config.json").write_text(json.dumps(gc))
    defaults = GenerationDefaults.from_dir(ckpt)
    assert defaults == GenerationDefaults(0.6, 0.9, None, None, 1.1, 77)
    unset = sampling_from_proto(gen.SamplingParams(), defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, None)
    assert (unset.repetition_penalty, unset.max_tokens) == (1.1, 77)
    given = sampling_from_proto(
        gen.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=5), defaults
    )
    assert (given.temperature, given.top_p, given.max_tokens) == (0.0, 1.0, 5)
    plain = sampling_from_proto(gen.SamplingParams(), GenerationDefaults.from_dir(tiny))
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)  # OpenAI's defaults


def test_max_model_len_defaults_to_the_checkpoints(tiny: Path) -> None:
    mcfg = ModelConfig.from_hf(tiny)
    assert SchedulerConfig().context_len(mcfg) == mcfg.max_position_embeddings == 2048
    assert SchedulerConfig(max_model_len=512).context_len(mcfg) == 512
    assert SchedulerConfig(max_model_len=10**6).context_len(mcfg) == 2048
    assert LLMEngine.from_config(EngineConfig(model=str(tiny))).max_model_len == 2048


# ---- what cannot load says so -----------------------------------------------------------------
def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        cwd=ROOT,
        env={**full, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_hub_id_offline_is_one_clear_line(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PDSERVE_HOME": str(tmp_path)}
    proc = _cli(["generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "hi"], env)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "offline" in line and "--model tiny" in line and "smollm2-135m-instruct" in line


def _hub_cache(hf_home: Path, repo: str, commits: dict[str, int], main: str) -> None:
    """A Hugging Face cache holding `repo` at each commit (a tiny checkpoint of that weights
    seed) with refs/main at `main`: what `snapshot_download` finds offline."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    for commit, seed in commits.items():
        write_checkpoint("tiny", root / "snapshots" / commit, seed=seed)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(main)


def test_revision_picks_the_hub_snapshot(tmp_path: Path) -> None:
    """`--revision` reaches huggingface_hub: a commit serves that snapshot, none serves the
    default branch, an unknown one offline is one clear line; a non-Hub --model refuses it."""
    a, b = "a" * 40, "b" * 40
    _hub_cache(tmp_path / "hf", "acme/tiny", {a: 1, b: 2}, main=a)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PDSERVE_HOME": str(tmp_path)}
    resolve = "import sys; from pdserve.models import resolve_model as r; print(r(*sys.argv[1:]))"
    for revision, commit in ((b, b), ("main", a), (None, a)):
        args = ["acme/tiny", "0", "float32"] + ([revision] if revision else [])
        cmd = [sys.executable, "-c", resolve, *args]
        full = {**os.environ, **env}
        proc = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert Path(proc.stdout.strip()).name == commit
    gen_args = ["generate", "--model", "acme/tiny", "--max-tokens", "2", "hi"]
    assert _cli([*gen_args, "--revision", b], env).returncode == 0
    proc = _cli([*gen_args, "--revision", "c" * 40], env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "acme/tiny" in line and "offline" in line
    with pytest.raises(ModelError, match="--revision 'main' applies to a Hugging Face Hub id"):
        resolve_model("tiny", revision="main")


def test_named_model_offline_names_the_alternatives(tmp_path: Path) -> None:
    env = {
        "PDSERVE_HOME": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    }
    proc = _cli(["generate", "--chat", "What is the capital of France?"], env)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve: error: --model smollm2-135m-instruct: could not download")
    assert "--model tiny" in last and "--model DIR" in last


def test_a_checkpoint_without_tokenizer_is_refused_at_start(tiny: Path, tmp_path: Path) -> None:
    bare = _copy(tiny, tmp_path / "no-tok", drop=("tokenizer.json",))
    with pytest.raises(ModelError, match="has no tokenizer"):
        from pdserve.cli import load_engine

        load_engine(str(bare), "auto")
    proc = _cli(["serve", "--model", str(bare), "--grpc-port", "0", "--no-http"], {})
    assert proc.returncode == 2
    assert "has no tokenizer" in proc.stderr and "Traceback" not in proc.stderr


def test_presets_say_random_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="pdserve.models"):
        resolve_model("tiny")
    assert "random weights" in caplog.text


def test_unknown_model_names_what_would_work() -> None:
    with pytest.raises(ModelError, match=r"not a preset \(small, tiny\), not a named model"):
        resolve_model("./no/such/dir")


# ---- every x86 CPU ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny-bf16"), dtype="bfloat16")


def test_dtype_auto_takes_bf16_only_with_bf16_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    want = torch.bfloat16 if cpu.has_bf16_hardware() else torch.float32
    assert resolve_dtype("auto", "bfloat16", "cpu") == want
    assert resolve_dtype("auto", "float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "float32", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "float32", "cpu") == torch.float32
    monkeypatch.setenv("PDSERVE_PORTABLE_CPU", "1")
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32


def test_portable_bf16_path_runs_on_every_cpu(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced on every machine so the path AVX2-only CPUs take cannot rot."""
    monkeypatch.setenv("PDSERVE_PORTABLE_CPU", "1")
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_bf16), dtype="bfloat16"))
    assert type(engine.runner.model.proj) is Projections
    assert engine.runner.model.dtype == torch.bfloat16
    out = engine.generate([[0, 5, 9, 31, 7]], GREEDY)[0].output_token_ids
    assert len(out) == GREEDY.max_tokens


@pytest.mark.skipif(
    not cpu.onednn_bf16_supported(), reason="this CPU has no oneDNN bf16 (AVX512/AVX-NE-CONVERT)"
)
def test_packed_bf16_path_where_the_cpu_has_it(tiny_bf16: Path) -> None:
    cfg = EngineConfig(model=str(tiny_bf16), dtype="bfloat16", kernels="projections=packed")
    engine = LLMEngine.from_config(cfg)
    assert isinstance(engine.runner.model.proj, OneDnnProjections)
    assert len(engine.generate([[0, 5, 9]], GREEDY)[0].output_token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_generate_a_bf16_checkpoint_on_this_cpu(
    tiny_bf16: Path, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_bf16), "--dtype", dtype, "--json", "--max-tokens", "4"]
    assert main([*args, "hello world"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(record["token_ids"]) >= 1


def test_two_fetches_of_one_named_model_download_and_convert_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes (here threads: each holds its own lock file handle) fetching the same
    named model at once: the second waits for the first's result instead of downloading
    and converting beside it (a fresh clone's suite had two pytest workers write one
    `.part` file, and one renamed it from under the other)."""
    import threading
    import time as _time

    import pdserve.models as models

    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    calls: list[str] = []

    def fake_fetch(name: str, spec: Any) -> Path:  # the download: slow, counted
        calls.append("fetch")
        _time.sleep(0.3)
        gguf = tmp_path / "downloads" / "model.gguf"
        gguf.parent.mkdir(parents=True, exist_ok=True)
        gguf.write_bytes(b"gguf")
        return gguf

    def fake_convert(gguf: Path, work: Path, dtype: str) -> None:
        calls.append("convert")
        work.mkdir(parents=True)
        (work / "config.json").write_text("{}")
        (work / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(models, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    got: list[Path] = []
    threads = [
        threading.Thread(target=lambda: got.append(models.fetch_named(models.DEFAULT_MODEL)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["fetch", "convert"], calls
    assert len(got) == 2 and got[0] == got[1] and (got[0] / "config.json").is_file()
