"""The model's matmuls: `Projections` (eager PyTorch, any device and dtype) and
`OneDnnProjections` (the CPU fast path: weights packed once, elementwise tails fused).

Both own the residual update of Llama's block (`o_residual`, `mlp_residual`: the sublayer's
output added to the residual stream ``x``); Gemma 3's block norms each sublayer's output
before adding it, so it takes the plain outputs (`o`, `mlp`). The MLP's gate activation is
SiLU (fused into oneDNN's matmul as its "swish" post-op) or GELU with the tanh approximation
(`ModelConfig.hidden_act`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.cpu import has_bf16_hardware, onednn_bf16_supported
from engine.model_weights import ModelWeights


def activation(gate: torch.Tensor, act: str) -> torch.Tensor:
    """The gate's activation, in place where it can be: silu | gelu_tanh."""
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


class Projections:
    """The model's matmuls in eager PyTorch: `F.linear` plus separate elementwise ops.

    The reference path (any device, any dtype). `OneDnnProjections` is the CPU fast path;
    `engine.kernels.select` measures which one serves. Both own the residual update: they
    take the residual stream ``x`` and return it with the sublayer's output added.

    `row_floors` (kind -> rows; kinds: `KINDS`) makes them batch-invariant: a GEMM's
    blocking, and so the order of a row's reductions, may change with the number of rows
    (oneDNN switches kernels as M grows), so the same row can round differently alone and
    in a batch. From some row count on it no longer changes; a call with fewer rows is
    padded with zero rows up to that floor (`engine.kernels.select` finds it per kind on
    the serving CPU), so every row takes the large-M kernel's order.
    """

    KINDS = ("qkv", "o_residual", "mlp_residual", "o", "mlp", "lm_head")
    # its products read the plain matrices of `ModelWeights` (False: packed copies of its own,
    # and the engine frees the plain ones: `ModelWeights.release_matrices`)
    reads_plain: ClassVar[bool] = True

    def __init__(
        self, weights: ModelWeights, act: str = "silu", row_floors: dict[str, int] | None = None
    ) -> None:
        self.w = weights
        self.act = act
        self.row_floors = dict(row_floors or {})

    def _floored(
        self, kind: str, fn: Callable[..., torch.Tensor], *xs: torch.Tensor
    ) -> torch.Tensor:
        """fn(*xs), each x [T, *], computed on at least `row_floors[kind]` rows."""
        t, floor = xs[0].shape[0], self.row_floors.get(kind, 1)
        if t >= floor:
            return fn(*xs)
        padded = (torch.cat((x, x.new_zeros(floor - t, *x.shape[1:]))) for x in xs)
        return fn(*padded)[:t]

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [T, q + 2kv]."""
        return self._floored("qkv", lambda a: self._qkv(i, a), h)

    def o_residual(self, i: int, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + o @ Wo^T; o [T, q], x [T, d] (x may be updated in place)."""
        return self._floored("o_residual", lambda a, b: self._o_residual(i, a, b), o, x)

    def mlp_residual(self, i: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + down(act(gate(h)) * up(h)); h, x [T, d]."""
        return self._floored("mlp_residual", lambda a, b: self._mlp_residual(i, a, b), h, x)

    def o(self, i: int, o: torch.Tensor) -> torch.Tensor:
        """o @ Wo^T alone (Gemma 3 norms it before the residual add)."""
        return self._floored("o", lambda a: self._o(i, a), o)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """down(act(gate(h)) * up(h)) alone."""
        return self._floored("mlp", lambda a: self._mlp(i, a), h)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, V] in the model dtype."""
        return self._floored("lm_head", self._lm_head, x)

    # ---- the products themselves (`OneDnnProjections` overrides these) --------------------
    def _qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        lw = self.w.layers[i]
        return F.linear(h, lw.qkv, lw.qkv_bias)

    def _o_residual(self, i: int, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x.addmm_(o, self.w.layers[i].o.t())  # the GEMM accumulates into x

    def _mlp_residual(self, i: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x.addmm_(self._gated(i, h), self.w.layers[i].down.t())

    def _gated(self, i: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = torch.mm(h, self.w.layers[i].gate_up.t()).chunk(2, dim=-1)  # [T, ffn]
        return activation(gate, self.act).mul_(up)

    def _o(self, i: int, o: torch.Tensor) -> torch.Tensor:
        return F.linear(o, self.w.layers[i].o)

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._gated(i, h), self.w.layers[i].down)

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
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
    copies would be one more copy of every matrix: an engine that serves with them frees
    the plain ones (`reads_plain`).
    """

    reads_plain = False

    def __init__(
        self, weights: ModelWeights, act: str = "silu", row_floors: dict[str, int] | None = None
    ) -> None:
        super().__init__(weights, act, row_floors)
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

    def _qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        bias = self.w.layers[i].qkv_bias
        return torch.ops.mkldnn._linear_pointwise(h, self.packed[i].qkv, bias, "none", [], "")

    def _o_residual(self, i: int, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(o, x, self.packed[i].o, None, "add")

    def _mlp_residual(self, i: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        return linear.binary(self._gated(i, h), x, self.packed[i].down, None, "add")

    def _gated(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """act(h @ Wg^T) * (h @ Wu^T), [T, ffn]: SiLU as the gate's post-op, GELU after it."""
        p = self.packed[i]
        linear = torch.ops.mkldnn._linear_pointwise
        if self.act == "silu":
            gate = linear(h, p.gate, None, "swish", [], "")
        else:
            gate = activation(linear(h, p.gate, None, "none", [], ""), self.act)
        return linear.binary(h, gate, p.up, None, "mul")  # (h @ Wu^T) * gate

    def _o(self, i: int, o: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(o, self.packed[i].o, None, "none", [], "")

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        return linear(self._gated(i, h), self.packed[i].down, None, "none", [], "")

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.lm_head_packed, None, "none", [], "")


@dataclass
class _PanelLayer:
    qkv: torch.Tensor  # brgemm panels (`pdserve_kernels.pack_linear_weight`)
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class BrgemmProjections(Projections):
    """bf16 matmuls on pdserve's own brgemm kernel (`engine/kernels/csrc/gemm.cpp`).

    Why: it is batch-invariant by construction (every output tile is one brgemm call of a
    fixed shape over the whole K, and threads split tiles, never K), where oneDNN's matmul
    changes a row's reduction order with the number of rows around it. Weights are packed
    into brgemm's VNNI panels once at load; residual adds and biases ride in the store of
    the float32 accumulator, so each output is rounded once.
    """

    reads_plain = False

    def __init__(
        self, weights: ModelWeights, act: str = "silu", row_floors: dict[str, int] | None = None
    ) -> None:
        super().__init__(weights, act, row_floors)
        from engine import native

        ext = native.load()
        assert ext is not None, f"pdserve kernels: {native.why_not()}"
        self.ext = ext
        pack = ext.pack_linear_weight
        self.panels = [
            _PanelLayer(pack(lw.qkv), pack(lw.o), pack(lw.gate_up), pack(lw.down))
            for lw in weights.layers
        ]
        self.head = pack(weights.lm_head)

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        from engine import native

        return (
            device.type == "cpu"
            and dtype == torch.bfloat16
            and has_bf16_hardware()
            and native.brgemm_bf16()
        )

    def _linear(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        n: int,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out: torch.Tensor = self.ext.packed_linear(x.contiguous(), panels, n, bias, residual)
        return out

    def _qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        lw = self.w.layers[i]
        return self._linear(h, self.panels[i].qkv, lw.qkv.shape[0], lw.qkv_bias)

    def _o_residual(self, i: int, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._linear(o, self.panels[i].o, x.shape[1], None, x)

    def _mlp_residual(self, i: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self._gated(i, h), self.panels[i].down, x.shape[1], None, x)

    def _gated(self, i: int, h: torch.Tensor) -> torch.Tensor:
        n = self.w.layers[i].gate_up.shape[0]
        gate, up = self._linear(h, self.panels[i].gate_up, n).chunk(2, dim=-1)  # [T, ffn]
        return activation(gate, self.act).mul_(up)

    def _o(self, i: int, o: torch.Tensor) -> torch.Tensor:
        return self._linear(o, self.panels[i].o, self.w.layers[i].o.shape[0])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self._linear(self._gated(i, h), self.panels[i].down, self.w.layers[i].down.shape[0])

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.head, self.w.lm_head.shape[0])
