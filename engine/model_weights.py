"""A model's tensors as the engine runs them (fused Q/K/V and gate/up; see engine.weights
for how HF's tensors become these), shared by the model and its projections."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: torch.Tensor  # [q + 2kv, d]
    qkv_bias: torch.Tensor | None  # [q + 2kv] (Qwen2)
    o: torch.Tensor  # [d, q]
    post_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2 * ffn, d]
    down: torch.Tensor  # [d, ffn]
    q_norm: torch.Tensor | None = None  # [D], over each query head (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [D]
    attn_out_norm: torch.Tensor | None = None  # [d], Gemma 3: on the attention's output
    mlp_out_norm: torch.Tensor | None = None  # [d], Gemma 3: on the MLP's output


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, d]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [d]
    lm_head: torch.Tensor  # [V, d]; the same storage as `embed` when tied
    fingerprint: str = ""

    def release_matrices(self) -> None:
        """Free every layer's matrices (and an untied `lm_head`), keeping their shapes as
        meta tensors. For projections that run on packed copies of their own
        (`Projections.reads_plain` False): they would otherwise hold the model's matrices
        twice. Norms, biases and the embedding stay; a product with a released matrix fails
        loudly (a meta tensor has no data)."""
        for lw in self.layers:
            for name in MATRICES:
                setattr(lw, name, _shape_only(getattr(lw, name)))
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            self.lm_head = _shape_only(self.lm_head)

    @property
    def matrices_released(self) -> bool:
        return any(lw.qkv.is_meta for lw in self.layers)


MATRICES = ("qkv", "o", "gate_up", "down")  # a layer's matrices (`release_matrices`)


def _shape_only(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")
