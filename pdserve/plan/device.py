"""Device profiles: an accelerator's step times extrapolated from its published roofline and
pdserve's own FLOP and byte counts (`pdserve.tools.trace_counts`, what `pdserve trace`
reports), never measured.

A step of batch shape `s` (`pdserve.plan.stepmodel.StepShape`) is taken to cost

    t = step_s + max(FLOPs(s) / (peak FLOP/s · flop_eff), bytes(s) / (HBM B/s · byte_eff))

FLOPs and bytes are linear in the step model's terms (`TERMS`): per token the layers' GEMMs,
norms and K/V writes; per attended (query, key) pair the attention; per row that gives logits
the head; per step the weights, read once; per decode row's context token its K and V. The
coefficients come from `trace_counts` evaluated on unit shapes, so a change to pdserve's
counting conventions changes the profile with no change here.

What it leaves out, and says so in the profile (`assumptions`): the efficiencies and the
per-step overhead are assumed, not measured; a prompt chunk's reading of its cached prefix
is not counted (small against the weights at the contexts planned here); tensor parallelism
(a worker is one device); the transfer's α and β are assumed (RDMA between nodes). The day
a device is lent, `benchmarks/gpu_check.sh` measures the real profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.plan.stepmodel import TERMS, StepShape


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16, FLOP/s (the datasheet's figure without sparsity)
    hbm_bytes_per_s: float
    memory_bytes: float
    source: str


DEVICES: dict[str, Device] = {
    "h100": Device(
        "NVIDIA H100 SXM5 80GB", 989.4e12, 3.35e12, 80e9,
        "NVIDIA H100 datasheet: 989.4 TFLOPS dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3",
    ),
    "h200": Device(
        "NVIDIA H200 SXM 141GB", 989.4e12, 4.8e12, 141e9,
        "NVIDIA H200 datasheet: 989.4 TFLOPS dense BF16 (1,979 with sparsity), 4.8 TB/s HBM3e",
    ),
}  # fmt: skip

ASSUMED = {
    "flop_efficiency": 0.7,  # of peak in the step's GEMMs and attention
    "byte_efficiency": 0.8,  # of HBM bandwidth in a memory-bound step
    "step_s": 1.0e-3,  # per step: scheduling, launches, sampling (CUDA graphs for decode)
    "memory_for_kv": 0.9,  # of device memory, less the weights, held for KV blocks
    "transfer_alpha_s": 1.0e-3,  # per KV transfer: handshake and completion
    "transfer_beta_bytes_per_s": 40e9,  # RDMA between nodes, 400 Gb/s per device at 80 %
    "max_num_seqs": 256,  # vLLM's default batch bound on a GPU
}
"""The figures a device profile assumes: stated in it, never measured."""

GEOMETRIES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
}
"""Model shapes a device profile can be made for without a checkpoint (only the config
matters to the counts)."""


@dataclass(frozen=True)
class RooflineModel:
    """A step's time from its FLOPs and bytes (each linear in `TERMS`) on a device."""

    flops: tuple[float, ...]
    bytes: tuple[float, ...]
    flop_rate: float  # achieved, FLOP/s
    byte_rate: float  # achieved, B/s
    step_s: float

    def flops_of(self, shape: StepShape) -> float:
        return float(np.dot(self.flops, shape.features()))

    def bytes_of(self, shape: StepShape) -> float:
        return float(np.dot(self.bytes, shape.features()))

    def predict(self, shape: StepShape) -> float:
        return self.step_s + max(
            self.flops_of(shape) / self.flop_rate, self.bytes_of(shape) / self.byte_rate
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "flops": dict(zip(TERMS, self.flops, strict=True)),
            "bytes": dict(zip(TERMS, self.bytes, strict=True)),
            "flop_rate": self.flop_rate,
            "byte_rate": self.byte_rate,
            "step_s": self.step_s,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RooflineModel:
        return cls(
            tuple(float(d["flops"][t]) for t in TERMS),
            tuple(float(d["bytes"][t]) for t in TERMS),
            float(d["flop_rate"]),
            float(d["byte_rate"]),
            float(d["step_s"]),
        )


def counts(config: Any, dtype_bytes: int = 2) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(FLOPs, bytes) coefficients per `TERMS` from `trace_counts` (non-windowed attention)."""
    from pdserve.tools.trace_counts import Totals, embed_ops, head_ops, layer_ops

    b, layers = dtype_bytes, range(config.num_layers)

    def body(t: int) -> Totals:  # every op of t tokens but attention and the head
        ops = [op for li in layers for op in layer_ops(config, li, t, t, b, decode=False)]
        return Totals.of([op for op in ops if op.kind != "attention"] + embed_ops(config, t, b))

    def attention(t: int, ctx: int, decode: bool) -> Totals:
        ops = [
            op
            for li in layers
            for op in layer_ops(config, li, t, ctx, b, decode=decode, workspace=False)
        ]
        return Totals.of([op for op in ops if op.kind == "attention"])

    one, two = body(1), body(2)
    tok_flops = two.flops - one.flops
    tok_bytes = two.bytes - one.bytes  # activations, K/V written, an embedding row
    weights = one.bytes - tok_bytes  # read once a step, whatever the batch
    head = Totals.of(head_ops(config, 1, b))
    head_row_bytes = head.bytes - head.weight_bytes
    row = attention(1, 2, decode=True)  # a decode row reading 2 tokens
    pair = row.flops / 2  # per (query, key) pair, all layers
    kv_tok = row.kv_bytes_read / 2  # K and V of one context token
    q_bytes = attention(1, 1, decode=False).bytes - kv_tok  # a query in, its output out
    flops = {
        "chunks": head.flops,  # a chunk gives one logits row (the one that ends its prompt)
        "sum_n": tok_flops + pair / 2,  # a chunk's n(n+1)/2 pairs within itself ...
        "sum_n2": pair / 2,
        "sum_n_ctx": pair,  # ... and n·ctx with its cached prefix
        "batch": tok_flops + head.flops + pair,  # a decode row: a token, logits, its own pair
        "sum_ctx": pair,
    }
    nbytes = {
        "a": weights + head.weight_bytes,
        "chunks": head_row_bytes,
        "sum_n": tok_bytes + q_bytes + kv_tok,  # the chunk's own K/V read back by attention
        "batch": tok_bytes + q_bytes + head_row_bytes + kv_tok,
        "sum_ctx": kv_tok,
    }
    return (
        tuple(float(flops.get(t, 0.0)) for t in TERMS),
        tuple(float(nbytes.get(t, 0.0)) for t in TERMS),
    )


def device_profile(
    device: str, model: str, config: Any | None = None, dtype_bytes: int = 2
) -> dict[str, Any]:
    """A profile (the JSON `pdserve profile` writes) for `device`, extrapolated, of `model`:
    one of `GEOMETRIES`, or any model whose `ModelConfig` is given."""
    from engine.config import ModelConfig

    if device not in DEVICES:
        raise ValueError(f"--device: one of {', '.join(DEVICES)}, not {device!r}")
    dev = DEVICES[device]
    cfg = config if config is not None else ModelConfig.from_hf_dict(GEOMETRIES[model])
    flops, nbytes = counts(cfg, dtype_bytes)
    roof = RooflineModel(
        flops,
        nbytes,
        dev.peak_flops * ASSUMED["flop_efficiency"],
        dev.hbm_bytes_per_s * ASSUMED["byte_efficiency"],
        ASSUMED["step_s"],
    )
    block_size = 16
    kv_bytes_per_block = 2 * cfg.num_layers * block_size * cfg.kv_size * dtype_bytes
    weights = nbytes[0]
    pool = int((dev.memory_bytes * ASSUMED["memory_for_kv"] - weights) // kv_bytes_per_block)
    return {
        "version": 1,
        "model": model,
        "model_name": model,
        "dtype": "bfloat16" if dtype_bytes == 2 else f"{dtype_bytes}-byte",
        "device": device,
        "cpu": dev.name,
        "measured": False,
        "extrapolated_from": dev.source,
        "assumptions": ASSUMED,
        "block_size": block_size,
        "kv_bytes_per_block": kv_bytes_per_block,
        "pool_blocks": pool,
        "max_num_seqs": ASSUMED["max_num_seqs"],
        "workers": {"1": {"roofline": roof.to_json()}},
        "transfer": {
            "chosen": {
                "transport": "rdma (assumed)",
                "alpha_s": ASSUMED["transfer_alpha_s"],
                "beta_bytes_per_s": ASSUMED["transfer_beta_bytes_per_s"],
            }
        },
    }
