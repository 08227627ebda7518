"""Turns a scheduled step into tensors, runs the model, and returns the logits that matter.

The runner reads block tables from the block manager and writes nothing to it; the engine
applies the step's results.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import ceil_div
from engine.decode_workspace import DecodeWorkspace
from engine.kv_cache import PagedKVCache
from engine.model import AttentionMetadata, LayerHook, LlamaModel, PrefillSegment
from engine.request import Request
from engine.scheduler import PrefillChunk


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        blocks: BlockManager,
        decode_workspace_bytes: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        """`decode_workspace_bytes`: cap of the `DecodeWorkspace` (0: gather pages per step).
        `max_model_len`: the context limit, to size the workspace for where requests end."""
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.device = model.device
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.workspace = (
            DecodeWorkspace(cache, decode_workspace_bytes) if decode_workspace_bytes else None
        )
        self.prompt_hidden: dict[str, tuple[int, torch.Tensor]] = {}  # the last prefill's

    def _slots(self, request_id: str, positions: torch.Tensor) -> torch.Tensor:
        """Cache slot of each position: block_table[pos // bs] * bs + pos % bs."""
        table = torch.tensor(self.blocks.block_table(request_id), dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def step(
        self,
        chunks: Sequence[PrefillChunk],
        decode: Sequence[Request],
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Run one packed step: the prompt chunks' tokens, then one token per decode request
        (a mixed step when both are given). Logits [n, V]: a row per chunk that completes
        its prompt, in order, then a row per decode request that samples (not one that is
        `replaying`), in the order of `decode`.

        Chunks of a request that wants prompt logprobs also leave the hidden states of each
        of their positions in `prompt_hidden` (request id -> (first position, [k, d])),
        which the engine reads right after this step.
        """
        p = self._prefill_inputs(chunks)
        d = self._decode_inputs(decode)
        # Every decode row gives logits (the model keeps decode rows whole); those of rows
        # that replay a generated token are dropped below.
        logit_rows = p.logit_rows + list(range(p.num_tokens, p.num_tokens + len(decode)))
        meta = AttentionMetadata(
            positions=torch.cat(p.positions + d.positions).to(self.device),
            slot_mapping=torch.cat(p.slots + d.slots).to(self.device),
            prefill=p.segments or None,
            logit_rows=logit_rows,
            decode_ctx_lens=d.lens,
            decode_block_tables=d.block_tables,
            decode_workspace=self.workspace if d.order is not None else None,
        )
        args = (
            torch.cat(p.ids + d.ids).to(self.device),
            meta,
            self.cache,
            torch.tensor(logit_rows, dtype=torch.long, device=self.device),
        )
        try:
            if not p.hidden_rows:  # `forward` itself: what `pdserve trace` times
                self.prompt_hidden = {}
                logits = self.model.forward(*args, layer_hook)
            else:
                logits, hidden = self.model.forward_with_hidden(*args, p.hidden_rows, layer_hook)
                bounds = [o for _, _, o in p.hidden_of] + [len(p.hidden_rows)]
                self.prompt_hidden = {
                    rid: (start, hidden[bounds[j] : bounds[j + 1]])
                    for j, (rid, start, _) in enumerate(p.hidden_of)
                }
        except BaseException:
            if d.order is not None and self.workspace is not None:
                self.workspace.reset()  # rows may be half-written
            raise
        # Decode row r ran decode[ran[r]]: the sampling rows, in the order of `decode`.
        ran = list(range(len(decode))) if d.order is None else d.order
        first = len(p.logit_rows)
        rows = sorted(
            (i, first + r) for r, i in enumerate(ran) if not decode[i].replaying
        )  # (index into `decode`, logits row)
        wanted = list(range(first)) + [row for _, row in rows]
        if wanted == list(range(logits.shape[0])):
            return logits
        return logits[torch.tensor(wanted, dtype=torch.long, device=self.device)]

    def _prefill_inputs(self, chunks: Sequence[PrefillChunk]) -> _PrefillInputs:
        """The chunks' tokens packed back to back (tokens 0 .. num_tokens-1 of the step)."""
        p = _PrefillInputs()
        for c in chunks:
            pos = torch.arange(c.start, c.end)
            p.ids.append(torch.tensor(c.request.all_token_ids[c.start : c.end], dtype=torch.long))
            p.positions.append(pos)
            p.slots.append(self._slots(c.request.request_id, pos))
            table = self.blocks.block_table(c.request.request_id)
            blocks = torch.tensor(
                table[: ceil_div(c.end, self.block_size)], dtype=torch.long, device=self.device
            )
            # a chunk after earlier positions reads them from the pages (`context_blocks`)
            context = blocks if c.start else None
            q_start = p.num_tokens
            p.segments.append(PrefillSegment(q_start, c.end - c.start, c.end, context, blocks))
            if c.request.wants_prompt_logprobs:
                p.hidden_of.append((c.request.request_id, c.start, len(p.hidden_rows)))
                p.hidden_rows.extend(range(q_start, q_start + c.end - c.start))
            p.num_tokens += c.end - c.start
            if c.completes_prompt:
                p.logit_rows.append(p.num_tokens - 1)
        return p

    def _decode_inputs(self, requests: Sequence[Request]) -> _DecodeInputs:
        """One token per request, in the decode workspace's row order when it holds the
        batch (`order[row]` = index into `requests`), else in the given order with the block
        tables for attention to gather from.

        A request's row feeds its token at `num_computed_tokens`: its last one, or (while it is
        `replaying`) an earlier one it generated before a preemption. Per-request work is plain
        Python on ints (no tensor ops in the loop): the inputs become the per-request row
        [id, position, slot, length].
        """
        if not requests:
            return _DecodeInputs()
        bs = self.block_size
        tables = [self.blocks.block_table(r.request_id) for r in requests]
        order = None
        if self.workspace is not None and not self.model.kernels.decode_reads_pages:
            limit = self.max_model_len or sys.maxsize
            order = self.workspace.prepare(
                [(r.request_id, r.num_preemptions) for r in requests],
                [r.num_computed_tokens + 1 for r in requests],
                tables,
                [min(len(r.prompt_token_ids) + r.params.max_tokens, limit) for r in requests],
            )
        rows = []
        for i in range(len(requests)) if order is None else order:
            r = requests[i]
            pos = r.num_computed_tokens
            rows.append((r.token_at(pos), pos, tables[i][pos // bs] * bs + pos % bs, pos + 1))
        ids, positions, slots, lens = torch.tensor(
            list(zip(*rows, strict=True)), dtype=torch.long
        )  # [4, B]
        d = _DecodeInputs([ids], [positions], [slots], lens.to(self.device), order=order)
        if order is None:
            width = ceil_div(max(r.num_computed_tokens + 1 for r in requests), bs)  # the longest
            padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
            d.block_tables = torch.tensor(padded, dtype=torch.long, device=self.device)
        return d


@dataclass
class _PrefillInputs:
    """A step's prompt chunks as tensors (`ModelRunner._prefill_inputs`)."""

    ids: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    segments: list[PrefillSegment] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # rows of chunks completing a prompt
    hidden_rows: list[int] = field(default_factory=list)  # rows whose hidden states are kept
    hidden_of: list[tuple[str, int, int]] = field(default_factory=list)  # (id, pos, offset)
    num_tokens: int = 0


@dataclass
class _DecodeInputs:
    """A step's decode rows as tensors (`ModelRunner._decode_inputs`)."""

    ids: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    lens: torch.Tensor | None = None  # [B] context length of each row, this token included
    order: list[int] | None = None  # workspace row -> index into the requests; None: gather
    block_tables: torch.Tensor | None = None  # [B, max_blocks] when gathering
