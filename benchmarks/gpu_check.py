"""The project's one GPU check: ceilings, then pdserve's engine and KV page path on CUDA.

Runs from the source tree (PYTHONPATH=.) with torch alone: it imports only `engine.config`,
`engine.model`, `engine.kv_cache`, `engine.decode_workspace` and `kv_transfer.pages` (no
safetensors, tokenizers, protobuf, Ray or Redis), builds an 8B-shaped Llama layer stack with
random bf16 weights, and writes one small JSON. Measured in one run:

1. bf16 matmul peak (best of several large GEMMs) and device copy bandwidth;
2. pdserve prefill MFU (FLOPs / time / measured peak) for a long prompt;
3. decode bandwidth at batch 1 (weights + KV bytes read per step / time) against the copy
   bandwidth, and decode throughput at batch 32, through the decode workspace the engine
   uses, beside the same step gathering every page (and the two paths' logit difference);
4. the KV page path on CUDA: non-contiguous blocks of one cache copied into another through
   `frame_regions` (the device-copy path a one-GPU box can run; NCCL needs two GPUs), checked
   bit-exact, in GB/s.

`--small` shrinks every size so the script can be dry-run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run as a file, this folder is first on sys.path and `engine` would be benchmarks/engine.py:
# the repository root goes first (gpu_check.sh runs it as a module, which needs none of this).
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import CacheConfig, ModelConfig, RopeScaling  # noqa: E402
from engine.decode_workspace import DecodeWorkspace  # noqa: E402
from engine.kv_cache import PagedKVCache  # noqa: E402
from engine.model import (  # noqa: E402
    AttentionMetadata,
    LayerWeights,
    LlamaModel,
    ModelWeights,
    PrefillSegment,
)
from kv_transfer.pages import block_runs, frame_regions  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    sync(device)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def llama_8b_shape(num_layers: int, small: bool) -> ModelConfig:
    if small:
        hidden, ffn, heads, kv, head_dim, vocab = 256, 768, 8, 2, 32, 4096
    else:  # Llama-3-8B
        hidden, ffn, heads, kv, head_dim, vocab = 4096, 14336, 32, 8, 128, 128256
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        sliding_windows=(None,) * num_layers,
        dtype="bfloat16",
    )


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device) * 0.02

    d, f = cfg.hidden_size, cfg.intermediate_size
    layers = [
        LayerWeights(
            input_norm=torch.ones(d, dtype=dtype, device=device),
            qkv=w(cfg.q_size + 2 * cfg.kv_size, d),
            qkv_bias=None,
            o=w(d, cfg.q_size),
            post_norm=torch.ones(d, dtype=dtype, device=device),
            gate_up=w(2 * f, d),
            down=w(d, f),
        )
        for _ in range(cfg.num_layers)
    ]
    return ModelWeights(
        embed=w(cfg.vocab_size, d),
        layers=layers,
        norm=torch.ones(d, dtype=dtype, device=device),
        lm_head=w(cfg.vocab_size, d),
        fingerprint="gpu-check",
    )


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """2 x non-embedding params per token + causal attention scores and values."""
    linear = 2 * cfg.num_params(include_embeddings=False) * tokens
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return linear + attention


def measure_prefill(
    model: LlamaModel, cache: PagedKVCache, tokens: int, device: torch.device, reps: int
) -> float:
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), device=device)
    pos = torch.arange(tokens, device=device)
    meta = AttentionMetadata(
        positions=pos, slot_mapping=pos, prefill=[PrefillSegment(0, tokens, tokens, None)]
    )
    last = torch.tensor([tokens - 1], device=device)
    return best_time(lambda: model.forward(ids, meta, cache, last), device, reps)


def measure_decode(
    model: LlamaModel,
    cache: PagedKVCache,
    batch: int,
    context: int,
    device: torch.device,
    reps: int,
) -> dict[str, float]:
    """One decode step for `batch` requests, each with `context` tokens of context, two ways:
    attention gathering every page each step (`decode_slots`), and reading the decode
    workspace the engine's runner uses (`DecodeWorkspace`, filled once from the pages).
    Both must give the same logits (bf16 tolerance)."""
    bs = cache.block_size
    blocks_per = -(-context // bs)
    slots = torch.stack(
        [torch.arange(context, device=device) + b * blocks_per * bs for b in range(batch)]
    )  # [B, S]
    lens = torch.full((batch,), context, device=device)
    ids = torch.randint(0, model.cfg.vocab_size, (batch,), device=device)
    rows = torch.arange(batch, device=device)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            positions=lens - 1, slot_mapping=slots[:, -1], decode_ctx_lens=lens
        )

    gather = meta()
    gather.decode_slots = slots
    ws = DecodeWorkspace(cache, 1 << 40)
    tables = [list(range(b * blocks_per, (b + 1) * blocks_per)) for b in range(batch)]
    order = ws.prepare([(f"r{b}", 0) for b in range(batch)], [context] * batch, tables)
    assert order == list(range(batch))
    in_place = meta()
    in_place.decode_workspace = ws
    out = {
        "gather_s": best_time(lambda: model.forward(ids, gather, cache, rows), device, reps),
        "workspace_s": best_time(lambda: model.forward(ids, in_place, cache, rows), device, reps),
        "workspace_bytes": float(ws.bytes_held),
    }
    a = model.forward(ids, gather, cache, rows)
    b = model.forward(ids, in_place, cache, rows)
    out["max_logit_diff"] = float((a - b).abs().max())
    return out


def measure_pages(
    cfg: ModelConfig, device: torch.device, num_blocks: int, reps: int
) -> dict[str, float | bool]:
    cache_cfg = CacheConfig(16, num_blocks * 2)
    src = PagedKVCache(cfg, cache_cfg, torch.bfloat16, device, "gpu-check")
    dst = PagedKVCache(cfg, cache_cfg, torch.bfloat16, device, "gpu-check")
    src.data.normal_()
    src_ids = list(range(0, 2 * num_blocks, 2))  # every other block: no coalescing at all
    dst_ids = list(range(num_blocks))[::-1]
    runs = block_runs(src_ids, dst_ids)
    pairs = list(
        zip(
            frame_regions(src, 0, cfg.num_layers, runs, "src"),
            frame_regions(dst, 0, cfg.num_layers, runs, "dst"),
            strict=True,
        )
    )

    def copy() -> None:
        for s, d in pairs:
            d.copy_(s, non_blocking=True)

    secs = best_time(copy, device, reps)
    nbytes = sum(s.numel() * s.element_size() for s, _ in pairs)
    exact = all(
        torch.equal(src.data[:, :, s], dst.data[:, :, d])
        for s, d in zip(src_ids, dst_ids, strict=True)
    )
    return {
        "bytes": nbytes,
        "seconds": secs,
        "gb_per_s": nbytes / secs / 1e9,
        "num_regions": len(pairs),
        "bit_exact": exact,
    }


def measure_ceilings(device: torch.device, small: bool, reps: int) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, device copy bytes/s counting read + write)."""
    n = 512 if small else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    peak = 2 * n**3 / best_time(lambda: a @ b, device, reps)
    buf = torch.empty(64 << 20 if small else 4 << 30, dtype=torch.uint8, device=device)
    buf2 = torch.empty_like(buf)
    copy_bw = 2 * buf.numel() / best_time(lambda: buf2.copy_(buf), device, reps)
    return peak, copy_bw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/gpu_check.json")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU dry run)")
    ap.add_argument("--layers", type=int, default=None, help="layer count (default 32)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.small:
        print("gpu_check: no CUDA device; run with --small for a CPU dry run", file=sys.stderr)
        return 2
    small = args.small
    reps = 2 if small else 5
    dtype = torch.bfloat16
    out: dict[str, object] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "small": small,
    }

    peak, copy_bw = measure_ceilings(device, small, reps)
    out["matmul_peak_tflops"] = peak / 1e12
    out["copy_bandwidth_gb_per_s"] = copy_bw / 1e9
    print(f"matmul peak {peak / 1e12:.1f} TFLOP/s, copy {copy_bw / 1e9:.0f} GB/s", flush=True)

    layers = args.layers or (2 if small else 32)
    cfg = llama_8b_shape(layers, small)
    weights = random_weights(cfg, dtype, device)
    prompt = 256 if small else 4096
    batch, context = 32, (128 if small else 2048)
    blocks = max(prompt, batch * context) // 16 + 64
    cache = PagedKVCache(cfg, CacheConfig(16, blocks), dtype, device, "gpu-check")
    model = LlamaModel(cfg, weights, max(prompt, context) + 1)

    secs = measure_prefill(model, cache, prompt, device, reps)
    flops = prefill_flops(cfg, prompt)
    out["prefill"] = {
        "tokens": prompt,
        "seconds": secs,
        "tflops": flops / secs / 1e12,
        "mfu_vs_measured_peak": flops / secs / peak,
    }
    print(
        f"prefill {prompt} tokens: {secs * 1e3:.1f} ms, {flops / secs / 1e12:.1f} TFLOP/s, "
        f"{flops / secs / peak:.0%} of measured peak",
        flush=True,
    )

    weight_bytes = (cfg.num_params(include_embeddings=False)) * 2
    for b_size in (1, batch):
        two = measure_decode(model, cache, b_size, context, device, reps)
        secs = two["workspace_s"]  # the engine's path
        kv = b_size * context * cfg.kv_bytes_per_token(2)
        out[f"decode_b{b_size}"] = {
            "context": context,
            "seconds_per_step": secs,
            "tokens_per_s": b_size / secs,
            "bytes_per_s": (weight_bytes + kv) / secs,
            "fraction_of_copy_bandwidth": (weight_bytes + kv) / secs / copy_bw,
            "gather_seconds_per_step": two["gather_s"],
            "workspace_bytes": two["workspace_bytes"],
            "max_logit_diff_workspace_vs_gather": two["max_logit_diff"],
        }
        print(
            f"decode batch {b_size} at context {context}: {secs * 1e3:.2f} ms/step "
            f"(gathering pages: {two['gather_s'] * 1e3:.2f}), "
            f"{(weight_bytes + kv) / secs / 1e9:.0f} GB/s "
            f"({(weight_bytes + kv) / secs / copy_bw:.0%} of copy), "
            f"logits differ by <= {two['max_logit_diff']:.3g}",
            flush=True,
        )

    out["kv_pages_device_copy"] = measure_pages(cfg, device, 64 if small else 1024, reps)
    print(f"kv page path: {out['kv_pages_device_copy']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
