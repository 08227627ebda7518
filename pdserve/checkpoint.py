"""`pdserve model init`: small Llama checkpoints in HF format, generated deterministically.

No weights can be downloaded here, so pdserve makes its own: random weights from a seeded
generator (same preset + seed, same bytes) and a byte-level BPE tokenizer trained on a
synthetic corpus that is itself generated from a fixed seed. The result loads in HF
`transformers` (`AutoModelForCausalLM`, `AutoTokenizer`) as well as in pdserve.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    # Runs in milliseconds: for tests and the embedded default.
    "tiny": Preset(64, 176, 2, 4, 2, 512, 2048),
    # ~110M parameters (12 x 768, GQA 12/4), 4096-token context: for benchmarks.
    "small": Preset(768, 3072, 12, 12, 4, 8192, 4096),
}

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "that",
    "on",
    "as",
    "with",
    "by",
    "he",
    "at",
    "from",
    "his",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "has",
    "had",
    "not",
    "but",
    "one",
    "their",
    "first",
    "new",
    "after",
    "who",
    "they",
    "have",
    "her",
    "she",
    "two",
    "been",
    "other",
    "when",
    "there",
    "all",
    "during",
    "into",
    "school",
    "time",
    "may",
    "years",
    "more",
    "most",
    "only",
    "over",
    "city",
    "some",
    "world",
    "would",
    "where",
    "later",
    "up",
    "such",
    "used",
    "many",
    "can",
    "state",
    "about",
    "national",
    "out",
    "known",
    "university",
    "united",
    "then",
    "made",
    "year",
    "its",
    "since",
    "through",
    "three",
    "system",
    "game",
    "while",
    "several",
    "part",
    "team",
    "prefill",
    "decode",
    "cache",
    "token",
    "model",
    "block",
    "worker",
    "router",
    "request",
    "batch",
    "stream",
    "latency",
]
_SYLLABLES = [
    "ka",
    "ri",
    "to",
    "na",
    "mi",
    "se",
    "lo",
    "ve",
    "du",
    "pa",
    "an",
    "en",
    "in",
    "on",
    "ul",
    "ar",
    "er",
    "ir",
    "or",
    "ex",
    "qu",
    "th",
    "sh",
    "ch",
    "st",
    "pr",
    "tr",
    "bl",
    "gr",
    "fl",
]


def synthetic_corpus(num_words: int = 120_000, seed: int = 0) -> list[str]:
    """English-ish text from a fixed seed (real words plus syllable compounds, punctuation)."""
    rng = random.Random(seed)
    lines, words = [], []
    for _ in range(num_words):
        if rng.random() < 0.7:
            w = rng.choice(_WORDS)
        else:
            w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.08:
            w = w.capitalize()
        if rng.random() < 0.05:
            w += rng.choice(".,;:!?")
        if rng.random() < 0.02:
            w = str(rng.randint(0, 9999))
        words.append(w)
        if len(words) >= 16:
            lines.append(" ".join(words))
            words = []
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    assert tok.get_vocab_size() <= vocab_size, "tokenizer larger than the model vocabulary"
    return tok


def init_weights(p: Preset, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in HF tensor names, drawn in a fixed order from one seeded generator.

    Standard deviations are wider than HF's 0.02 init (1/sqrt(fan_in) per matrix) so that a
    random model's greedy output varies instead of repeating one token.
    """
    g = torch.Generator().manual_seed(seed)
    head_dim = p.hidden_size // p.num_heads

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * std

    d, f = p.hidden_size, p.intermediate_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(p.vocab_size, d, 1.0)}
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        out[pre + "self_attn.q_proj.weight"] = normal(p.num_heads * head_dim, d, d**-0.5)
        out[pre + "self_attn.k_proj.weight"] = normal(p.num_kv_heads * head_dim, d, d**-0.5)
        out[pre + "self_attn.v_proj.weight"] = normal(p.num_kv_heads * head_dim, d, d**-0.5)
        out[pre + "self_attn.o_proj.weight"] = normal(
            d, p.num_heads * head_dim, (p.num_heads * head_dim) ** -0.5
        )
        out[pre + "mlp.gate_proj.weight"] = normal(f, d, d**-0.5)
        out[pre + "mlp.up_proj.weight"] = normal(f, d, d**-0.5)
        out[pre + "mlp.down_proj.weight"] = normal(d, f, f**-0.5)
        out[pre + "input_layernorm.weight"] = torch.ones(d)
        out[pre + "post_attention_layernorm.weight"] = torch.ones(d)
    out["model.norm.weight"] = torch.ones(d)
    out["lm_head.weight"] = normal(p.vocab_size, d, 2 * d**-0.5)
    return out


def write_checkpoint(
    preset: str | Preset, out_dir: str | Path, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write config, weights, tokenizer and generation config to `out_dir`; returns it.

    `preset` names one of `PRESETS`, or is a `Preset` of its own (a test that needs other
    sizes than the named ones)."""
    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: choose from {sorted(PRESETS)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    p, name = (PRESETS[preset], preset) if isinstance(preset, str) else (preset, "custom")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.to(getattr(torch, dtype)).contiguous() for k, v in init_weights(p, seed).items()
    }
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.hidden_size // p.num_heads,
        "vocab_size": p.vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": dtype,
        "pdserve_preset": name,
        "pdserve_seed": seed,
    }
    _write_json(root / "config.json", config)
    _write_json(
        root / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]},
    )
    build_tokenizer(p.vocab_size).save(str(root / "tokenizer.json"))
    _write_json(
        root / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "model_max_length": p.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        },
    )
    return root


def _write_json(path: Path, data: object) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
