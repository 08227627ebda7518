"""The real Gemma 3 270M (`--model gemma3-270m`: google/gemma-3-270m, Q4_K_M GGUF from the
package index, Gemma Terms of Use) against HF transformers on the same converted weights:
a second real model, whose block differs from Llama's in every piece (q/k norms, 1 + w
norms, sandwich norms, scaled embeddings, GELU, 5 sliding layers of 6 with two RoPE bases).

What must hold: greedy tokens equal HF's on English prompts; the perplexity of a fixed
paragraph equals HF's within 1e-4 relative (float32); the `.gguf` file (dequantized at
load) and the converted directory give the same tokens; the disaggregated service gives the
engine's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import CacheConfig
from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from pdserve.client import make_request
from pdserve.config import ServeConfig
from pdserve.models import NAMED_MODELS, pdserve_home, resolve_model
from tests.in_process import generate, run_with_workers

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, there was a",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
]
PARAGRAPH = (
    "The city of Paris is the capital of France. It lies on the river Seine, in the north of "
    "the country, and has been a centre of trade, science and the arts for many centuries."
)
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Memory: the model is 1.1 GB in float32 (a 262144-token vocabulary), a packed copy as much
# again and the default KV cache 576 MiB: engines in this process, the in-process service's
# included, use torch's own kernels (no packed copies) and 64 KV blocks, enough for these
# prompts.
SMALL_CACHE = CacheConfig(num_blocks=64)


def small_engine(model_dir: Path) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir), dtype="float32", cache=SMALL_CACHE, kernels="reference"
    )
    return LLMEngine.from_config(cfg)


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def engine(gemma_dir: Path) -> Iterator[LLMEngine]:
    before = torch.get_num_threads()
    yield small_engine(gemma_dir)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf(gemma_dir: Path) -> dict[str, Any]:
    """HF's greedy tokens for every prompt and its log-softmax over the paragraph."""
    tok = transformers.AutoTokenizer.from_pretrained(gemma_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    greedy = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
            greedy.append(out[0, len(ids) :].tolist())
        para = tok(PARAGRAPH)["input_ids"]
        lp = torch.log_softmax(model(torch.tensor([para])).logits[0].float(), dim=-1)
    nll = -sum(float(lp[p - 1, para[p]]) for p in range(1, len(para))) / (len(para) - 1)
    return {"prompts": prompts, "greedy": greedy, "paragraph": para, "ppl": math.exp(nll)}


def test_the_checkpoint_is_gemma3(gemma_dir: Path, engine: LLMEngine) -> None:
    cfg = engine.model_config
    assert cfg.architecture == "gemma3" and cfg.gemma_norms and cfg.qk_norm
    assert cfg.sliding_windows.count(512) == 15 and cfg.sliding_windows.count(None) == 3
    assert cfg.layer_rope.count("local") == 15 and cfg.local_rope_theta == 10000.0
    assert cfg.rope_theta == 1000000.0 and cfg.head_dim == 256 and cfg.hidden_size == 640


def test_greedy_tokens_equal_hf(engine: LLMEngine, hf: dict[str, Any]) -> None:
    assert engine.tokenizer is not None
    assert [engine.tokenizer.encode(p) for p in PROMPTS] == hf["prompts"]
    reqs = engine.generate(hf["prompts"], GREEDY)
    assert [r.output_token_ids for r in reqs] == hf["greedy"]


def test_perplexity_equals_hf(engine: LLMEngine, hf: dict[str, Any]) -> None:
    para = hf["paragraph"]
    [req] = engine.generate([para], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    lps = [lp.logprob for lp in req.prompt_logprobs[1:] if lp is not None]
    assert len(lps) == len(para) - 1
    ppl = math.exp(-sum(lps) / len(lps))
    assert abs(ppl - hf["ppl"]) / hf["ppl"] < 1e-4, (ppl, hf["ppl"])


def test_the_gguf_file_gives_the_converted_directorys_tokens(
    engine: LLMEngine, hf: dict[str, Any]
) -> None:
    gguf = pdserve_home() / "downloads" / NAMED_MODELS["gemma3-270m"].member
    view = resolve_model(str(gguf))
    assert (view / "model.gguf").is_symlink()
    direct = small_engine(view)
    prompts = hf["prompts"][:2]
    assert [r.output_token_ids for r in direct.generate(prompts, GREEDY)] == hf["greedy"][:2]


def test_the_disaggregated_service_gives_the_engines_tokens(
    gemma_dir: Path, hf: dict[str, Any]
) -> None:
    cfg = ServeConfig.load(
        None,
        {
            "model": {"model": str(gemma_dir), "kernels": "reference"},  # no packed copies
            "transfer": {"transport": "local"},
            "cache": {"num_blocks": 64},
            "router": {"policy": {"local_prefill_threshold": 0}},
        },
    )
    got: list[list[int]] = []

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        for text in PROMPTS[:2]:
            request = make_request(text, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
            tokens, act = await generate(router, request)
            assert act.placement == "disaggregated"
            got.append(tokens)

    run_with_workers(cfg, gemma_dir, body)
    assert got == hf["greedy"][:2]
