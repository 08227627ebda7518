"""The Llama-family decoder (Llama, Mistral, Qwen2), top to bottom, over a paged KV cache.

One forward serves both phases. The caller packs every token of the step into one ``[T]``
batch (prefill: several prompts' chunks back to back; decode: one token per running request)
and describes where each token's K/V goes and what it attends to in `AttentionMetadata`.
The linear layers then see one ``[T, d_model]`` matrix (weights read once per step), and only
attention looks at per-request structure.

Weights are plain tensors (no nn.Module): Q/K/V are fused into one ``[q + 2kv, d]`` matrix
and gate/up into one ``[2 * ffn, d]`` matrix at load time (`engine.weights`), so each layer
runs four matmuls (five on CPU: `OneDnnProjections` runs gate and up apart so that SiLU and
the product ride in their epilogues). HF tensor names live only in the loader.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.config import ModelConfig, RopeScaling
from engine.cpu import onednn_bf16_supported
from engine.decode_workspace import DecodeWorkspace
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
    ``[ctx_len - q_len, ctx_len)`` of the request. When the chunk does not start the prompt
    (a cached prefix or earlier chunks come first), `context_blocks` holds the ids of the
    blocks covering positions ``[0, ctx_len)``: attention reads the whole context, this
    chunk's own K/V included (written just before), as whole pages in one gather.
    """

    q_start: int
    q_len: int
    ctx_len: int
    context_blocks: torch.Tensor | None = None  # [ceil(ctx_len / block_size)]


@dataclass
class AttentionMetadata:
    """Where each token of the step writes K/V, and what it attends to.

    Exactly one of `prefill` (list of segments) and decode context is set. Decode context is
    given as a `DecodeWorkspace` (what the runner uses: no per-step copy of the context),
    as block tables (`decode_block_tables`: attention gathers whole pages, one 8 KiB row
    per block instead of one row per token), or as a slot grid (`decode_slots`, any slot
    layout at all); `decode_ctx_lens` goes with each.
    """

    positions: torch.Tensor  # [T] absolute position of each token
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V is written to
    prefill: list[PrefillSegment] | None = None
    # Decode, form 1: [B, S_max] slots of every context position (new token included),
    # padded with 0.
    decode_slots: torch.Tensor | None = None
    decode_ctx_lens: torch.Tensor | None = None  # [B]
    # Decode, form 2: [B, max_blocks] block ids of each request, padded with 0.
    decode_block_tables: torch.Tensor | None = None
    # Decode, form 3: rows 0 .. B-1 of a workspace hold the batch's context (positions
    # before this step's token); the step appends its K/V there as well as to the pages.
    decode_workspace: DecodeWorkspace | None = None
    # Prefill: `logits_indices` as host ints, when the caller has them (the runner does):
    # the last-layer pruning needs them on the host, and reading them back is a device sync.
    logit_rows: list[int] | None = None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    _lens: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        return self.prefill is None

    def ctx_lens(self) -> list[int]:
        """Decode context lengths as Python ints (read once; a device sync on GPU)."""
        if self._lens is None:
            assert self.decode_ctx_lens is not None
            self._lens = self.decode_ctx_lens.tolist()
        return self._lens

    def decode_span(self) -> int:
        """Key positions decode attention looks at: the longest context.

        Gathered context is padded to whole blocks (or to the slot grid's width); keys past
        the longest context are dropped by slicing, so only requests shorter than the
        longest need a mask.
        """
        return max(self.ctx_lens())

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, 1, span] bool (True = attend), cached per window; None if no masking needed.

        Every request's keys are its positions ``0 .. len - 1`` (left-aligned), so equal
        lengths without a window need no mask at all: the common batch-1 case, and a batch
        of requests that arrived together.
        """
        if window not in self._masks:
            lens_list = self.ctx_lens()
            span = max(lens_list)
            if min(lens_list) == span and (window is None or window >= span):
                self._masks[window] = None
            else:
                assert self.decode_ctx_lens is not None
                lens = self.decode_ctx_lens
                key_pos = torch.arange(span, device=lens.device)[None, :]  # [1, S]
                mask = key_pos < lens[:, None]  # [B, S]
                if window is not None:
                    mask &= key_pos > (lens[:, None] - 1 - window)
                self._masks[window] = mask.view(len(lens_list), 1, 1, span)
        return self._masks[window]


class Rotary:
    """cos/sin tables for RoPE, computed in float32 as HF does, then cast to the model dtype.

    HF rotates with ``x * cos + cat(-x2, x1) * sin``. The tables keep ``sin`` with its first
    half negated (`sin_signed`), so the rotation is ``x * cos + roll(x, D/2) * sin_signed``:
    the same products bit for bit (negation is exact), one fewer pass over ``x``.
    """

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
        half = dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at `positions`, ``[T, 1, D]`` each (once per forward)."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (may be a strided view) -> rotated, contiguous [T, heads, D]."""
        swapped = x.roll(x.shape[-1] // 2, dims=-1)  # cat(x2, x1)
        swapped.mul_(sin_signed)
        return torch.mul(x, cos).add_(swapped)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated [T, heads, D]."""
        return self.rotate(x, *self.tables(positions))


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


class Projections:
    """The model's matmuls in eager PyTorch: `F.linear` plus separate elementwise ops.

    The reference path (any device, any dtype). `OneDnnProjections` is the CPU fast path;
    `LlamaModel` picks one at construction. Both own the residual update: they take the
    residual stream ``x`` and return it with the sublayer's output added.
    """

    def __init__(self, weights: ModelWeights) -> None:
        self.w = weights

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [T, q + 2kv]."""
        lw = self.w.layers[i]
        return F.linear(h, lw.qkv, lw.qkv_bias)

    def o_residual(self, i: int, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + o @ Wo^T; o [T, q], x [T, d] (updated in place: the GEMM accumulates into x)."""
        return x.addmm_(o, self.w.layers[i].o.t())

    def mlp_residual(self, i: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + down(silu(gate(h)) * up(h)); h, x [T, d]."""
        lw = self.w.layers[i]
        gate, up = torch.mm(h, lw.gate_up.t()).chunk(2, dim=-1)  # [T, ffn] views
        return x.addmm_(F.silu(gate).mul_(up), lw.down.t())

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, V] in the model dtype."""
        return F.linear(x, self.w.lm_head)


@dataclass
class _PackedLayer:
    qkv: torch.Tensor  # oneDNN blocked layout (opaque `torch._mkldnn` tensors)
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class OneDnnProjections(Projections):
    """CPU matmuls through oneDNN with weights repacked once and epilogues fused.

    Why: with plain ``[out, in]`` weights each `F.linear` call leaves oneDNN to bring the
    weight into its blocked (AMX / AVX-512) layout as it goes, and every SiLU, product and
    residual add is one more pass over the activations. Here each matrix is reordered once at
    load (`mkldnn._reorder_linear_weight`) and the elementwise tails run inside the matmul as
    oneDNN post-ops (`mkldnn._linear_pointwise`, what TorchInductor's CPU backend emits):

        gate = silu(h @ Wg^T)            "swish" post-op
        act  = (h @ Wu^T) * gate         binary "mul" post-op
        x    = x + act @ Wd^T            binary "add" post-op (likewise for o_proj)

    Why it is the default: packed projections were faster than `Projections` for decode at
    every batch size and thread count measured, and at least at parity for prefill, so there
    is no case for switching paths by phase (figures: docs/benchmarks.md, "Packed oneDNN
    projections").

    The products are the same; rounding differs: a post-op sees the float32 accumulator, so
    bfloat16 output is rounded once where eager rounds after each op, and float32 results
    move by rounding only (well inside the 1e-4 logit tolerance against HF). The packed
    copies are extra memory, one more copy of every matrix; the plain weights stay for
    everything else (`LlamaModel(onednn=False)` skips them).
    """

    def __init__(self, weights: ModelWeights) -> None:
        super().__init__(weights)
        pack = torch.ops.mkldnn._reorder_linear_weight
        self.packed = []
        for lw in weights.layers:
            gate, up = lw.gate_up.chunk(2)  # [ffn, d] each
            self.packed.append(
                _PackedLayer(
                    qkv=pack(lw.qkv),
                    o=pack(lw.o),
                    gate=pack(gate.contiguous()),
                    up=pack(up.contiguous()),
                    down=pack(lw.down),
                )
            )
        self.lm_head_packed = pack(weights.lm_head)

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return (
            device.type == "cpu"
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16_supported()))
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        bias = self.w.layers[i].qkv_bias
        return torch.ops.mkldnn._linear_pointwise(h, self.packed[i].qkv, bias, "none", [], "")

    def o_residual(self, i: int, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(o, x, self.packed[i].o, None, "add")

    def mlp_residual(self, i: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        p = self.packed[i]
        linear = torch.ops.mkldnn._linear_pointwise
        gate = linear(h, p.gate, None, "swish", [], "")  # silu(h @ Wg^T), [T, ffn]
        act = linear.binary(h, gate, p.up, None, "mul")  # (h @ Wu^T) * gate
        return linear.binary(act, x, p.down, None, "add")  # x + act @ Wd^T

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.lm_head_packed, None, "none", [], "")


_malloc_tuned = False


def keep_freed_memory() -> None:
    """Make glibc reuse freed memory for big tensors instead of handing it back (once).

    Why: a forward allocates many short-lived MiB-sized activations. By default glibc serves
    each from a fresh ``mmap`` and unmaps it on free (its adaptive threshold does not keep up),
    so the kernel zero-fills every page again on first touch: thousands of page faults per
    prefill, a measurable share of the forward (docs/benchmarks.md, "Freed memory"). With a
    high mmap threshold and no trimming, the heap keeps the memory and the faults go to zero.
    Process-wide (everything in the process benefits, HF included); the process keeps its
    peak heap. No-op off glibc.
    """
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux"):
        return
    _malloc_tuned = True
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    # glibc caps the mmap threshold (32 MiB on older releases): fall back if refused.
    if not mallopt(m_mmap_threshold, 256 << 20):
        mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in float32, scale applied in the input dtype.

    Bit for bit HF's ``weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype)``, with the cast
    folded into the multiply's output (one rounding either way) and no other temporaries.
    """
    xf = x.float()
    rstd = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # [T, 1]
    normed = torch.mul(xf, rstd, out=torch.empty_like(x))  # rounded once to x.dtype
    return normed.mul_(weight)


class LlamaModel:
    """Forward pass over packed tokens; reads and writes the paged cache it is handed."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        onednn: bool | None = None,
    ) -> None:
        """`onednn`: use `OneDnnProjections` (None: wherever available, i.e. on CPU)."""
        self.cfg = cfg
        self.w = weights
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.rotary = Rotary(cfg, max_positions, self.dtype, self.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        if self.device.type == "cpu":
            keep_freed_memory()
        if onednn is None:
            onednn = OneDnnProjections.available(self.device, self.dtype)
        self.proj: Projections = OneDnnProjections(weights) if onednn else Projections(weights)

    @property
    def matmul_path(self) -> str:
        """Which projections run and in what dtype, for startup lines and test ids:
        `packed oneDNN bfloat16`, `plain float32`, ..."""
        kind = "packed oneDNN" if isinstance(self.proj, OneDnnProjections) else "plain"
        return f"{kind} {str(self.dtype).removeprefix('torch.')}"

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        logits_indices: torch.Tensor,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """input_ids [T] -> float32 logits [len(logits_indices), V]. A prefill step prunes
        its last layer: all K/V is written, but only the logit rows (a completing prompt's
        last token) go on through it; nothing reads the others, so this is exact and saves
        most of a layer (as llama.cpp). Decode keeps every row."""
        logits, _ = self.forward_with_hidden(input_ids, meta, cache, logits_indices, (), layer_hook)
        return logits

    @torch.inference_mode()
    def forward_with_hidden(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        logits_indices: torch.Tensor,
        hidden_rows: Sequence[int],
        layer_hook: LayerHook | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the final-normed hidden states of `hidden_rows` [len, d] (prompt
        logprobs: `proj.lm_head` of them, in slices); the last layer is then not pruned."""
        x = self.w.embed[input_ids]  # [T, d]
        rope = self.rotary.tables(meta.positions)  # shared by every layer
        rows = None
        if meta.prefill is not None and not hidden_rows:
            rows = meta.logit_rows if meta.logit_rows is not None else logits_indices.tolist()
        if rows is not None and len(rows) == len(input_ids):
            rows = None  # every row gives logits (one-token chunks): nothing to prune
        last = len(self.w.layers) - 1
        for i, lw in enumerate(self.w.layers):
            x = self._layer(i, lw, x, meta, cache, rope, rows if i == last else None)
            if layer_hook is not None:
                layer_hook(i)
        picked = x[torch.tensor(list(hidden_rows), dtype=torch.long, device=x.device)]
        hidden = rms_norm(picked, self.w.norm, self.cfg.rms_norm_eps)
        if rows is None:
            x = x[logits_indices]
        x = rms_norm(x, self.w.norm, self.cfg.rms_norm_eps)  # [N, d]
        return self.proj.lm_head(x).float(), hidden  # [N, V], [len(hidden_rows), d]

    def _layer(
        self,
        i: int,
        lw: LayerWeights,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        rope: tuple[torch.Tensor, torch.Tensor],
        keep: list[int] | None = None,
    ) -> torch.Tensor:
        """One decoder layer: the residual stream `x` [T, d] in, the updated stream out.

        `keep` (a prefill step's last layer): K/V of all T tokens are written, then only
        these rows are carried on; the stream comes out as [len(keep), d]."""
        cfg = self.cfg
        t = x.shape[0]
        h = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
        qkv = self.proj.qkv(i, h)  # [T, q + 2kv]
        # q and k sit side by side in qkv: rotate both heads' worth in one pass.
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, -1)
        qk = self.rotary.rotate(qk, *rope)  # [T, H + Hkv, D]
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]  # [T, H, D], [T, Hkv, D]
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, -1)  # [T, Hkv, D]
        cache.write(i, meta.slot_mapping, k, v)
        if meta.decode_workspace is not None:
            meta.decode_workspace.write(i, k, v)
        window = cfg.sliding_windows[i]
        if keep is not None:
            assert meta.prefill is not None
            x = x[torch.tensor(keep, dtype=torch.long, device=x.device)]  # [N, d]
            if not keep:
                return x  # a chunk that completes no prompt: K/V was all it had to give
            o = self._row_attention(i, q, k, v, keep, meta.prefill, cache, window)
        elif meta.prefill is not None:
            o = self._prefill_attention(i, q, k, v, meta.prefill, cache, window)
        else:
            o = self._decode_attention(i, q, meta, cache, window)
        x = self.proj.o_residual(i, o, x)  # [T, d]
        h = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)
        return self.proj.mlp_residual(i, h, x)

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
            qs = q[seg.q_start : seg.q_start + seg.q_len]  # [q_len, H, D]
            ks, vs = _context_kv(layer, seg, k, v, cache)  # [ctx_len, Hkv, D]
            mask = _prefill_mask(seg, window, q.device, q.dtype)
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

    def _row_attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: list[int],
        segments: list[PrefillSegment],
        cache: PagedKVCache,
        window: int | None,
    ) -> torch.Tensor:
        """Attention of single query rows of a prefill step -> [len(rows), H * D].

        Row r of segment s is position ``p = ctx_len - q_len + (r - q_start)``; it sees
        keys ``[max(0, p + 1 - window), p]``, so slicing the keys replaces the mask.
        """
        outs = []
        for r in rows:
            seg = next(s for s in segments if s.q_start <= r < s.q_start + s.q_len)
            p = seg.ctx_len - seg.q_len + (r - seg.q_start)
            lo = 0 if window is None else max(0, p + 1 - window)
            ks, vs = _context_kv(layer, seg, k, v, cache)  # [ctx_len, Hkv, D]
            o = F.scaled_dot_product_attention(
                q[r : r + 1].transpose(0, 1).unsqueeze(0),  # [1, H, 1, D]
                ks[lo : p + 1].transpose(0, 1).unsqueeze(0),  # [1, Hkv, n, D]
                vs[lo : p + 1].transpose(0, 1).unsqueeze(0),
                scale=self.scale,
                enable_gqa=True,
            )
            outs.append(o.reshape(1, -1))  # [1, H * D]
        return torch.cat(outs)

    def _decode_attention(
        self,
        layer: int,
        q: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        window: int | None,
    ) -> torch.Tensor:
        """One query per request against its whole context: read in place from the decode
        workspace, or gathered from the pages (block tables or a slot grid)."""
        batch = q.shape[0]
        span = meta.decode_span()
        if meta.decode_workspace is not None:
            k, v = meta.decode_workspace.layer(layer, batch, span)  # [B, Hkv, span, D]
        else:
            if meta.decode_block_tables is not None:
                kp, vp = cache.gather_blocks(layer, meta.decode_block_tables)  # [B, S, Hkv, D]
            else:
                assert meta.decode_slots is not None
                kp, vp = cache.gather(layer, meta.decode_slots)  # [B, S_max, Hkv, D]
            k, v = kp[:, :span].transpose(1, 2), vp[:, :span].transpose(1, 2)  # [B, Hkv, span, D]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            k,
            v,
            attn_mask=meta.decode_mask(window),
            scale=self.scale,
            enable_gqa=True,
        )
        return o.view(batch, -1)  # [B, H * D]


def _context_kv(
    layer: int, seg: PrefillSegment, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions ``[0, ctx_len)`` of a segment's request, ``[ctx_len, Hkv, D]``:
    the chunk's own rows of this step's `k`/`v` when it starts the prompt, else the whole
    context read from the pages (this chunk's K/V was written there just before)."""
    if seg.context_blocks is None:
        sl = slice(seg.q_start, seg.q_start + seg.q_len)
        return k[sl], v[sl]
    kp, vp = cache.gather_blocks(layer, seg.context_blocks[None])  # [1, nb * Bs, Hkv, D]
    return kp[0, : seg.ctx_len], vp[0, : seg.ctx_len]


def _prefill_mask(
    seg: PrefillSegment, window: int | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """[q_len, ctx_len] additive mask (0 / -inf), or None when plain causal attention is
    exact. Every layer of a step asks for the same mask, so it is built once (`_mask`)."""
    if seg.q_len == seg.ctx_len and (window is None or window >= seg.ctx_len):
        return None
    return _mask(seg.ctx_len, seg.q_len, window, device, dtype)


@functools.lru_cache(maxsize=4)
def _mask(
    ctx_len: int, q_len: int, window: int | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    # Additive, in the query dtype: SDPA would otherwise turn a bool mask into this on
    # every call (one `where` over [q_len, ctx_len] per layer).
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    mask = torch.zeros(q_len, ctx_len, dtype=dtype, device=device)
    return mask.masked_fill_(~keep, float("-inf"))
