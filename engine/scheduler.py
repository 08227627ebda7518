"""Which requests run in the next step, and how much of each.

Under `mixed_steps` (the default, vLLM v1's policy) every step takes one token for every
running request first, then chunks of waiting prompts in what is left of the token budget
(`max_num_batched_tokens`): running streams ride along prompt passes instead of waiting
behind them, and a long prompt is cut into chunks so a step stays within the budget. The
model runs such a step as one packed batch (`engine.model`, "mixed step"); the decode rows
keep reading their context from the decode workspace.

Without it a step is either a **prefill step** (prompt chunks, packed up to the budget) or a
**decode step** (one token for every running request), prefill first whenever anything waits
and fits (vLLM v0's policy): running streams stall behind every prompt pass.

Admission allocates every block of the prompt at once (reusing its cached prefix), so a
chunked prompt never finds the pool empty halfway. When decode needs a block and the pool is
empty, the most recently admitted running request is preempted by recompute: its blocks are
freed and it goes back to the front of the queue. Its prompt is computed again by a prompt
pass and, with batch-invariant kernels, its output so far by decode rows that sample nothing
(`Request.replaying`), one a step, as they were computed the first time (else by the same
prompt pass).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int  # first token position computed in this step
    end: int  # one past the last; == request.num_tokens means the prompt completes

    @property
    def completes_prompt(self) -> bool:
        """Its last row's logits give the next token."""
        return self.end == self.request.num_tokens

    @property
    def completes_prefill(self) -> bool:
        """The sequence joins the decode batch after this step (sampling if it
        `completes_prompt`, else replaying its generated tokens: `Request.prefill_end`)."""
        return self.end == self.request.prefill_end


class BatchShape(NamedTuple):
    chunks: tuple[tuple[int, int], ...]  # (new tokens, cached tokens before them) per chunk
    decode: tuple[int, ...]  # cached tokens per decode row


NO_BATCH = BatchShape((), ())


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work: prompt chunks, decode rows, or both (a mixed step)."""

    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    def batch_shape(self) -> BatchShape:
        """What the step's cost depends on (`pdserve.plan.stepmodel`), read before it runs:
        (new tokens, tokens already cached before them) per prompt chunk, and the tokens
        already cached per decode row."""
        return BatchShape(
            tuple((c.end - c.start, c.start) for c in self.prefill),
            tuple(r.num_computed_tokens for r in self.decode),
        )

    @property
    def phase(self) -> Literal["prefill", "decode", "mixed"] | None:
        if self.prefill and self.decode:
            return "mixed"
        return "prefill" if self.prefill else "decode" if self.decode else None


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose K/V is already in the cache (a decode worker's transfer)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> SchedulerOutput:
        if self.cfg.mixed_steps:
            # Running requests first, one token each (their slots reserved before any prompt
            # is admitted, so admission only takes blocks decode does not need); prompt
            # chunks fill what is left of the budget.
            preempted = self._reserve_decode_slots()
            decode = tuple(self.running)
            chunks = self._schedule_prefill(self.cfg.max_num_batched_tokens - len(decode))
            return SchedulerOutput(tuple(chunks), decode, tuple(preempted))
        chunks = self._schedule_prefill(self.cfg.max_num_batched_tokens)
        if chunks:
            return SchedulerOutput(prefill=tuple(chunks))
        preempted = self._reserve_decode_slots()
        return SchedulerOutput(decode=tuple(self.running), preempted=tuple(preempted))

    def _schedule_prefill(self, budget: int) -> list[PrefillChunk]:
        """Chunks of waiting prompts, in order, up to `budget` tokens in all."""
        chunks: list[PrefillChunk] = []
        for req in list(self.waiting):
            if budget <= 0:
                break
            if not self.blocks.has(req.request_id) and not self._admit(req):
                break  # FIFO: later requests wait behind the one that does not fit
            start = req.num_computed_tokens
            end = min(req.prefill_end, start + budget)
            chunks.append(PrefillChunk(req, start, end))
            budget -= end - start
        return chunks

    def _admit(self, req: Request) -> bool:
        if len(self.running) + self._num_prefilling() >= self.cfg.max_num_seqs:
            return False
        # Leave at least one token to compute: its logits give the next token (or, after a
        # preemption, the pass that puts the sequence back in the batch has a row). A prompt
        # whose logprobs are wanted is computed whole (a cached block has no hidden states).
        usable = req.block_hashes[: (req.prefill_end - 1) // self.blocks.block_size]
        if req.wants_prompt_logprobs:
            usable = []
        try:
            alloc = self.blocks.allocate(req.request_id, usable, req.num_tokens)
        except NoFreeBlocksError:
            return False
        req.num_computed_tokens = alloc.num_cached_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = alloc.num_cached_tokens
        return True

    def _num_prefilling(self) -> int:
        return sum(1 for r in self.waiting if self.blocks.has(r.request_id))

    def _reserve_decode_slots(self) -> list[Request]:
        """Make sure every running request has a slot for its next token."""
        preempted: list[Request] = []
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted below for an earlier request
            while True:
                try:
                    self.blocks.grow(req.request_id, req.num_tokens)
                    break
                except NoFreeBlocksError:
                    victim = self.running[-1]
                    self.preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
        return preempted

    def join(self, seq: Request) -> None:
        """A sequence with its first token (and no stop), or one whose prompt was recomputed
        after a preemption, joins the running batch; one that holds no blocks (a fork that
        got none) waits to recompute instead."""
        self.remove(seq)
        if self.blocks.has(seq.request_id):
            self.add_running(seq)
        else:
            self.requeue(seq)

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks and queue it to recompute (what an empty pool
        does to the most recently admitted one)."""
        self.running.remove(req)
        self.blocks.free(req.request_id)
        self.requeue(req)

    def requeue(self, req: Request) -> None:
        """Put a request holding no blocks back at the front of the queue, to recompute its
        K/V (a preempted one, or a choice forked when no block was free for its copy)."""
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
