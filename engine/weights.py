"""Loading HF safetensors checkpoints into `ModelWeights` (the only place HF tensor names live).

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``; fuses q/k/v and
gate/up into single matrices; ties ``lm_head`` to the embedding when the config says so.
The model fingerprint mixes the architecture with the safetensors headers and a sample of
each shard's bytes, so two checkpoints of one shape but different weights never exchange KV.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ConfigError, ModelConfig
from engine.model import LayerWeights, ModelWeights

_FINGERPRINT_SAMPLE_BYTES = 1 << 16


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise ConfigError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


def checkpoint_fingerprint(cfg: ModelConfig, files: list[Path]) -> str:
    h = hashlib.sha256(cfg.fingerprint().encode())
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(header_len))
            h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(
    path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> ModelWeights:
    """Load and fuse a checkpoint. Raises ConfigError naming any missing tensor."""
    root = Path(path)
    files = checkpoint_files(root)
    raw = {name: t for name, t in _iter_tensors(files)}

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ConfigError(f"{root}: checkpoint lacks tensor {name!r}")
        return raw.pop(name).to(device=device, dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = (
            torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            if cfg.attention_bias
            else None
        )
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv.contiguous(),
                qkv_bias=bias,
                o=take(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat(
                    [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                ).contiguous(),
                down=take(p + "mlp.down_proj.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        raw.pop("lm_head.weight", None)
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    return ModelWeights(
        embed=embed,
        layers=layers,
        norm=take("model.norm.weight"),
        lm_head=lm_head,
        fingerprint=checkpoint_fingerprint(cfg, files),
    )
