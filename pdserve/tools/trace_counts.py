"""`pdserve trace`'s counts: FLOPs and bytes of every op of a step, from the config alone.

Pure arithmetic on `ModelConfig` sizes (no torch, nothing measured), apart from `trace`'s
timing so that the counting conventions can be read and tested on their own.

The rows follow the engine's calls in `LlamaModel._layer` order, one row per call that
`trace` times. A call that runs several logical ops (`Projections.o_residual`: o_proj and
the residual add; `Projections.mlp_residual`: gate/up, SiLU-and-multiply, down and the
residual add) is one row of kind ``"fused"`` whose `parts` are those ops: the row's counts
are the sums of its parts', and the per-kind FLOP totals are taken over the parts.

Counting conventions
--------------------
* ``T`` is the number of new tokens in the step (prompt length for prefill, 1 for decode) and
  ``S`` the context length attention sees (``T`` for prefill, prompt + 1 for decode).
* **Matmul FLOPs** are ``2 * m * n * k`` (one multiply and one add per MAC), so the four
  projections of a layer cost ``2 * T * (d*(q + 2kv) + q*d + 3*d*ffn)``; a Qwen2 bias adds
  ``T * (q + 2kv)``. The head runs only on the rows that produce logits (1 here), and so
  does a prefill step's last layer past its qkv projection and K/V write (the engine prunes it).
* **Attention FLOPs** are ``4 * H * D`` per attended (query, key) pair (``QK^T`` and ``PV``);
  only pairs the mask lets through count (causal: ``T(T+1)/2`` per head in prefill, ``S`` in
  decode; a sliding window caps both). Softmax, scaling and masking are not counted.
* **Elementwise FLOPs**: RMSNorm 4 per element (square, sum, scale, weight), rotary 3 per
  rotated element, SiLU-and-multiply 5 per FFN element, residual add 1 per element.
* **Bytes** are counted per logical op, as if each op were one kernel: every input read once,
  every output written once, no cache reuse between ops, and nothing counted for
  intermediates inside an op (the attention scores ``[H, T, S]`` are not materialized;
  rotary's temporaries are not counted). A fused call counts its parts' bytes, so the layer
  total is the traffic of the unfused eager model, not the compulsory minimum. Index tensors
  (token ids, slots) and the float32 cast of the logits are not counted.
* **Weights** (`weight_bytes`) are the parameter bytes a step reads: every projection matrix
  and norm vector once, the lm_head once, and the embedding rows of the step's tokens.
* **KV**: `kv_bytes_written` is what the step stores in the paged cache,
  ``T * 2 * layers * kv_heads * head_dim * dtype_bytes``. Decode also reads the context back:
  the engine keeps the running batch's K/V contiguous in its decode workspace
  (`engine.decode_workspace`), appends the new token there too (`kv_append`), and attention
  reads all ``S`` positions in place (counted in `kv_bytes_read`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import ModelConfig

# Elementwise FLOPs per element (see the module docstring).
RMSNORM_FLOPS = 4
ROTARY_FLOPS = 3
SILU_MUL_FLOPS = 5
RESIDUAL_FLOPS = 1

Shape = tuple[int, ...]


@dataclass
class OpCount:
    """FLOPs and bytes of one op row; `time_s` is set when the op was timed.

    A row of kind ``"fused"`` is one engine call that runs several logical ops: `parts`
    holds them (untimed: they run inside the one call), and its counts are their sums.
    """

    name: str
    kind: str  # "matmul" | "attention" | "elementwise" | "memory" | "fused"
    inputs: dict[str, Shape]
    outputs: dict[str, Shape]
    flops: int
    bytes_read: int
    bytes_written: int
    weight_bytes: int = 0  # the part of bytes_read that is parameters
    kv_bytes_written: int = 0  # the part of bytes_written stored in the KV cache
    kv_bytes_read: int = 0  # the part of bytes_read loaded from the KV cache
    note: str = ""
    time_s: float | None = None
    parts: list[OpCount] = field(default_factory=list)

    @property
    def shape_text(self) -> str:
        def fmt(d: dict[str, Shape]) -> str:
            return " ".join(f"{k}[{','.join(map(str, s))}]" for k, s in d.items())

        text = f"{fmt(self.inputs)} → {fmt(self.outputs)}"
        return f"{text} ({self.note})" if self.note else text

    def leaves(self) -> list[OpCount]:
        """The logical ops of this row: its parts if it is fused, else itself."""
        return self.parts or [self]


def fused(
    name: str, inputs: dict[str, Shape], outputs: dict[str, Shape], parts: list[OpCount]
) -> OpCount:
    """One engine call running `parts` in sequence: their counts summed, their names noted."""
    return OpCount(
        name,
        "fused",
        inputs,
        outputs,
        flops=sum(p.flops for p in parts),
        bytes_read=sum(p.bytes_read for p in parts),
        bytes_written=sum(p.bytes_written for p in parts),
        weight_bytes=sum(p.weight_bytes for p in parts),
        kv_bytes_written=sum(p.kv_bytes_written for p in parts),
        kv_bytes_read=sum(p.kv_bytes_read for p in parts),
        note="one call: " + " + ".join(p.name for p in parts),
        parts=parts,
    )


@dataclass(frozen=True)
class Totals:
    """Sums over a list of op rows (a fused row's FLOPs by kind come from its parts)."""

    flops: int
    matmul_flops: int
    attention_flops: int
    elementwise_flops: int
    bytes_read: int
    bytes_written: int
    weight_bytes: int
    kv_bytes_written: int
    kv_bytes_read: int

    @classmethod
    def of(cls, ops: list[OpCount]) -> Totals:
        leaves = [leaf for o in ops for leaf in o.leaves()]

        def kind(k: str) -> int:
            return sum(o.flops for o in leaves if o.kind == k)

        return cls(
            flops=sum(o.flops for o in leaves),
            matmul_flops=kind("matmul"),
            attention_flops=kind("attention"),
            elementwise_flops=kind("elementwise"),
            bytes_read=sum(o.bytes_read for o in leaves),
            bytes_written=sum(o.bytes_written for o in leaves),
            weight_bytes=sum(o.weight_bytes for o in leaves),
            kv_bytes_written=sum(o.kv_bytes_written for o in leaves),
            kv_bytes_read=sum(o.kv_bytes_read for o in leaves),
        )

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


def attended_pairs(num_queries: int, ctx_len: int, window: int | None) -> int:
    """(query, key) pairs a causal (optionally sliding-window) mask lets through, per head.

    The queries are the last `num_queries` of `ctx_len` positions; the query at position ``p``
    sees keys ``max(0, p - window + 1) .. p``.
    """
    first = ctx_len - num_queries
    if window is None:
        return sum(p + 1 for p in range(first, ctx_len))
    return sum(min(p + 1, window) for p in range(first, ctx_len))


def _norm_op(name: str, t: int, d: int, b: int, src: str, dst: str) -> OpCount:
    return OpCount(
        name,
        "elementwise",
        {src: (t, d), "w": (d,)},
        {dst: (t, d)},
        flops=RMSNORM_FLOPS * t * d,
        bytes_read=(t * d + d) * b,
        bytes_written=t * d * b,
        weight_bytes=d * b,
    )


def _matmul_op(name: str, src: str, dst: str, t: int, n_in: int, n_out: int, b: int) -> OpCount:
    """``dst[T, n_out] = src[T, n_in] @ W[n_out, n_in]^T``."""
    return OpCount(
        name,
        "matmul",
        {src: (t, n_in), "W": (n_out, n_in)},
        {dst: (t, n_out)},
        flops=2 * t * n_in * n_out,
        bytes_read=(t * n_in + n_out * n_in) * b,
        bytes_written=t * n_out * b,
        weight_bytes=n_out * n_in * b,
    )


def _residual_op(name: str, t: int, d: int, b: int) -> OpCount:
    return OpCount(
        name,
        "elementwise",
        {"x": (t, d), "y": (t, d)},
        {"x": (t, d)},
        flops=RESIDUAL_FLOPS * t * d,
        bytes_read=2 * t * d * b,
        bytes_written=t * d * b,
    )


def _qkv_op(cfg: ModelConfig, t: int, b: int) -> OpCount:
    """`Projections.qkv`: one matmul to ``[T, q + 2kv]``, plus the bias of Qwen2."""
    n_qkv = cfg.q_size + 2 * cfg.kv_size
    op = _matmul_op("qkv_proj", "h", "qkv", t, cfg.hidden_size, n_qkv, b)
    if cfg.attention_bias:
        op.inputs["bias"] = (n_qkv,)
        op.flops += t * n_qkv
        op.bytes_read += n_qkv * b
        op.weight_bytes += n_qkv * b
    return op


def _kv_ops(cfg: ModelConfig, t: int, b: int, decode: bool, workspace: bool) -> list[OpCount]:
    """The K/V write into the paged cache, and in decode the append to the workspace (when
    decode attention reads one, not the pages)."""
    hkv, hd, kv = cfg.num_kv_heads, cfg.head_dim, cfg.kv_size
    ops = [
        OpCount(
            "kv_write",
            "memory",
            {"k": (t, hkv, hd), "v": (t, hkv, hd)},
            {"cache": (2, t, hkv, hd)},
            flops=0,
            bytes_read=2 * t * kv * b,
            bytes_written=2 * t * kv * b,
            kv_bytes_written=2 * t * kv * b,
        )
    ]
    if decode and workspace:
        ops.append(
            OpCount(
                "kv_append",
                "memory",
                {"k": (t, hkv, hd), "v": (t, hkv, hd)},
                {"workspace": (2, hkv, t, hd)},
                flops=0,
                bytes_read=2 * t * kv * b,
                bytes_written=2 * t * kv * b,
            )
        )
    return ops


def _attention_op(cfg: ModelConfig, layer: int, t: int, ctx: int, b: int, decode: bool) -> OpCount:
    """Attention of `t` queries (the last of `ctx` positions) over the context."""
    h, hd, q, kv = cfg.num_heads, cfg.head_dim, cfg.q_size, cfg.kv_size
    window = cfg.sliding_windows[layer]
    pairs = attended_pairs(t, ctx, window)
    mask = "causal" if window is None else f"causal, window {window}"
    return OpCount(
        "attention",
        "attention",
        {"q": (h, t, hd), "k": (cfg.num_kv_heads, ctx, hd), "v": (cfg.num_kv_heads, ctx, hd)},
        {"o": (t, q)},
        flops=4 * h * hd * pairs,
        bytes_read=(t * q + 2 * ctx * kv) * b,
        bytes_written=t * q * b,
        # Decode reads the context from the workspace (K/V of earlier steps); prefill
        # without a cached prefix reads only the K/V it just computed.
        kv_bytes_read=2 * ctx * kv * b if decode else 0,
        note=f"scores [{h},{t},{ctx}] {mask}, {pairs} pairs/head",
    )


def _mlp_op(cfg: ModelConfig, t: int, b: int) -> OpCount:
    """`Projections.mlp_residual`: ``x + down(silu(gate(h)) * up(h))`` in one call."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    silu_mul = OpCount(
        "silu_mul",
        "elementwise",
        {"gate": (t, f), "up": (t, f)},
        {"a": (t, f)},
        flops=SILU_MUL_FLOPS * t * f,
        bytes_read=2 * t * f * b,
        bytes_written=t * f * b,
    )
    parts = [
        _matmul_op("gate_up_proj", "h", "gate_up", t, d, 2 * f, b),
        silu_mul,
        _matmul_op("down_proj", "a", "y", t, f, d, b),
        _residual_op("ffn_residual", t, d, b),
    ]
    return fused("mlp_residual", {"h": (t, d), "x": (t, d)}, {"x": (t, d)}, parts)


def layer_ops(
    cfg: ModelConfig,
    layer: int,
    t: int,
    ctx: int,
    b: int,
    decode: bool,
    rows: int | None = None,
    workspace: bool = True,
) -> list[OpCount]:
    """The calls of one decoder layer, in `LlamaModel._layer` order, for `t` new tokens.

    `ctx` is the context attention sees (new tokens included); `b` is bytes per element.
    Prefill is counted without a cached prefix (`trace` never reuses one), so ``ctx == t``.
    Decode appends the new K/V to the decode workspace too (`kv_append`) and attention reads
    the whole context from it (`workspace`; False: the kernel reads the pages in place).
    `rows`: how many tokens go on past the K/V write (all `t` unless given: a prefill step's
    last layer carries on only the rows that give logits, the last ones).
    """
    d, h, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qk = cfg.q_size + cfg.kv_size
    t_in, t = t, t if rows is None else rows  # t from here on: rows past the K/V write
    rotary = OpCount(
        "rotary",
        "elementwise",
        {"qk": (t_in, h + hkv, hd), "cos": (t_in, hd), "sin": (t_in, hd)},
        {"qk": (t_in, h + hkv, hd)},
        flops=ROTARY_FLOPS * t_in * qk,
        bytes_read=(t_in * qk + 2 * t_in * hd) * b,
        bytes_written=t_in * qk * b,
        note="q and k heads in one pass",
    )
    o_parts = [
        _matmul_op("o_proj", "o", "y", t, cfg.q_size, d, b),
        _residual_op("attn_residual", t, d, b),
    ]
    kv_write, *kv_append = _kv_ops(cfg, t_in, b, decode, workspace)
    rope_kv = fused(
        "rope_kv",
        {"qk": (t_in, h + hkv, hd), "v": (t_in, hkv, hd), "cos": (t_in, hd), "sin": (t_in, hd)},
        {"qk": (t_in, h + hkv, hd), "cache": (2, t_in, hkv, hd)},
        [rotary, kv_write],
    )
    return [
        _norm_op("input_norm", t_in, d, b, "x", "h"),
        _qkv_op(cfg, t_in, b),
        rope_kv,
        *kv_append,
        _attention_op(cfg, layer, t, ctx, b, decode),
        fused("o_residual", {"o": (t, cfg.q_size), "x": (t, d)}, {"x": (t, d)}, o_parts),
        _norm_op("post_norm", t, d, b, "x", "h"),
        _mlp_op(cfg, t, b),
    ]


def embed_ops(cfg: ModelConfig, t: int, b: int) -> list[OpCount]:
    """Embedding lookup: the `t` rows of the table are weights read, ``x [T, d]`` written."""
    d = cfg.hidden_size
    return [
        OpCount(
            "embed",
            "memory",
            {"ids": (t,), "E": (cfg.vocab_size, d)},
            {"x": (t, d)},
            flops=0,
            bytes_read=t * d * b,
            bytes_written=t * d * b,
            weight_bytes=t * d * b,
        )
    ]


def head_ops(cfg: ModelConfig, n: int, b: int) -> list[OpCount]:
    """Final norm and lm_head on the `n` rows that produce logits."""
    d = cfg.hidden_size
    return [
        _norm_op("final_norm", n, d, b, "x", "h"),
        _matmul_op("lm_head", "h", "logits", n, d, cfg.vocab_size, b),
    ]
