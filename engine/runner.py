"""Turns a scheduled step into tensors, runs the model, and returns the logits that matter.

The runner reads block tables from the block manager and writes nothing to it; the engine
applies the step's results.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

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

    def prefill(
        self, chunks: Sequence[PrefillChunk], layer_hook: LayerHook | None = None
    ) -> torch.Tensor:
        """Run one packed prefill step; logits [n, V] for chunks that complete their prompt.
        Chunks of a request that wants prompt logprobs also leave the hidden states of each
        of their positions in `prompt_hidden` (request id -> (first position, [k, d])),
        which the engine reads right after this step."""
        ids, positions, slots, segments, logit_rows = [], [], [], [], []
        hidden_rows: list[int] = []
        hidden_of: list[tuple[str, int, int]] = []  # (request, first position, offset)
        q_start = 0
        for c in chunks:
            pos = torch.arange(c.start, c.end)
            ids.append(torch.tensor(c.request.all_token_ids[c.start : c.end], dtype=torch.long))
            positions.append(pos)
            slots.append(self._slots(c.request.request_id, pos))
            context = None
            if c.start:  # the chunk attends to earlier positions: read them from the pages
                table = self.blocks.block_table(c.request.request_id)
                context = torch.tensor(
                    table[: ceil_div(c.end, self.block_size)], dtype=torch.long, device=self.device
                )
            segments.append(PrefillSegment(q_start, c.end - c.start, c.end, context))
            if c.request.wants_prompt_logprobs:
                hidden_of.append((c.request.request_id, c.start, len(hidden_rows)))
                hidden_rows.extend(range(q_start, q_start + c.end - c.start))
            q_start += c.end - c.start
            if c.completes_prompt:
                logit_rows.append(q_start - 1)
        meta = AttentionMetadata(
            positions=torch.cat(positions).to(self.device),
            slot_mapping=torch.cat(slots).to(self.device),
            prefill=segments,
            logit_rows=logit_rows,
        )
        args = (
            torch.cat(ids).to(self.device),
            meta,
            self.cache,
            torch.tensor(logit_rows, dtype=torch.long, device=self.device),
        )
        if not hidden_rows:  # `forward` itself: what `pdserve trace` times
            self.prompt_hidden = {}
            return self.model.forward(*args, layer_hook)
        logits, hidden = self.model.forward_with_hidden(*args, hidden_rows, layer_hook)
        bounds = [o for _, _, o in hidden_of] + [len(hidden_rows)]
        self.prompt_hidden = {
            rid: (start, hidden[bounds[j] : bounds[j + 1]])
            for j, (rid, start, _) in enumerate(hidden_of)
        }
        return logits

    def decode(self, requests: Sequence[Request]) -> torch.Tensor:
        """One token per request; logits [B, V] in the order of `requests`.

        Per-request work is plain Python on ints (no tensor ops in the loop): the inputs
        become the per-request row [id, position, slot, length] and, when the decode
        workspace cannot hold the batch, the block tables for attention to gather from.
        With the workspace the batch runs in its row order and the logits are put back.
        """
        bs = self.block_size
        tables = [self.blocks.block_table(r.request_id) for r in requests]
        order = None
        if self.workspace is not None:
            limit = self.max_model_len or sys.maxsize
            order = self.workspace.prepare(
                [(r.request_id, r.num_preemptions) for r in requests],
                [r.num_tokens for r in requests],
                tables,
                [min(len(r.prompt_token_ids) + r.params.max_tokens, limit) for r in requests],
            )
        run = range(len(requests)) if order is None else order
        rows = []
        for i in run:
            r = requests[i]
            n = r.num_tokens
            pos = n - 1
            last = (r.output_token_ids or r.prompt_token_ids)[-1]
            rows.append((last, pos, tables[i][pos // bs] * bs + pos % bs, n))
        cols = torch.tensor(list(zip(*rows, strict=True)), dtype=torch.long)  # [4, B]
        ids, positions, slots, lens = cols.to(self.device)
        meta = AttentionMetadata(positions=positions, slot_mapping=slots, decode_ctx_lens=lens)
        if order is None:
            width = ceil_div(max(r.num_tokens for r in requests), bs)  # blocks of the longest
            padded = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=self.device)
        else:
            meta.decode_workspace = self.workspace
        try:
            logits = self.model.forward(
                ids, meta, self.cache, torch.arange(len(requests), device=self.device)
            )
        except BaseException:
            if self.workspace is not None:
                self.workspace.reset()  # rows may be half-written
            raise
        if order is None or order == list(range(len(order))):
            return logits
        back = torch.empty_like(logits)
        back[torch.tensor(order, device=self.device)] = logits  # row r was requests[order[r]]
        return back
