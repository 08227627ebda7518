"""pdserve against HuggingFace `transformers`: the same checkpoint gives the same numbers.

Checkpoints are written by transformers' own ``save_pretrained`` (Llama with llama3 RoPE
scaling, tied embeddings and an explicit ``head_dim``; Mistral with a small sliding window;
Qwen2 with q/k/v biases and per-layer windows), plus variants of the Llama one: the older
``config.json`` key spellings and a sharded save. pdserve must reproduce HF's float32
last-position logits to 1e-4 and HF ``generate``'s greedy token ids exactly.

Greedy equality is only meaningful where no two top logits are within float noise of each
other, so every trajectory asserts its smallest top-1/top-2 gap instead of loosening
equality: if a change of seed or library makes a gap tiny, the test says so.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from engine.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

LOGIT_ATOL = 1e-4  # fp32 logits, pdserve vs HF
MIN_GREEDY_GAP = 1e-3  # top-1 minus top-2 logit along every compared greedy trajectory
NEW_TOKENS = 64
PROMPT_LENGTHS = (1, 6, 19, 41)  # one token; inside a window; past windows and blocks
INIT_STD = 0.15


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """These models are tiny: one thread is fastest, and immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- building HF checkpoints -------------------------------------------------------------
def _widen_init(model: Any, seed: int) -> None:
    """Re-draw every parameter (biases too) wider than HF's 0.02 init.

    With HF's init a tiny random model's logits are nearly flat and greedy decoding repeats
    one token; N(0, INIT_STD) matrices give varied output and clear top-1 margins. Norm
    weights stay near 1 (1 + N(0, 0.1)) so they still scale rather than flip signs.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(INIT_STD * noise)


def _llama_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden_size / num_attention_heads (24)
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        # original_max_position_embeddings=32 puts rotary frequencies in all three llama3
        # bands at head_dim 32: kept (wavelength < 8), smoothed (8..32) and divided (> 32).
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        bos_token_id=0,
        eos_token_id=1,
    )


def _mistral_config() -> Any:
    return transformers.MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=1,
    )


def _qwen2_config() -> Any:
    # Layer 0 attends to everything, layers 1 and 2 to a 16-token window (max_window_layers).
    return transformers.Qwen2Config(
        vocab_size=448,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=0,
        eos_token_id=1,
    )


def _qwen3_config() -> Any:
    # q/k norms over each head; head_dim 32 != hidden / heads (24)
    return transformers.Qwen3Config(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=0,
        eos_token_id=1,
    )


def _smollm3_config() -> Any:
    # no RoPE on every fourth layer: layer 3 of 4
    return transformers.SmolLM3Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        no_rope_layer_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=None,
        bos_token_id=0,
        eos_token_id=1,
    )


def _gemma3_config() -> Any:
    # 5 sliding layers (window 8, local RoPE base) then a global one (linear scaling)
    return transformers.Gemma3TextConfig(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=256,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )


def _yarn_config() -> Any:
    # Qwen2.5's long-context setting at a small scale: trained on 32 positions, served to 128
    return transformers.Qwen2Config(
        vocab_size=448,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        bos_token_id=0,
        eos_token_id=1,
    )


# (class, config, seed). Seeds are picked so that every compared greedy trajectory has a
# top-1/top-2 margin of several times MIN_GREEDY_GAP (asserted below, not assumed).
MODELS = {
    "llama": (transformers.LlamaForCausalLM, _llama_config, 1),
    "mistral": (transformers.MistralForCausalLM, _mistral_config, 7),
    "qwen2": (transformers.Qwen2ForCausalLM, _qwen2_config, 8),
    "qwen3": (transformers.Qwen3ForCausalLM, _qwen3_config, 18),
    "smollm3": (transformers.SmolLM3ForCausalLM, _smollm3_config, 1),
    "gemma3": (transformers.Gemma3ForCausalLM, _gemma3_config, 1),
    "yarn": (transformers.Qwen2ForCausalLM, _yarn_config, 3),
}


@dataclass
class HFReference:
    """One HF model's answers for the shared prompts, computed once per module."""

    model: Any
    path: Path
    prompts: list[list[int]]
    last_logits: list[torch.Tensor]  # per prompt, [V] float32
    greedy: list[list[int]]  # per prompt, NEW_TOKENS ids
    step_logits: list[torch.Tensor]  # per prompt, [NEW_TOKENS, V] raw logits of each step


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 2 up: skip bos/eos so a prompt never contains them by accident.
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF ``generate(do_sample=False)`` for exactly `n` tokens; returns ids and raw logits."""
    # `generate` fills unset options from `model.generation_config`, so an `eos_token_id=None`
    # argument would fall back to the checkpoint's EOS: clear it there instead.
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float()  # [n, V]
    assert len(ids) == n, f"HF stopped after {len(ids)} tokens"
    # No logits processor changed a choice: each id is the argmax of its raw logits.
    assert ids == logits.argmax(-1).tolist()
    return ids, logits


@torch.no_grad()
def hf_last_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0, -1].float()


def top_gap(logits: torch.Tensor) -> float:
    """Smallest top-1 minus top-2 margin over the rows of `logits` ([N, V] or [V])."""
    top2 = logits.reshape(-1, logits.shape[-1]).topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


@pytest.fixture(scope="module")
def hf_refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HFReference]:
    refs = {}
    for name, (cls, make_cfg, seed) in MODELS.items():
        torch.manual_seed(seed)
        model = cls(make_cfg()).to(torch.float32).eval()
        _widen_init(model, seed)
        path = tmp_path_factory.mktemp(f"hf_{name}")
        model.save_pretrained(path)
        prompts = _prompts(model.config.vocab_size, seed)
        greedy, steps = zip(*(hf_greedy(model, p, NEW_TOKENS) for p in prompts), strict=True)
        refs[name] = HFReference(
            model=model,
            path=path,
            prompts=prompts,
            last_logits=[hf_last_logits(model, p) for p in prompts],
            greedy=list(greedy),
            step_logits=list(steps),
        )
    return refs


# ---- checkpoint variants -----------------------------------------------------------------
def _old_keys(src: Path, dst: Path, type_key: str) -> Path:
    """Copy a checkpoint, rewriting config.json in the pre-transformers-5 spelling.

    ``rope_parameters`` becomes a top-level ``rope_theta`` plus ``rope_scaling`` (null when
    the type is default, with the type under `type_key` otherwise), ``dtype`` becomes
    ``torch_dtype``, and ``layer_types`` (added in transformers 4.53) is dropped, so Qwen2's
    windows come from ``use_sliding_window`` and ``max_window_layers`` alone.
    """
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _edited(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of a checkpoint whose config.json `edit(dict)` changed in place."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _gemma3_old_keys(cfg: dict[str, Any]) -> None:
    """Gemma 3's transformers-4 spelling: `rope_theta`, `rope_scaling` (the global layers'),
    `rope_local_base_freq` (the sliding layers'), `sliding_window_pattern` for the layers."""
    rope = cfg.pop("rope_parameters")
    full, local = dict(rope["full_attention"]), rope["sliding_attention"]
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    cfg["rope_local_base_freq"] = local["rope_theta"]
    cfg["sliding_window_pattern"] = 6
    cfg.pop("layer_types")


@pytest.fixture(scope="module")
def variants(
    hf_refs: dict[str, HFReference], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[str, Path]]:
    """Variant name -> (the HF reference it must match, checkpoint directory)."""
    out = {name: (name, ref.path) for name, ref in hf_refs.items()}
    llama = hf_refs["llama"]
    for type_key in ("rope_type", "type"):
        dst = tmp_path_factory.mktemp("old_keys") / f"llama_{type_key}"
        out[f"llama_old_keys_{type_key}"] = ("llama", _old_keys(llama.path, dst, type_key))
    dst = tmp_path_factory.mktemp("old_keys") / "qwen2"
    out["qwen2_old_keys"] = ("qwen2", _old_keys(hf_refs["qwen2"].path, dst, "type"))
    out["smollm3_interval_only"] = ("smollm3", _edited(
        hf_refs["smollm3"].path, tmp_path_factory.mktemp("smollm3") / "interval",
        lambda c: c.pop("no_rope_layers"),
    ))  # fmt: skip
    out["gemma3_old_keys"] = ("gemma3", _edited(
        hf_refs["gemma3"].path, tmp_path_factory.mktemp("gemma3") / "old", _gemma3_old_keys
    ))  # fmt: skip
    for name in ("llama", "qwen2"):
        sharded = tmp_path_factory.mktemp(f"sharded_{name}")
        hf_refs[name].model.save_pretrained(sharded, max_shard_size="40KB")
        out[f"{name}_sharded"] = (name, sharded)
    return out


VARIANTS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "gemma3",
    "yarn",
    "llama_old_keys_rope_type",
    "llama_old_keys_type",
    "qwen2_old_keys",
    "llama_sharded",
    "qwen2_sharded",
    "smollm3_interval_only",
    "gemma3_old_keys",
]


def test_checkpoint_variants_are_what_they_claim(
    variants: dict[str, tuple[str, Path]], hf_refs: dict[str, HFReference]
) -> None:
    """Guard the fixtures: each variant exercises the feature it is named after."""
    llama = ModelConfig.from_hf(variants["llama"][1])
    assert llama.rope_scaling.rope_type == "llama3" and llama.rope_scaling.factor == 8.0
    assert llama.tie_word_embeddings and llama.head_dim * llama.num_heads != llama.hidden_size
    with safe_open(str(variants["llama"][1] / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 - the tie is the loader's job
    for type_key in ("rope_type", "type"):
        path = variants[f"llama_old_keys_{type_key}"][1]
        raw = json.loads((path / "config.json").read_text())
        assert "rope_parameters" not in raw and "dtype" not in raw
        assert raw["rope_scaling"][type_key] == "llama3" and raw["torch_dtype"] == "float32"
        assert ModelConfig.from_hf(path) == llama
    for name in ("llama_sharded", "qwen2_sharded"):
        path = variants[name][1]
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert not (path / "model.safetensors").exists()
    assert ModelConfig.from_hf(variants["mistral"][1]).sliding_windows == (8, 8)
    qwen2 = ModelConfig.from_hf(variants["qwen2"][1])
    assert qwen2.attention_bias and qwen2.sliding_windows == (None, 16, 16)
    old_qwen2 = variants["qwen2_old_keys"][1]
    raw = json.loads((old_qwen2 / "config.json").read_text())
    assert raw["rope_scaling"] is None and "layer_types" not in raw and "dtype" not in raw
    assert ModelConfig.from_hf(old_qwen2) == qwen2
    bias = hf_refs["qwen2"].model.model.layers[0].self_attn.q_proj.bias
    assert bias is not None and float(bias.detach().abs().max()) > 0.1
    qwen3 = ModelConfig.from_hf(variants["qwen3"][1])
    assert qwen3.qk_norm and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size
    smollm3 = ModelConfig.from_hf(variants["smollm3"][1])
    assert smollm3.layer_rope == ("global", "global", "global", "none")
    assert ModelConfig.from_hf(variants["smollm3_interval_only"][1]) == smollm3
    gemma3 = ModelConfig.from_hf(variants["gemma3"][1])
    assert gemma3.gemma_norms and gemma3.qk_norm and gemma3.hidden_act == "gelu_tanh"
    assert gemma3.layer_rope == ("local",) * 5 + ("global",)
    assert gemma3.sliding_windows == (8,) * 5 + (None,)
    assert gemma3.rope_scaling.rope_type == "linear" and gemma3.local_rope_theta == 10000.0
    assert gemma3.query_scale == 24**-0.5 and gemma3.tie_word_embeddings
    assert ModelConfig.from_hf(variants["gemma3_old_keys"][1]) == gemma3
    yarn = ModelConfig.from_hf(variants["yarn"][1])
    assert yarn.rope_scaling.rope_type == "yarn" and yarn.max_position_embeddings == 128
    # Prompts plus output run past the yarn model's original 32 positions,
    # past every window and past several KV blocks.
    assert max(PROMPT_LENGTHS) + NEW_TOKENS > 4 * 16


def test_hf_greedy_trajectories_are_decisive(hf_refs: dict[str, HFReference]) -> None:
    """The references are worth comparing: varied output, no near-ties to flip."""
    for name, ref in hf_refs.items():
        for prompt, ids, steps in zip(ref.prompts, ref.greedy, ref.step_logits, strict=True):
            assert len(set(ids)) >= 12, f"{name}: greedy output barely varies: {ids}"
            gap = top_gap(steps)
            assert gap > MIN_GREEDY_GAP, f"{name} prompt len {len(prompt)}: top-2 gap {gap:.2e}"


# ---- pdserve side ------------------------------------------------------------------------
_request_ids = itertools.count()


def prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of `prompt` from one prefill step; the request is then dropped."""
    rid = f"logits-{next(_request_ids)}"
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1))
    out = engine.scheduler.schedule()
    assert len(out.prefill) == 1 and out.prefill[0].completes_prompt, "prompt did not fit a step"
    logits = engine.runner.step(out.prefill, ())  # [1, V]
    assert engine.abort(rid)
    assert not engine.has_unfinished()
    return logits[0]


def first_divergence(got: list[int], want: list[int]) -> str:
    pairs = enumerate(zip(got, want, strict=False))
    i = next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
    return f"first differs at output position {i} of {len(want)} ({len(got)} generated)"


def greedy_params(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_logits_and_greedy_match_hf(
    variant: str, variants: dict[str, tuple[str, Path]], hf_refs: dict[str, HFReference]
) -> None:
    ref_name, path = variants[variant]
    ref = hf_refs[ref_name]
    engine = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32"))
    assert engine.runner.model.dtype == torch.float32

    for prompt, want in zip(ref.prompts, ref.last_logits, strict=True):
        got = prefill_logits(engine, prompt)
        diff = float((got - want).abs().max())
        assert diff <= LOGIT_ATOL, f"{variant}, prompt len {len(prompt)}: max |diff| {diff:.2e}"

    # All prompts in one batch: decode runs them together with different context lengths.
    reqs = engine.generate(ref.prompts, greedy_params(logprobs=5))
    for prompt, req, want_ids, steps in zip(
        ref.prompts, reqs, ref.greedy, ref.step_logits, strict=True
    ):
        assert req.output_token_ids == want_ids, (
            f"{variant}, prompt len {len(prompt)}: "
            + first_divergence(req.output_token_ids, want_ids)
        )
        # The logits behind every decode step match too (seen through log-softmax).
        hf_lp = torch.log_softmax(steps, dim=-1)
        for i, lp in enumerate(req.logprobs):
            assert abs(lp.logprob - float(hf_lp[i, lp.token_id])) <= LOGIT_ATOL
            for tok, val in lp.top:
                assert abs(val - float(hf_lp[i, tok])) <= LOGIT_ATOL, f"{variant} step {i}"


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-steps", "prefill-first"])
@pytest.mark.parametrize("ref_name", ["llama", "mistral", "qwen2", "gemma3"])
def test_greedy_matches_hf_with_chunked_prefill_and_small_blocks(
    ref_name: str, mixed: bool, hf_refs: dict[str, HFReference]
) -> None:
    """Windows across chunk and block boundaries: 5-token prefill chunks, 4-token blocks.
    With mixed steps the running requests' decode rows ride along the later prompts'
    chunks (each takes one token of the 5-token budget): the greedy tokens are HF's
    whatever the mix."""
    ref = hf_refs[ref_name]
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(ref.path),
            dtype="float32",
            cache=CacheConfig(block_size=4, num_blocks=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=5, mixed_steps=mixed),
        )
    )
    phases: list[str | None] = []
    for i, prompt in enumerate(ref.prompts):
        engine.add_request(f"r{i}", prompt, greedy_params())
    reqs = list(engine.requests.values())
    while engine.has_unfinished():
        phases.append(engine.step().phase)
    assert [r.output_token_ids for r in reqs] == ref.greedy
    assert ("mixed" in phases) == mixed, phases


# ---- RoPE types -------------------------------------------------------------------------
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_untruncated": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 1.3,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_frequencies_match_transformers(name: str) -> None:
    """engine.rope's frequencies and cos/sin scale are transformers' own (at the served
    context, beyond the original one: `dynamic` is fixed for it, as vLLM does)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.rope import inv_freq

    params = {"rope_theta": 10000.0, **ROPES[name]}
    hf_cfg = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=64,
        rope_parameters=params,
    )  # fmt: skip
    cfg = ModelConfig.from_hf_dict(
        {**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"], "vocab_size": 16}
    )
    served = cfg.max_position_embeddings
    assert served > 64 or name in ("linear", "llama3")
    want, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, None, seq_len=served)
    got, scale = inv_freq(64, cfg.rope_theta, cfg.rope_scaling, served)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0), name
    assert scale == pytest.approx(want_scale, rel=1e-9)


def test_dynamic_ntk_matches_hf_when_the_context_is_full(tmp_path: Path) -> None:
    """transformers re-derives dynamic NTK's base for each forward's longest position;
    pdserve fixes it for the served context (trained 48 positions x factor 2 = 96). The two
    agree for a sequence that fills it: logits of a 96-token prompt within 1e-4 at its last
    position, past the original context."""
    hf_cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    _widen_init(model, 5)
    model.save_pretrained(tmp_path)
    engine = LLMEngine.from_config(EngineConfig(model=str(tmp_path), dtype="float32"))
    assert engine.max_model_len == 96
    prompt = torch.randint(2, 320, (96,), generator=torch.Generator().manual_seed(5)).tolist()
    # 95 tokens, so that one is left to generate; HF sees the same 95 positions (< 96) and
    # derives its base for 95: feed it the whole 96 instead and compare the 95th position's.
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -2].float()
    got = prefill_logits(engine, prompt[:95])
    # HF's base for 96 positions (the full prompt) is pdserve's for the served 96.
    assert float((got - want).abs().max()) <= LOGIT_ATOL


# ---- bfloat16 ----------------------------------------------------------------------------
def test_bfloat16_first_token_close_to_hf_bf16(hf_refs: dict[str, HFReference]) -> None:
    """bf16 smoke: pdserve's bf16 logits are as close to HF bf16 as HF bf16 is to fp32.

    bf16 keeps 8 significant bits, so each rounding moves a value by up to 2^-9 of its size,
    and two implementations that round at different places (fused q/k/v and gate/up,
    attention kernels) may differ by about as much as either differs from fp32. The
    tolerance is therefore measured, not guessed: twice HF bf16's own error against HF fp32
    on the same prompt (0.05-0.16 here, on logits of spread ~1.5). The greedy first token
    must equal HF bf16's where HF bf16's top-2 margin exceeds twice that tolerance (each of
    the two top logits may move by up to it), so that the choice is a real decision rather
    than a rounding coin-flip; at least one prompt is such a decision.
    """
    ref = hf_refs["llama"]
    hf16 = transformers.LlamaForCausalLM.from_pretrained(ref.path, dtype=torch.bfloat16).eval()
    engine = LLMEngine.from_config(EngineConfig(model=str(ref.path), dtype="bfloat16"))
    assert engine.runner.model.dtype == torch.bfloat16
    assert engine.cache.data.dtype == torch.bfloat16
    decided: dict[int, int] = {}  # prompt index -> HF bf16's first token, where decided
    for i, (prompt, fp32) in enumerate(zip(ref.prompts, ref.last_logits, strict=True)):
        want = hf_last_logits(hf16, prompt)
        got = prefill_logits(engine, prompt)
        hf_err = float((want - fp32).abs().max())
        assert hf_err > 0, "HF did not run in bf16"
        tol = 2 * hf_err
        assert float((got - want).abs().max()) <= tol, f"prompt len {len(prompt)}"
        assert float((got - fp32).abs().max()) <= tol + hf_err
        if top_gap(want) > 2 * tol:
            assert int(got.argmax()) == int(want.argmax()), f"prompt len {len(prompt)}"
            decided[i] = int(want.argmax())
    assert decided, "no prompt's bf16 argmax is a real decision: pick other prompts"
    # And through the engine's own sampling path.
    reqs = engine.generate(ref.prompts, SamplingParams(temperature=0, max_tokens=1))
    assert {i: reqs[i].output_token_ids[0] for i in decided} == decided


# ---- `pdserve model init` checkpoints ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_init_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdserve.cli import main

    out = tmp_path_factory.mktemp("init") / "tiny"
    assert main(["model", "init", "--preset", "tiny", "--out", str(out)]) == 0
    return out


TEXTS = [
    "hello world, the model is a prefill cache",
    "The decode worker streams 1234 tokens; latency!",
    "  leading spaces and unicode: café ☕ 漢字",
    "",
]


def test_model_init_loads_in_transformers(tiny_init_dir: Path) -> None:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_init_dir, dtype=torch.float32, output_loading_info=True
    )
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = ModelConfig.from_hf(tiny_init_dir)
    assert hf.config.vocab_size == ours.vocab_size
    assert hf.config.num_hidden_layers == ours.num_layers


def test_model_init_tokenizer_matches_transformers(tiny_init_dir: Path) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_init_dir)
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_init_dir)))
    tok = engine.tokenizer
    assert tok is not None
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert ids[:1] == [0]  # the template processor prepends <s>
        assert (
            tok.encode(text, add_special_tokens=False)
            == hf_tok(text, add_special_tokens=False)["input_ids"]
        )
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain the KV cache."},
    ]
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nExplain the KV cache.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == rendered
    # The special tokens encode as single ids in both tokenizers.
    assert tok.encode(rendered) == hf_tok(rendered)["input_ids"]
    assert 2 in tok.encode(rendered) and 3 in tok.encode(rendered)


def test_model_init_greedy_matches_transformers(tiny_init_dir: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_init_dir, dtype=torch.float32)
    hf.eval()
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_init_dir)))
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    reqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, req in zip(prompts, reqs, strict=True):
        want, steps = hf_greedy(hf, prompt, 32)
        gap = top_gap(steps)
        assert gap > MIN_GREEDY_GAP, f"prompt len {len(prompt)}: top-2 gap {gap:.2e}"
        assert req.output_token_ids == want, first_divergence(req.output_token_ids, want)
        diff = float((prefill_logits(engine, prompt) - hf_last_logits(hf, prompt)).abs().max())
        assert diff <= LOGIT_ATOL, f"prompt len {len(prompt)}: max |diff| {diff:.2e}"


def test_model_init_is_deterministic_per_seed(
    tiny_init_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from pdserve.checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("seeds")
    again = write_checkpoint("tiny", root / "seed0", seed=0)
    other = write_checkpoint("tiny", root / "seed1", seed=1)
    weights = (tiny_init_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    # Same tokenizer either way; only the weights depend on the seed.
    assert (again / "tokenizer.json").read_bytes() == (
        tiny_init_dir / "tokenizer.json"
    ).read_bytes()


# ---- through the service -----------------------------------------------------------------
@pytest.mark.parametrize("ref_name", ["qwen3", "gemma3"])
@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_service_greedy_matches_hf(
    ref_name: str, colocated: bool, hf_refs: dict[str, HFReference], tmp_path: Path
) -> None:
    """In-process prefill and decode workers behind a Router (`tests.in_process`): every
    prompt's greedy tokens are HF's, whether the prompt pass ran on the prefill worker (its
    K/V shipped to the decode worker) or on the decode worker."""
    from pdserve.checkpoint import build_tokenizer
    from pdserve.client import make_request
    from pdserve.config import ServeConfig
    from tests.in_process import generate, run_with_workers

    ref = hf_refs[ref_name]
    path = tmp_path / ref_name  # the checkpoint and a tokenizer, which the router reads
    shutil.copytree(ref.path, path)
    build_tokenizer(ref.model.config.vocab_size).save(str(path / "tokenizer.json"))
    cfg = ServeConfig.load(
        None,
        {
            "model": {"model": str(path)},
            "transfer": {"transport": "local"},
            "colocated": colocated,
            "router": {"policy": {"local_prefill_threshold": 0}},
        },
    )
    got: list[list[int]] = []
    placements: list[str | None] = []

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        for prompt in ref.prompts:
            request = make_request(prompt, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
            tokens, act = await generate(router, request)
            got.append(tokens)
            placements.append(act.placement)

    run_with_workers(cfg, path, body)
    assert got == ref.greedy
    assert set(placements) == {"colocated" if colocated else "disaggregated"}


# ---- what is refused ---------------------------------------------------------------------
_BASE = {
    "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 32,
    "hidden_activation": "gelu_pytorch_tanh",
}  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "rope_parameters.rope_type='longrope'",
        ),
        (
            {"rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "su", "rope_theta": 1e4},
            }},
            "rope_parameters.sliding_attention.rope_type='su'",
        ),
        ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "Gemma2ForCausalLM"),
        ({"architectures": ["SmolLM3ForCausalLM"], "hidden_activation": None,
          "no_rope_layers": [1]}, "no_rope_layers has 1 entries for 2 layers"),
    ],
)  # fmt: skip
def test_an_unsupported_config_is_refused_naming_its_field(
    edit: dict[str, Any], named: str
) -> None:
    from engine.config import ConfigError

    raw = {k: v for k, v in {**_BASE, **edit}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(named)):
        ModelConfig.from_hf_dict(raw)
