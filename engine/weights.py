"""Loading checkpoints into `ModelWeights` (the only place HF tensor names live).

Reads, in this order of preference, ``model.safetensors`` (or a sharded
``model.safetensors.index.json``), ``pytorch_model.bin`` (or its sharded index) through
torch's weights-only unpickler, which refuses anything but tensors and plain containers, or
one ``*.gguf`` file (dequantized by `engine.gguf`). Fuses q/k/v and gate/up into single
matrices; ties ``lm_head`` to the embedding when the config says so. The model fingerprint mixes the
architecture with each file's header and a sample of its bytes, so two checkpoints of one
shape but different weights never exchange KV.
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
from engine.model_weights import LayerWeights, ModelWeights

_FINGERPRINT_SAMPLE_BYTES = 1 << 16
# (single file, sharded index) per format, most preferred first
_FORMATS = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of the checkpoint in `path`, all of one format."""
    for single, index in _FORMATS:
        if (path / index).exists():
            with open(path / index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            return [path / name for name in sorted(set(weight_map.values()))]
        if (path / single).exists():
            return [path / single]
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        raise ConfigError(f"{path}: {len(ggufs)} .gguf files; pass the one to load as --model")
    raise ConfigError(
        f"{path}: no weights (model.safetensors, pytorch_model.bin, their sharded "
        "*.index.json, or one .gguf file)"
    )


def checkpoint_fingerprint(cfg: ModelConfig, files: list[Path]) -> str:
    h = hashlib.sha256(cfg.fingerprint().encode())
    for file in files:
        with open(file, "rb") as f:
            if file.suffix == ".safetensors":
                (header_len,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(header_len))
            else:  # a GGUF or pickle-zip header sits at the start; tensor bytes at the end
                size = file.stat().st_size
                h.update(str(size).encode())
                f.seek(max(0, size - _FINGERPRINT_SAMPLE_BYTES))
                h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
                f.seek(0)
            h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
        elif file.suffix == ".gguf":
            from engine.gguf import gguf_tensors

            yield from gguf_tensors(file, file.parent)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            yield from state.items()


class _Tensors:
    """A checkpoint's tensors by HF name, each taken once, cast for the engine."""

    def __init__(
        self,
        root: Path,
        files: list[Path],
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.root, self.cfg, self.dtype, self.device = root, cfg, dtype, device
        self.raw = {name: t for name, t in _iter_tensors(files)}

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.raw:
            raise ConfigError(f"{self.root}: checkpoint lacks tensor {name!r}")
        return self.raw.pop(name).to(device=self.device, dtype=dtype or self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        """A norm's weight: Gemma 3's as 1 + w in float32 (`model.gemma_rms_norm`)."""
        if not self.cfg.gemma_norms:
            return self.take(name)
        return 1.0 + self.take(name, torch.float32)

    def layer(self, i: int) -> LayerWeights:
        cfg, take, norm = self.cfg, self.take, self.norm
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = (
            torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            if cfg.attention_bias
            else None
        )
        gemma = cfg.gemma_norms  # its pre-MLP norm is `pre_feedforward_layernorm`
        pre_mlp = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
        return LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=qkv.contiguous(),
            qkv_bias=bias,
            o=take(p + "self_attn.o_proj.weight"),
            post_norm=norm(p + pre_mlp + ".weight"),
            gate_up=torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            ).contiguous(),
            down=take(p + "mlp.down_proj.weight"),
            q_norm=norm(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            attn_out_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
        )


def load_weights(
    path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> ModelWeights:
    """Load and fuse a checkpoint. Raises ConfigError naming any missing tensor."""
    root = Path(path)
    files = checkpoint_files(root)
    t = _Tensors(root, files, cfg, dtype, device)
    layers = [t.layer(i) for i in range(cfg.num_layers)]
    embed = t.take("model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        t.raw.pop("lm_head.weight", None)
        lm_head = embed
    else:
        lm_head = t.take("lm_head.weight")
    return ModelWeights(
        embed=embed,
        layers=layers,
        norm=t.norm("model.norm.weight"),
        lm_head=lm_head,
        fingerprint=checkpoint_fingerprint(cfg, files),
    )
