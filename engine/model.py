"""The Llama-family decoder (Llama, Mistral, Qwen2), top to bottom, over a paged KV cache.

One forward serves both phases. The caller packs every token of the step into one ``[T]``
batch (prefill: several prompts' chunks back to back; decode: one token per running request)
and describes where each token's K/V goes and what it attends to in `AttentionMetadata`.
The linear layers then see one ``[T, d_model]`` matrix (weights read once per step), and only
attention looks at per-request structure.

Weights are plain tensors (no nn.Module): Q/K/V are fused into one ``[q + 2kv, d]`` matrix
and gate/up into one ``[2 * ffn, d]`` matrix at load time (`engine.weights`), so each layer
runs four matmuls. HF tensor names live only in the loader.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.config import ModelConfig, RopeScaling
from engine.kv_cache import PagedKVCache

LayerHook = Callable[[int], None]
"""Called with the layer index right after that layer's K/V has been written to the cache."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: torch.Tensor  # [q + 2kv, d]
    qkv_bias: torch.Tensor | None  # [q + 2kv] (Qwen2)
    o: torch.Tensor  # [d, q]
    post_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2 * ffn, d]
    down: torch.Tensor  # [d, ffn]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, d]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [d]
    lm_head: torch.Tensor  # [V, d]; the same storage as `embed` when tied
    fingerprint: str = ""


@dataclass
class PrefillSegment:
    """One request's chunk inside a packed prefill batch.

    Tokens ``[q_start, q_start + q_len)`` of the batch are positions
    ``[ctx_len - q_len, ctx_len)`` of the request. `prefix_slots` holds the cache slots of the
    ``ctx_len - q_len`` earlier positions (cached prefix or earlier chunks), or None if the
    chunk starts the prompt.
    """

    q_start: int
    q_len: int
    ctx_len: int
    prefix_slots: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Where each token of the step writes K/V, and what it attends to.

    Exactly one of `prefill` (list of segments) and `decode_slots` is set.
    """

    positions: torch.Tensor  # [T] absolute position of each token
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V is written to
    prefill: list[PrefillSegment] | None = None
    # Decode: [B, S_max] slots of every context position (new token included), padded with 0.
    decode_slots: torch.Tensor | None = None
    decode_ctx_lens: torch.Tensor | None = None  # [B]
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, 1, S_max] bool (True = attend), cached per window; None if no masking needed."""
        if window not in self._masks:
            assert self.decode_slots is not None and self.decode_ctx_lens is not None
            batch, s_max = self.decode_slots.shape
            lens = self.decode_ctx_lens
            if window is None and bool((lens == s_max).all()):
                self._masks[window] = None
            else:
                key_pos = torch.arange(s_max, device=lens.device)[None, :]  # [1, S]
                mask = key_pos < lens[:, None]  # [B, S]
                if window is not None:
                    mask &= key_pos > (lens[:, None] - 1 - window)
                self._masks[window] = mask.view(batch, 1, 1, s_max)
        return self._masks[window]


class Rotary:
    """cos/sin tables for RoPE, computed in float32 as HF does, then cast to the model dtype."""

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        dim = cfg.head_dim
        inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
        )
        inv_freq = _scale_inv_freq(inv_freq, cfg.rope_scaling)
        pos = torch.arange(max_positions, device=device).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated [T, heads, D]."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _scale_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths divided by `factor`, short kept, smooth ramp between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in float32, scale applied in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Forward pass over packed tokens; reads and writes the paged cache it is handed."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_positions: int) -> None:
        self.cfg = cfg
        self.w = weights
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.rotary = Rotary(cfg, max_positions, self.dtype, self.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        logits_indices: torch.Tensor,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """input_ids [T] -> float32 logits [len(logits_indices), V]."""
        x = self.w.embed[input_ids]  # [T, d]
        for i, lw in enumerate(self.w.layers):
            x = self._layer(i, lw, x, meta, cache)
            if layer_hook is not None:
                layer_hook(i)
        x = rms_norm(x[logits_indices], self.w.norm, self.cfg.rms_norm_eps)  # [N, d]
        return F.linear(x, self.w.lm_head).float()  # [N, V]

    def _layer(
        self,
        i: int,
        lw: LayerWeights,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(h, lw.qkv, lw.qkv_bias)  # [T, q + 2kv]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = self.rotary.apply(q.view(t, cfg.num_heads, cfg.head_dim), meta.positions)  # [T, H, D]
        k = self.rotary.apply(k.view(t, cfg.num_kv_heads, cfg.head_dim), meta.positions)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        cache.write(i, meta.slot_mapping, k, v)
        window = cfg.sliding_windows[i]
        if meta.prefill is not None:
            o = self._prefill_attention(i, q, k, v, meta.prefill, cache, window)
        else:
            o = self._decode_attention(i, q, meta, cache, window)
        x = x + F.linear(o, lw.o)  # [T, d]
        h = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)
        gate, up = F.linear(h, lw.gate_up).chunk(2, dim=-1)  # [T, ffn] each
        return x + F.linear(F.silu(gate) * up, lw.down)

    def _prefill_attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: list[PrefillSegment],
        cache: PagedKVCache,
        window: int | None,
    ) -> torch.Tensor:
        """Causal attention per segment: new tokens attend to the prefix and to each other."""
        outs = []
        for seg in segments:
            sl = slice(seg.q_start, seg.q_start + seg.q_len)
            qs, ks, vs = q[sl], k[sl], v[sl]  # [q_len, H(kv), D]
            if seg.prefix_slots is not None:
                pk, pv = cache.gather(layer, seg.prefix_slots)  # [prefix_len, Hkv, D]
                ks, vs = torch.cat((pk, ks)), torch.cat((pv, vs))  # [ctx_len, Hkv, D]
            mask = _prefill_mask(seg, window, q.device)
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0),  # [1, H, q_len, D]
                ks.transpose(0, 1).unsqueeze(0),  # [1, Hkv, ctx_len, D]
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            outs.append(o[0].transpose(0, 1).reshape(seg.q_len, -1))  # [q_len, H * D]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_attention(
        self,
        layer: int,
        q: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        window: int | None,
    ) -> torch.Tensor:
        """One query per request against its whole context, gathered from the pages."""
        assert meta.decode_slots is not None
        batch = q.shape[0]
        k, v = cache.gather(layer, meta.decode_slots)  # [B, S, Hkv, D]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            k.transpose(1, 2),  # [B, Hkv, S, D]
            v.transpose(1, 2),
            attn_mask=meta.decode_mask(window),
            scale=self.scale,
            enable_gqa=True,
        )
        return o.view(batch, -1)  # [B, H * D]


def _prefill_mask(
    seg: PrefillSegment, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """[q_len, ctx_len] bool mask, or None when plain causal attention is exact."""
    if seg.q_len == seg.ctx_len and (window is None or window >= seg.ctx_len):
        return None
    q_pos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len, device=device)[:, None]
    k_pos = torch.arange(seg.ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
