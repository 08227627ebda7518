"""Model and engine configuration.

`ModelConfig.from_hf` is the one place a HuggingFace ``config.json`` is read. Everything
downstream (model, KV cache, block manager, workers) takes the frozen dataclass, never the
raw dict, so a checkpoint quirk (old vs new key spellings) is handled here and only here.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.settings import check_settings, setting

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "Gemma3ForCausalLM": "gemma3",
}
MODEL_TYPES = {"gemma3_text": "gemma3"}  # a `model_type` spelled otherwise than pdserve's name
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

DTYPE_NAMES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A checkpoint or engine setting pdserve cannot serve; the message names the key."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, one of `ROPE_TYPES` (engine.rope computes each)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, dynamic
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale (None: from factor)
    mscale: float | None = None  # yarn (DeepSeek's spelling of the scale)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the ramp's bounds to whole dimensions


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder, read once from HF ``config.json``."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    # Per layer: attend only to the last `w` positions (key pos > query pos - w), or None.
    sliding_windows: tuple[int | None, ...]
    dtype: str  # checkpoint dtype name, one of DTYPE_NAMES
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Per layer, which RoPE it applies: "global" (`rope_theta`, `rope_scaling`), "local"
    # (`local_rope_theta`, `local_rope_scaling`: Gemma 3's sliding layers) or "none" (NoPE:
    # SmolLM3's every fourth layer); empty: every layer global.
    layer_rope: tuple[str, ...] = ()
    local_rope_theta: float = 10000.0
    local_rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh
    # Gemma 3's block: norms scale by (1 + w) in float32, the attention and MLP outputs are
    # normed before their residual adds, embeddings are scaled by sqrt(hidden_size)
    gemma_norms: bool = False
    query_scale: float | None = None  # attention's scale (None: head_dim ** -0.5)

    def rope_of(self, layer: int) -> str:
        return self.layer_rope[layer] if self.layer_rope else "global"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count; FLOP estimates use the non-embedding count."""
        d, i = self.hidden_size, self.intermediate_size
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * d * i + 2 * d
        body = self.num_layers * per_layer + d
        lm_head = self.vocab_size * d
        if not include_embeddings:
            return body + lm_head  # lm_head is a real matmul per token
        embed = 0 if self.tie_word_embeddings else self.vocab_size * d
        return body + lm_head + embed

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` in a checkpoint directory (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        with open(p) as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``. Raises ConfigError naming the first key
        pdserve cannot serve, checked in this order: architecture, required keys, head
        counts, activation, RoPE, dtype."""
        arch = _read_architecture(raw)
        for key in _REQUIRED_KEYS:
            if key not in raw:
                raise ConfigError(f"config.json: missing required key {key!r}")
        num_heads, num_kv_heads, head_dim = _read_heads(raw)
        act_key = "hidden_activation" if "hidden_activation" in raw else "hidden_act"
        act = raw.get(act_key, "silu")
        if act not in ACTIVATIONS:
            raise ConfigError(
                f"config.json: {act_key}={act!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
            )
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(key) is not None:
                raise ConfigError(f"config.json: {key}={raw[key]!r} is not supported (null only)")
        if raw.get("use_bidirectional_attention"):
            raise ConfigError(
                "config.json: use_bidirectional_attention=true (an embedding model) is not "
                "supported: pdserve serves causal decoders"
            )
        num_layers = int(raw["num_hidden_layers"])
        (rope_theta, scaling), local, layer_rope = _read_rope(raw, arch, num_layers)
        eos_ids = _read_eos(raw)
        bos = raw.get("bos_token_id")
        max_pos = int(raw.get("max_position_embeddings", 4096))
        if scaling.rope_type in ("yarn", "dynamic"):  # served past the trained context
            max_pos = max(max_pos, int(scaling.original_max_position_embeddings * scaling.factor))
        scalar = raw.get("query_pre_attn_scalar") if arch == "gemma3" else None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_windows=_read_sliding_windows(raw, arch, num_layers),
            dtype=_read_dtype(raw),
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            layer_rope=layer_rope,
            local_rope_theta=local[0],
            local_rope_scaling=local[1],
            qk_norm=arch in ("qwen3", "gemma3"),
            hidden_act=ACTIVATIONS[act],
            gemma_norms=arch == "gemma3",
            query_scale=float(scalar) ** -0.5 if scalar else None,
        )

    def fingerprint(self) -> str:
        """Stable digest of the architecture; `engine.weights` mixes in the weights."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def _read_architecture(raw: dict[str, Any]) -> str:
    """pdserve's name for the checkpoint's architecture: the first supported entry of
    `architectures`, else a supported `model_type`; ConfigError when neither is."""
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return arch
    model_type = raw.get("model_type")
    model_type = MODEL_TYPES.get(str(model_type), model_type)
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return str(model_type)
    raise ConfigError(
        f"config.json: unsupported architectures={archs} model_type={model_type!r}; "
        f"pdserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _read_heads(raw: dict[str, Any]) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim). KV heads default to the query heads (no GQA)
    and must divide them; head_dim defaults to hidden_size / num_heads."""
    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    hidden = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    return num_heads, num_kv_heads, head_dim


def _read_eos(raw: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: HF writes one id, a list of them, or nothing."""
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return (int(eos),) if eos is not None else ()


Rope = tuple[float, RopeScaling]


def _read_rope(
    raw: dict[str, Any], arch: str, num_layers: int
) -> tuple[Rope, Rope, tuple[str, ...]]:
    """(global rope, local rope, per-layer kind) from either spelling: old (`rope_theta`,
    `rope_scaling`, Gemma 3's `rope_local_base_freq`) or transformers 5's
    `rope_parameters`, flat or per layer type (`full_attention`, `sliding_attention`)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        full = _rope_from(params["full_attention"], raw, "rope_parameters.full_attention")
        local_raw = params.get("sliding_attention")
        local = (
            _rope_from(local_raw, raw, "rope_parameters.sliding_attention")
            if isinstance(local_raw, dict)
            else full
        )
    else:
        scaling_raw = params if params is not None else raw.get("rope_scaling")
        where = "rope_parameters" if params is not None else "rope_scaling"
        full = _rope_from(scaling_raw or {}, raw, where)
        local = (float(raw.get("rope_local_base_freq", 10000.0)), RopeScaling())
    kinds = _read_layer_types(raw, num_layers)
    if arch == "gemma3":
        layer_rope = tuple("local" if k == "sliding_attention" else "global" for k in kinds)
    elif arch == "smollm3":
        layer_rope = tuple("global" if use else "none" for use in _smollm3_rope(raw, num_layers))
    else:
        layer_rope = ()
    return full, local, layer_rope


def _rope_from(d: dict[str, Any], raw: dict[str, Any], where: str) -> Rope:
    """One RoPE (theta and scaling) from a `rope_scaling` / `rope_parameters` dict."""
    theta = float(d.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(d.get("rope_type") or d.get("type") or "default")
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: {where}.rope_type={rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    max_pos = int(raw.get("max_position_embeddings", 4096))
    default_original = max_pos if rope_type in ("yarn", "dynamic") else 8192
    original = int(d.get("original_max_position_embeddings") or default_original)
    factor = d.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_pos / original  # DeepSeek's spelling: the ratio of the two
    beta_fast, beta_slow = d.get("beta_fast"), d.get("beta_slow")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(beta_fast or 32.0),
        beta_slow=float(beta_slow or 1.0),
        attention_factor=_opt_float(d.get("attention_factor")),
        mscale=_opt_float(d.get("mscale")),
        mscale_all_dim=_opt_float(d.get("mscale_all_dim")),
        truncate=bool(d.get("truncate", True)),
    )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _read_layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """`layer_types`, or Gemma 3's older `sliding_window_pattern` (every n-th layer full)."""
    kinds = raw.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == num_layers:
        return [str(k) for k in kinds]
    pattern = raw.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    return ["full_attention"] * num_layers


def _smollm3_rope(raw: dict[str, Any], num_layers: int) -> list[bool]:
    """Which layers apply RoPE: `no_rope_layers` (1: yes) or, without it, all but every
    `no_rope_layer_interval`-th (transformers' default: 4)."""
    flags = raw.get("no_rope_layers")
    if isinstance(flags, list):
        if len(flags) != num_layers:
            raise ConfigError(
                f"config.json: no_rope_layers has {len(flags)} entries for {num_layers} layers"
            )
        return [bool(f) for f in flags]
    interval = int(raw.get("no_rope_layer_interval") or 4)
    return [(i + 1) % interval != 0 for i in range(num_layers)]


def _read_sliding_windows(
    raw: dict[str, Any], arch: str, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if window is None:
        return (None,) * num_layers
    if arch in ("qwen2", "qwen3", "smollm3") and not raw.get("use_sliding_window", False):
        return (None,) * num_layers
    kinds = _read_layer_types(raw, num_layers)
    if "layer_types" in raw or "sliding_window_pattern" in raw:
        return tuple(int(window) if t == "sliding_attention" else None for t in kinds)
    if arch in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers


def _read_dtype(raw: dict[str, Any]) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ConfigError(f"config.json: dtype {name!r} is not supported ({DTYPE_NAMES})")
    return name


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. A block holds `block_size` tokens of K and V for every layer."""

    block_size: int = setting(16, "tokens per KV block", ge=1, power_of_two=True)
    num_blocks: int = setting(
        1024,
        "KV blocks per worker; overrides the memory settings below when given",
        ge=1,
    )
    decode_workspace_mib: int = setting(
        1024,
        "cap on the decode workspace, the contiguous copy of the running batch's K/V that "
        "spares each decode step a gather of every page (over the cap a step gathers pages)",
        ge=0,
        zero="off",
    )
    kv_cache_memory: int | None = setting(
        None,
        "size each worker's KV cache to this many bytes instead (an int, or 4GiB / 512MiB; "
        "vLLM's VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes)",
        ge=1,
    )
    gpu_memory_utilization: float | None = setting(
        None,
        "CUDA: size each worker's KV cache to fill this fraction of the device's memory, "
        "counting what is in use after the weights (set one of the two memory settings)",
        gt=0,
        le=1,
    )

    def __post_init__(self) -> None:
        memory: object = self.kv_cache_memory
        if isinstance(memory, str):  # YAML may spell it "4GiB"
            object.__setattr__(self, "kv_cache_memory", parse_bytes(memory))
        check_settings(self, "cache.", ConfigError)
        util = self.gpu_memory_utilization
        if self.kv_cache_memory is not None and util is not None:
            raise ConfigError("kv_cache_memory and gpu_memory_utilization: set one, not both")

    @property
    def sized_from_memory(self) -> bool:
        return self.kv_cache_memory is not None or self.gpu_memory_utilization is not None

    def with_memory(self, budget_bytes: int, bytes_per_block: int) -> CacheConfig:
        """This config with `num_blocks` = what `budget_bytes` holds (whole blocks)."""
        num_blocks = kv_blocks_for(budget_bytes, bytes_per_block)
        if num_blocks < 1:
            raise ConfigError(
                f"KV cache memory {format_bytes(budget_bytes)} holds no block of "
                f"{format_bytes(bytes_per_block)} (block_size={self.block_size}): give more "
                "memory (--kv-cache-memory, --gpu-memory-utilization) or --num-kv-blocks"
            )
        return replace(self, num_blocks=num_blocks)


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """K and V of `block_size` tokens over all layers:
    block_size x 2 x num_layers x num_kv_heads x head_dim x dtype bytes."""
    return block_size * model.kv_bytes_per_token(dtype_bytes)


def kv_blocks_for(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in `budget_bytes` (0 when none does)."""
    return max(0, int(budget_bytes)) // bytes_per_block


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """A byte count: plain bytes, or a number with a unit, binary (KiB, MiB, GiB, TiB; Ki..)
    or decimal (KB, MB, GB, TB; K..), case-insensitive: "4GiB", "512MiB", "1.5G"."""
    m = _BYTES_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _BYTE_UNITS:
        raise ConfigError(f"{text!r} is not a byte count (BYTES, NMiB, NGiB, NGB ...)")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take on."""

    max_num_seqs: int = setting(64, "running requests decoded together", ge=1)
    max_num_batched_tokens: int = setting(
        2048,
        "tokens in one step: decode rows plus prompt chunks (the chunk budget)",
        ge=1,
    )
    max_model_len: int | None = setting(
        None,
        "prompt + output tokens per request; unset: the checkpoint's "
        "max_position_embeddings, which also caps it",
        ge=1,
    )
    mixed_steps: bool = setting(
        True,
        "running decodes ride along prompt chunks in one step (vLLM v1's policy); "
        "false: prefill-first steps (vLLM v0's), decodes wait behind each prompt pass",
    )

    def __post_init__(self) -> None:
        check_settings(self, "scheduler.", ConfigError)

    def context_len(self, model: ModelConfig) -> int:
        """The context limit served: `max_model_len`, at most the checkpoint's positions."""
        limit = model.max_position_embeddings
        return limit if self.max_model_len is None else min(self.max_model_len, limit)


@dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's sampling defaults (`generation_config.json`), as vLLM's
    `--generation-config auto` applies them: only to fields a request leaves unset.

    `do_sample` is ignored, as vLLM does: an unset temperature takes the file's temperature
    (or 1.0), never greedy by omission.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # from max_new_tokens

    @classmethod
    def from_dir(cls, path: str | Path) -> GenerationDefaults:
        p = Path(path) / "generation_config.json"
        if not p.is_file():
            return cls()
        with open(p) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: top level must be an object")

        def num(key: str) -> float | None:
            v = raw.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        top_k, max_new = num("top_k"), num("max_new_tokens")
        return cls(
            temperature=num("temperature"),
            top_p=num("top_p"),
            top_k=int(top_k) if top_k else None,  # HF's top_k=0 means no cut, like unset
            min_p=num("min_p"),
            repetition_penalty=num("repetition_penalty"),
            max_tokens=int(max_new) if max_new else None,
        )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
