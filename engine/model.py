"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Gemma 3), top to bottom,
over a paged KV cache.

One forward serves both phases. The caller packs every token of the step into one ``[T]``
batch (prefill: several prompts' chunks back to back; decode: one token per running request)
and describes where each token's K/V goes and what it attends to in `AttentionMetadata`.
The linear layers then see one ``[T, d_model]`` matrix (weights read once per step), and only
attention looks at per-request structure.

Weights are plain tensors (no nn.Module): Q/K/V are fused into one ``[q + 2kv, d]`` matrix
and gate/up into one ``[2 * ffn, d]`` matrix at load time (`engine.weights`), so each layer
runs four matmuls (five on CPU: `OneDnnProjections` runs gate and up apart so that SiLU and
the product ride in their epilogues). HF tensor names live only in the loader.

The variants, each a `ModelConfig` field: q/k norms over each head before RoPE (Qwen3,
Gemma 3); per-layer RoPE, global, local (another base) or none (SmolLM3's NoPE layers,
`engine.rope`); Gemma 3's block (norms scaling by 1 + w in float32, attention and MLP outputs
normed before their residual adds, embeddings scaled by sqrt(d), a GELU gate, its own
attention scale).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.attention import matmul_attention
from engine.config import ModelConfig
from engine.decode_workspace import DecodeWorkspace
from engine.kernels import KernelSet, check_applies
from engine.kv_cache import PagedKVCache
from engine.model_weights import LayerWeights, ModelWeights
from engine.norms import fused_rms_norm, gemma_rms_norm, rms_norm
from engine.projections import OneDnnProjections, Projections
from engine.rope import Rotary

__all__ = ["LayerWeights", "LlamaModel", "ModelWeights", "OneDnnProjections", "Projections"]

LayerHook = Callable[[int], None]
"""Called with the layer index right after that layer's K/V has been written to the cache."""


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
    # the same blocks whether or not the chunk starts the prompt: a kernel that reads the
    # pages in place (`KernelSet.prefill_reads_pages`) needs them for every chunk
    blocks: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where each token of the step writes K/V, and what it attends to.

    A step is prompt chunks (`prefill`, a list of segments), decode rows (`decode_ctx_lens`
    and a context form), or both: a **mixed step** packs the segments' tokens first, rows
    ``0 .. num_prefill_tokens-1``, and one token per decode request after them. The linear
    layers see one matrix either way; attention runs the segments through the prefill path
    and the decode rows through the decode path, so the decode rows of a mixed step read
    their context where a decode step reads it (the workspace) and append to it the same way.

    Decode context is given as a `DecodeWorkspace` (what the runner uses: no per-step copy
    of the context), as block tables (`decode_block_tables`: attention gathers whole pages,
    one 8 KiB row per block instead of one row per token), or as a slot grid
    (`decode_slots`, any slot layout at all); `decode_ctx_lens` goes with each.
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
    def num_prefill_tokens(self) -> int:
        """Rows of the step that belong to prompt chunks (the decode rows follow them)."""
        return sum(seg.q_len for seg in self.prefill) if self.prefill else 0

    @property
    def has_decode(self) -> bool:
        return self.decode_ctx_lens is not None

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


def give_freed_memory_back() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc's `malloc_trim`).

    For a process that hosts engines one set after another (the determinism census, the
    tests): without it, each set's freed memory stays in the heap, and the next set's peak
    stacks on the last one's. No-op off glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class LlamaModel:
    """Forward pass over packed tokens; reads and writes the paged cache it is handed."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        kernels: KernelSet | None = None,
    ) -> None:
        """`kernels`: each op's kernel (`engine.kernels.select` measures them; None: the
        reference set, torch's own kernels)."""
        self.cfg = cfg
        self.w = weights
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        ropes = {
            "global": (cfg.rope_theta, cfg.rope_scaling),
            "local": (cfg.local_rope_theta, cfg.local_rope_scaling),
        }
        self.rotaries = {
            kind: Rotary(cfg.head_dim, *ropes[kind], max_positions, self.dtype, self.device)
            for kind in sorted({cfg.rope_of(i) for i in range(cfg.num_layers)} - {"none"})
        }
        self.scale = cfg.query_scale or 1.0 / math.sqrt(cfg.head_dim)
        self.embed_scale = (
            torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype) if cfg.gemma_norms else None
        )
        if self.device.type == "cpu":
            keep_freed_memory()
        self.set_kernels(kernels or KernelSet.reference())

    def set_kernels(self, kernels: KernelSet, proj: Projections | None = None) -> None:
        """Run `kernels` from now on; `proj`: their projections, already built (packing the
        weights takes a while: `make bench-kernels` alternates prebuilt ones)."""
        check_applies(kernels, self.device, self.dtype)
        proj = proj or kernels.make_projections(self.w, self.cfg.hidden_act)
        if proj.reads_plain and self.w.matrices_released:
            raise ValueError(
                f"kernels: projections={kernels.projections} needs the plain weights, "
                "which this engine freed (EngineConfig.keep_plain_weights keeps them)"
            )
        self.kernels = kernels
        self.proj = proj
        self._decode_kernel = kernels.decode_fn()
        self._prefill_kernel = kernels.prefill_fn()
        self._paged_decode = kernels.paged_decode()  # None: decode takes a gathered context
        self._paged_prefill = kernels.paged_prefill()  # None: prefill takes a gathered context
        self._fused_norm = kernels.norm == "fused"
        self._rope_write = kernels.rope_kv_fn()
        # a paged prefill kernel's tables, built at a step's first layer for its segments
        self._tables: tuple[list[PrefillSegment], tuple[torch.Tensor, ...]] | None = None
        # single prompt rows (`_row_attention`) always take a gathered context
        self._row_kernel = matmul_attention if kernels.decode_reads_pages else self._decode_kernel

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The model's RMSNorm: the chosen kernel (torch's looked up when called: `pdserve
        trace` times it)."""
        if self._fused_norm:
            return fused_rms_norm(x, weight, eps, self.cfg.gemma_norms)
        return (gemma_rms_norm if self.cfg.gemma_norms else rms_norm)(x, weight, eps)

    @property
    def rotary(self) -> Rotary:
        """The global RoPE's tables (every layer's, outside Gemma 3 and SmolLM3)."""
        return self.rotaries["global"]

    @property
    def matmul_path(self) -> str:
        """Which projections run and in what dtype, for startup lines and test ids:
        `packed oneDNN bfloat16`, `plain float32`, ..."""
        kind = {"packed": "packed oneDNN"}.get(self.kernels.projections, self.kernels.projections)
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
        if self.embed_scale is not None:
            x = x * self.embed_scale
        ropes = {kind: (r, r.tables(meta.positions)) for kind, r in self.rotaries.items()}
        rows = None  # the rows the last layer keeps (None: all of them)
        if meta.prefill is not None and not hidden_rows:
            rows = meta.logit_rows if meta.logit_rows is not None else logits_indices.tolist()
        if rows is not None and len(rows) == len(input_ids):
            rows = None  # every row gives logits (one-token chunks): nothing to prune
        last = len(self.w.layers) - 1
        for i, lw in enumerate(self.w.layers):
            rope = ropes.get(self.cfg.rope_of(i))  # None: a NoPE layer
            x = self._layer(i, lw, x, meta, cache, rope, rows if i == last else None)
            if layer_hook is not None:
                layer_hook(i)
        picked = x[torch.tensor(list(hidden_rows), dtype=torch.long, device=x.device)]
        hidden = self.norm(picked, self.w.norm, self.cfg.rms_norm_eps)
        if rows is None:
            x = x[logits_indices]
        x = self.norm(x, self.w.norm, self.cfg.rms_norm_eps)  # [N, d]
        return self.proj.lm_head(x).float(), hidden  # [N, V], [len(hidden_rows), d]

    def _layer(
        self,
        i: int,
        lw: LayerWeights,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        rope: tuple[Rotary, tuple[torch.Tensor, torch.Tensor]] | None,
        keep: list[int] | None = None,
    ) -> torch.Tensor:
        """One decoder layer: the residual stream `x` [T, d] in, the updated stream out.

        `keep` (a prefill step's last layer): K/V of all T tokens are written, then only
        these rows are carried on; the stream comes out as [len(keep), d]."""
        cfg, norm, eps = self.cfg, self.norm, self.cfg.rms_norm_eps
        t = x.shape[0]
        h = norm(x, lw.input_norm, eps)
        qkv = self.proj.qkv(i, h)  # [T, q + 2kv]
        # q and k sit side by side in qkv: norm and rotate both heads' worth in one pass.
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, -1)
        if lw.q_norm is not None and lw.k_norm is not None:
            qk = torch.cat(
                (
                    norm(qk[:, : cfg.num_heads], lw.q_norm, eps),
                    norm(qk[:, cfg.num_heads :], lw.k_norm, eps),
                ),
                dim=1,
            )
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, -1)  # [T, Hkv, D]
        if rope is not None:  # rotate q and k, store the rotated k and v in the cache
            tables = rope[1]
            qk = self._rope_write(qk, v, *tables, *cache.layer_slots(i), meta.slot_mapping)
        else:  # a NoPE layer
            cache.write(i, meta.slot_mapping, qk[:, cfg.num_heads :], v)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]  # [T, H, D], [T, Hkv, D]
        tp = meta.num_prefill_tokens
        if meta.decode_workspace is not None:
            meta.decode_workspace.write(i, k[tp:], v[tp:])  # the decode rows' K/V
        if keep is not None:
            x = x[torch.tensor(keep, dtype=torch.long, device=x.device)]  # [N, d]
            if not keep:
                return x  # a chunk that completes no prompt: K/V was all it had to give
        o = self._attention(i, q, k, v, meta, cache, keep, tp)
        if lw.attn_out_norm is None or lw.mlp_out_norm is None:  # Llama's block
            x = self.proj.o_residual(i, o, x)  # [T, d]
            return self.proj.mlp_residual(i, norm(x, lw.post_norm, eps), x)
        x = x + norm(self.proj.o(i, o), lw.attn_out_norm, eps)  # Gemma 3's: sublayers normed
        h = norm(x, lw.post_norm, eps)
        return x + norm(self.proj.mlp(i, h), lw.mlp_out_norm, eps)

    def _attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        keep: list[int] | None,
        tp: int,
    ) -> torch.Tensor:
        """Attention output [T, H * D] (or [len(keep), H * D]) of the step's rows: the
        prompt chunks' (rows ``0 .. tp-1``) through the prefill path, then the decode rows'
        through the decode path. `keep` (the last layer's pruning) lists the prompt rows to
        compute, followed by every decode row (each decode row gives logits)."""
        window = self.cfg.sliding_windows[layer]
        outs = []
        if meta.prefill is not None:
            if keep is None:
                outs.append(self._prefill_attention(layer, q, k, v, meta.prefill, cache, window))
            else:
                rows = [r for r in keep if r < tp]
                assert len(keep) - len(rows) == q.shape[0] - tp, "every decode row is kept"
                if rows:
                    segs = meta.prefill
                    outs.append(self._row_attention(layer, q, k, v, rows, segs, cache, window))
        if meta.has_decode:
            outs.append(self._decode_attention(layer, q[tp:], meta, cache, window))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

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
        if self._paged_prefill is not None:  # every segment in one call, on the pages
            if self._tables is None or self._tables[0] is not segments:  # once per step
                self._tables = (segments, _segment_tables(segments, self.device))
            tables, starts, lens = self._tables[1]
            kp, vp = cache.layer_pages(layer)
            tp = int(starts[-1])
            return self._paged_prefill.paged(
                q[:tp], kp, vp, tables, starts, lens, window, self.scale
            )
        outs = []
        for seg in segments:
            qs = q[seg.q_start : seg.q_start + seg.q_len]  # [q_len, H, D]
            ks, vs = _context_kv(layer, seg, k, v, cache)  # [ctx_len, Hkv, D]
            outs.append(self._prefill_kernel(qs, ks, vs, window, self.scale))  # [q_len, H * D]
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
        if self._paged_prefill is not None:  # each row as a request of one query row
            row_segs: list[PrefillSegment] = []
            for r in rows:
                seg = next(s for s in segments if s.q_start <= r < s.q_start + s.q_len)
                p = seg.ctx_len - seg.q_len + (r - seg.q_start)
                row_segs.append(PrefillSegment(len(row_segs), 1, p + 1, blocks=seg.blocks))
            tables, starts, lens = _segment_tables(row_segs, self.device)
            kp, vp = cache.layer_pages(layer)
            qr = q[torch.tensor(rows, dtype=torch.long, device=q.device)]
            return self._paged_prefill.paged(qr, kp, vp, tables, starts, lens, window, self.scale)
        outs = []
        for r in rows:
            seg = next(s for s in segments if s.q_start <= r < s.q_start + s.q_len)
            p = seg.ctx_len - seg.q_len + (r - seg.q_start)
            lo = 0 if window is None else max(0, p + 1 - window)
            ks, vs = _context_kv(layer, seg, k, v, cache)  # [ctx_len, Hkv, D]
            ks, vs = ks[lo : p + 1].transpose(0, 1), vs[lo : p + 1].transpose(0, 1)
            o = self._row_kernel(q[r : r + 1], ks[None], vs[None], None, self.scale)
            outs.append(o)  # [1, H * D]
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
        if self._paged_decode is not None:
            assert meta.decode_block_tables is not None and meta.decode_ctx_lens is not None
            kp, vp = cache.layer_pages(layer)
            tables, lens = meta.decode_block_tables, meta.decode_ctx_lens
            return self._paged_decode(q, kp, vp, tables, lens, window, self.scale)
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
        return self._decode_kernel(q, k, v, meta.decode_mask(window), self.scale)  # [B, H * D]


def _segment_tables(
    segments: Sequence[PrefillSegment], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged prefill kernel's inputs: block tables [R, nb] (zero-padded), query row starts
    [R + 1] and context lengths [R], for segments packed back to back from row 0."""
    width = max(len(_blocks_of(seg)) for seg in segments)
    tables = torch.zeros(len(segments), width, dtype=torch.long, device=device)
    for i, seg in enumerate(segments):
        blocks = _blocks_of(seg)
        tables[i, : len(blocks)] = blocks
    starts = [0]
    for seg in segments:
        assert seg.q_start == starts[-1], "segments are packed back to back"
        starts.append(starts[-1] + seg.q_len)
    lens = [seg.ctx_len for seg in segments]
    return tables, torch.tensor(starts), torch.tensor(lens)


def _blocks_of(seg: PrefillSegment) -> torch.Tensor:
    blocks = seg.blocks if seg.blocks is not None else seg.context_blocks
    assert blocks is not None, "a paged prefill kernel needs every segment's blocks"
    return blocks


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
