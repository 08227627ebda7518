"""The engine loop: schedule, prepare, forward, postprocess.

`LLMEngine` is what both worker pools and the colocated baseline run. It knows nothing about
Ray, gRPC or where K/V comes from. `step()` returns what it did (`StepResult`).

Every seam between the engine and KV transfer, in one list (the workers and
`kv_transfer` use nothing else of it):

- `add_request(..., prefill_only=True)`: a prompt pass that finishes after its first token
  and keeps its blocks for the transfer; `release(request_id)` lets them go once the decode
  side acknowledged (they stay in the prefix cache).
- `layer_hook(step, layer)`: called on the engine thread once layer `layer`'s K/V of every
  prefill chunk of `step` (a `SchedulerOutput`) is in the cache; the prefill worker pushes
  each finished layer of each prompt that completes in that step. The one observer a worker
  registers; decode steps do not call it.
- `blocks.block_table(request_id)` and `cache` (`PagedKVCache`): the source pages a sender
  reads and the destination pages a receiver writes, by block id.
- `make_request` (its prefix hashes let a receiver share cached blocks), then, once a
  transport filled the reserved blocks, `add_prefilled(request, first_token_ids)`: a decode
  worker's request joins the running batch without recomputing its prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from engine import cpu
from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.config import (
    CacheConfig,
    ConfigError,
    ModelConfig,
    SchedulerConfig,
    format_bytes,
    kv_bytes_per_block,
)
from engine.kernels.select import Selection
from engine.kernels.select import select as select_kernels
from engine.kv_cache import DTYPES, PagedKVCache
from engine.model import LlamaModel
from engine.prefix_hash import namespace_seed
from engine.request import (
    CHOICE_SEP,
    FinishReason,
    GrammarRejected,
    Request,
    RequestOutput,
    RequestStatus,
)
from engine.runner import ModelRunner
from engine.sampling import (
    InvalidParameterError,
    SamplingParams,
    TokenLogprob,
    sample,
    skip_draw,
)
from engine.scheduler import NO_BATCH, BatchShape, Scheduler, SchedulerOutput
from engine.structured import GrammarBackend
from engine.tokenizer import Tokenizer
from engine.validation import ContextLengthError, check_request
from engine.weights import load_weights

__all__ = ["ContextLengthError", "EngineConfig", "EngineStats", "LLMEngine"]

log = logging.getLogger(__name__)
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are taken at once


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (float16 -> float32 on CPU)
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    chat_template: str | None = None  # a template file overriding the checkpoint's
    # each op's kernel: auto (measured on this machine, cached), reference (torch's own) or
    # OP=NAME,... (engine.kernels.select.parse_spec)
    kernels: str = "auto"
    # a request's greedy tokens independent of its batch, chunks and cached prefix
    # (engine.kernels.select: only kernels that pass the invariance probe)
    batch_invariant: bool = True
    # keep the plain weight matrices when the chosen projections run on packed copies (a
    # benchmark that switches kernels at run time needs them; a server frees them)
    keep_plain_weights: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


def resolve_dtype(name: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """The compute dtype for `--dtype name` on `device`.

    `auto` takes the checkpoint's dtype, except that on a CPU a 16-bit checkpoint computes in
    bfloat16 only where bf16 runs in hardware (`engine.cpu.has_bf16_hardware`) and in
    float32 elsewhere. float16 is never used on a CPU (float32 instead).
    """
    if name != "auto" and name not in DTYPES:
        raise ConfigError(f"dtype={name!r}; expected auto, float32, bfloat16 or float16")
    on_cpu = not device.startswith("cuda")
    chosen = checkpoint_dtype if name == "auto" else name
    if on_cpu and name == "auto" and chosen in ("bfloat16", "float16"):
        chosen = "bfloat16" if cpu.has_bf16_hardware() else "float32"
        if chosen != checkpoint_dtype:  # vLLM warns when it casts, too
            log.warning(
                "dtype auto: the %s checkpoint computes in %s on this CPU (%s)",
                checkpoint_dtype,
                chosen,
                cpu.describe(),
            )
    if chosen == "float16" and on_cpu:
        chosen = "float32"
    return DTYPES[chosen]


def size_kv_cache(
    cache: CacheConfig, model: ModelConfig, dtype: torch.dtype, device: str
) -> CacheConfig:
    """`cache` with `num_blocks` chosen from memory when a memory setting is given (else as
    is): `kv_cache_memory` bytes, or on CUDA what `gpu_memory_utilization` leaves of device
    memory once the weights are loaded (call it after loading them)."""
    if not cache.sized_from_memory:
        return cache
    per_block = kv_bytes_per_block(model, cache.block_size, dtype.itemsize)
    if cache.kv_cache_memory is not None:
        return cache.with_memory(cache.kv_cache_memory, per_block)
    assert cache.gpu_memory_utilization is not None
    budget = device_kv_budget(device, cache.gpu_memory_utilization, cache.decode_workspace_mib)
    return cache.with_memory(budget, per_block)


def device_kv_budget(device: str, utilization: float, workspace_mib: int) -> int:
    """Bytes for K/V on a CUDA device: free memory now, minus the (1 - utilization) share of
    the device kept free, minus the decode workspace's cap (allocated later)."""
    if not device.startswith("cuda"):
        raise ConfigError(
            f"gpu_memory_utilization needs a CUDA device (model.device={device!r}); "
            "on a CPU size the KV cache with kv_cache_memory (--kv-cache-memory)"
        )
    free, total = torch.cuda.mem_get_info(torch.device(device))
    budget = int(free - (1.0 - utilization) * total) - (workspace_mib << 20)
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization={utilization}: {format_bytes(free)} of "
            f"{format_bytes(total)} free after the weights leaves no room for the KV cache"
        )
    return budget


StepLayerHook = Callable[[SchedulerOutput, int], None]


@dataclass(frozen=True)
class StepResult:
    """What one `LLMEngine.step` did."""

    outputs: list[RequestOutput]  # one per request that got a token (or finished)
    # "mixed": prompt chunks and decode rows in one forward. None: nothing fit (e.g. waiting
    # on blocks).
    phase: Literal["prefill", "decode", "mixed"] | None
    num_tokens: int  # tokens the forward ran: prompt-chunk tokens plus one per decode row
    forward_s: float  # forward and postprocess wall time
    shape: BatchShape = NO_BATCH  # what ran (`SchedulerOutput.batch_shape`)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load, read on the engine thread (`LLMEngine.stats`)."""

    num_free_blocks: int  # free plus cached-but-evictable blocks
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens of waiting requests not yet computed
    num_preemptions_total: int
    kv_bytes_per_block: int  # K + V of one block over all layers (what a transfer moves)
    decode_workspace_bytes: int | None  # None: the engine runs without a decode workspace
    decode_workspace_fallbacks_total: int


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        model: LlamaModel,
        tokenizer: Tokenizer | None,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.max_model_len = scheduler_config.context_len(model_config)
        self.fingerprint = model.w.fingerprint or model_config.fingerprint()
        self.cache = PagedKVCache(
            model_config, cache_config, model.dtype, model.device, self.fingerprint
        )
        self.blocks = BlockManager(cache_config.num_blocks, cache_config.block_size)
        self.scheduler = Scheduler(scheduler_config, self.blocks)
        self.runner = ModelRunner(
            model,
            self.cache,
            self.blocks,
            cache_config.decode_workspace_mib << 20,
            self.max_model_len,
        )
        self.requests: dict[str, Request] = {}  # by sequence id (`request.choice_id`)
        # how the kernels were chosen (`from_config` sets it; the model holds the choice)
        self.kernel_selection = Selection(model.kernels, "named")
        # n > 1: a request's choices while any of them is unfinished, by the request's id
        self.groups: dict[str, list[Request]] = {}
        self.layer_hook: StepLayerHook | None = None  # the KV seam (module docstring)
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else model_config.eos_token_ids
        # structured outputs (engine.structured); None: no tokenizer, so no grammar
        self.grammars: GrammarBackend | None = (
            tokenizer.grammar_backend(model_config.vocab_size) if tokenizer else None
        )

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> LLMEngine:
        """Load the checkpoint, choose the kernels (`cfg.kernels`), size the KV cache."""
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        mcfg = ModelConfig.from_hf(cfg.model)
        dtype = resolve_dtype(cfg.dtype, mcfg.dtype, cfg.device)
        weights = load_weights(cfg.model, mcfg, dtype, cfg.device)
        cache = size_kv_cache(cfg.cache, mcfg, dtype, cfg.device)  # after the weights
        max_len = cfg.scheduler.context_len(mcfg)
        sched = dataclasses.replace(cfg.scheduler, max_model_len=max_len)
        tokenizer = (
            Tokenizer.from_dir(cfg.model, mcfg, cfg.chat_template)
            if (Path(cfg.model) / "tokenizer.json").exists()
            else None
        )
        try:
            selection = select_kernels(mcfg, weights, cfg.kernels, cfg.batch_invariant)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log.info("%s", selection.line())
        model = LlamaModel(mcfg, weights, max_len, selection.kernels)
        if not model.proj.reads_plain and not cfg.keep_plain_weights:
            weights.release_matrices()  # the projections hold packed copies
        engine = cls(mcfg, model, tokenizer, cache, sched)
        engine.kernel_selection = selection
        return engine

    # ---- requests ------------------------------------------------------------------------
    def validate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, prefill_only: bool = False
    ) -> None:
        """Reject bad input with an error naming the field; nothing is allocated."""
        check_request(
            prompt_token_ids,
            params,
            self.model_config.vocab_size,
            self.max_model_len,
            self.cache_config.block_size,
            self.cache_config.num_blocks,
            prefill_only,
        )

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
        prefill_only: bool = False,
        grammar: Any = None,
    ) -> Request:
        """`grammar`: `params.structured` compiled (`self.grammars.compile`, off this
        thread); when None, a constrained request compiles here, on the engine thread."""
        if request_id in self.requests or request_id in self.groups:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        if CHOICE_SEP in request_id:
            raise InvalidParameterError("request_id", "must not contain control characters")
        self.validate(prompt_token_ids, params, prefill_only)
        matcher = compiled = None
        if params.structured is not None:
            if self.grammars is None:
                raise InvalidParameterError(
                    params.structured.field, "needs a tokenizer (this model has none)"
                )
            compiled = grammar if grammar is not None else self.grammars.compile(params.structured)
            matcher = self.grammars.matcher(compiled)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            hash_seed=namespace_seed(self.fingerprint, cache_salt),
            block_size=self.cache_config.block_size,
            detokenizer=self.tokenizer.detokenizer() if self.tokenizer else None,
            eos_token_ids=self.eos_token_ids,
            prefill_only=prefill_only,
            matcher=matcher,
            grammar=compiled,
            replays=self.kernel_selection.kernels.batch_invariant,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
        prefill_only: bool = False,
        grammar: Any = None,
    ) -> Request:
        req = self.make_request(
            request_id, prompt_token_ids, params, cache_salt, prefill_only, grammar
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def add_prefilled(self, req: Request, first_token_ids: Sequence[int]) -> list[RequestOutput]:
        """Admit a request whose prompt K/V already fills its blocks (see `reserve`), with
        the first token of each of its `params.n` choices (sampled by the prefill side).
        One output per choice; a constrained choice's matcher checks its token here, before
        this engine runs anything for it (never recomputed): GrammarRejected ends them all."""
        assert self.blocks.has(req.request_id), f"{req.request_id}: reserve blocks first"
        if len(first_token_ids) != req.params.n:
            self.blocks.free(req.request_id)
            raise InvalidParameterError(
                "n", f"{len(first_token_ids)} first tokens for {req.params.n} choices"
            )
        if req.params.prompt_logprobs is not None:  # the prefill side computed and sent them:
            req.prompt_logprobs = [None] * len(req.prompt_token_ids)  # none to compute here
        req.num_computed_tokens = len(req.prompt_token_ids)
        self.blocks.commit(req.request_id, req.computed_hashes())
        self.requests[req.request_id] = req
        seqs = [req, *self._fork(req)]
        try:
            for seq, token_id in zip(seqs, first_token_ids, strict=True):
                skip_draw(seq.sampling_state(), self.model_config.vocab_size)
                seq.append_token(token_id, None)
        except GrammarRejected:
            for seq in seqs:
                self._finish(seq, FinishReason.ABORT)
            raise
        outputs = []
        for seq, token_id in zip(seqs, first_token_ids, strict=True):
            reason = seq.check_stop(self.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
            else:
                self.scheduler.join(seq)
            # Same hold-back as the prefill worker applied to this token's text, so the
            # decode side's later deltas continue exactly where the prefill side's ended.
            delta = seq.take_text_delta(final=reason is not None)
            outputs.append(self._output(seq, (token_id,), delta))
        return outputs

    def _fork(self, parent: Request) -> list[Request]:
        """The other choices of a request whose prompt pass just ended (n > 1), each with
        its own detokenizer, matcher and seed. They share the prompt's full blocks; a partly
        filled last block is copied for each, as each writes its next token there. A
        prefill-only request's choices take no blocks (they end with their first token);
        one that finds no block for its copy waits to recompute its tail (a preemption)."""
        n = parent.params.n
        if n == 1:
            return []
        tokenizer, grammars = self.tokenizer, self.grammars
        children = [
            parent.fork(
                i,
                tokenizer.detokenizer() if tokenizer else None,
                grammars.matcher(parent.grammar)
                if grammars is not None and parent.grammar is not None
                else None,
            )
            for i in range(1, n)
        ]
        self.groups[parent.request_id] = [parent, *children]
        for child in children:
            if parent.prefill_only:
                continue
            self.requests[child.request_id] = child
            try:
                copies = self.blocks.fork(
                    parent.request_id, child.request_id, parent.num_computed_tokens
                )
            except NoFreeBlocksError:
                child.num_computed_tokens = 0  # `Scheduler.join` queues it to recompute
                continue
            if copies:
                src, dst = zip(*copies, strict=True)
                self.cache.copy_blocks(list(src), self.cache, list(dst))
        return children

    def _output(
        self,
        seq: Request,
        token_ids: tuple[int, ...],
        delta: str,
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob | None, ...] = (),
    ) -> RequestOutput:
        return RequestOutput(
            seq.group_id,
            token_ids,
            delta,
            seq.is_finished,
            seq.finish_reason,
            logprobs,
            prompt_logprobs,
            seq.index,
            seq.is_finished and seq.group_id not in self.groups,
        )

    def abort(self, request_id: str) -> bool:
        """End a request (every choice of it) here and free its blocks."""
        one = self.requests.get(request_id)
        seqs = self.groups.get(request_id) or ([one] if one is not None else [])
        found = False
        for seq in seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                found = True
        return found

    def release(self, request_id: str) -> None:
        """Free the blocks a request holds outside the scheduler: a prefill-only request's,
        kept for its transfer, or a decode reservation's that its transfer let go."""
        if self.blocks.has(request_id):
            self.blocks.free(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        """Call on the engine thread: it reads the scheduler's queues and the block pool."""
        sched, ws = self.scheduler, self.runner.workspace
        return EngineStats(
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_blocks,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            queued_prefill_tokens=sum(r.prefill_end - r.num_computed_tokens for r in sched.waiting),
            num_preemptions_total=sched.num_preemptions,
            kv_bytes_per_block=self.cache.spec.page_bytes * self.cache.spec.num_layers,
            decode_workspace_bytes=ws.bytes_held if ws is not None else None,
            decode_workspace_fallbacks_total=ws.fallbacks if ws is not None else 0,
        )

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One step: schedule, prepare + forward, postprocess; what it did.

        Not thread-safe: one thread steps the engine and makes every other call on it (a
        worker's engine thread, `engine.loop`)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return StepResult([], None, 0, 0.0)
        shape = out.batch_shape()
        t0 = time.perf_counter()
        hook = self.layer_hook if out.prefill else None
        logits = self.runner.step(
            out.prefill, out.decode, (lambda layer: hook(out, layer)) if hook is not None else None
        )
        # Logits rows: prompts that complete, then every decode row that samples (one that
        # replays a generated token has none: `ModelRunner.step`).
        done = [c.request for c in out.prefill if c.completes_prompt]
        done += [r for r in out.decode if not r.replaying]
        num_tokens = sum(c.end - c.start for c in out.prefill) + len(out.decode)
        step_s = time.perf_counter() - t0
        outputs = self._postprocess(out, done, logits, step_s)
        if not self.scheduler.running and self.runner.workspace is not None:
            self.runner.workspace.reset()  # every row is stale: give the memory back
        return StepResult(outputs, out.phase, num_tokens, step_s, shape)

    def _prompt_logprobs(self) -> None:
        """Each prompt position's logprob (of the prompt's next token) and top-N, from the
        hidden states the last prefill step kept, `PROMPT_LOGPROB_ROWS` positions at a time:
        never a [T, vocab] float32 for a whole long prompt."""
        for rid, (start, hidden) in self.runner.prompt_hidden.items():
            req = self.requests[rid]
            prompt = req.prompt_token_ids
            if start == 0:
                req.prompt_logprobs.append(None)  # nothing precedes the first token
            top_n = req.params.prompt_logprobs or 0
            for lo in range(0, hidden.shape[0], PROMPT_LOGPROB_ROWS):
                rows = hidden[lo : lo + PROMPT_LOGPROB_ROWS]
                first = start + lo + 1  # the prompt position row 0 of this slice predicts
                n = min(rows.shape[0], len(prompt) - first)
                if n <= 0:
                    break  # the last position predicts the first output token (sampled)
                with torch.inference_mode():
                    logits = self.runner.model.proj.lm_head(rows[:n]).float()
                lp = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(
                    prompt[first : first + n], dtype=torch.long, device=lp.device
                )
                chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
                ranks = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
                top_vals, top_ids = lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0])
                for j in range(n):
                    req.prompt_logprobs.append(
                        TokenLogprob(
                            int(targets[j]),
                            float(chosen[j]),
                            tuple(zip(top_ids[j].tolist(), top_vals[j].tolist(), strict=True)),
                            int(ranks[j]),
                        )
                    )
        self.runner.prompt_hidden = {}

    def _postprocess(
        self, out: SchedulerOutput, sampled: list[Request], logits: torch.Tensor, step_s: float
    ) -> list[RequestOutput]:
        if self.runner.prompt_hidden:
            self._prompt_logprobs()
        for c in out.prefill:
            c.request.num_computed_tokens = c.end
            c.request.prefill_s += step_s
            if c.completes_prefill and not c.completes_prompt:
                self.scheduler.join(c.request)  # recomputed up to its output: replays it next
        for r in out.decode:
            r.num_computed_tokens += 1
        for r in [c.request for c in out.prefill] + list(out.decode):
            self.blocks.commit(r.request_id, r.computed_hashes())
        sampled, rows = self._with_choices(sampled)
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens, logprobs = sample(logits, [r.sampling_state() for r in sampled])
        outputs = []
        max_len = self.max_model_len
        for req, tok, lp in zip(sampled, tokens, logprobs, strict=True):
            req.append_token(tok, lp)
            reason = req.check_stop(max_len)
            # A prefill-only request handed on (reason None) holds back like a running one.
            delta = req.take_text_delta(final=reason is not None)
            if req.prefill_only:
                # Done here either way; reason None means "continue on a decode worker".
                self._finish(req, reason, keep_blocks=True)
            elif reason is not None:
                self._finish(req, reason)
            elif req.status is RequestStatus.WAITING:  # its prompt (or its fork) just ended
                self.scheduler.join(req)
            first = len(req.output_token_ids) == 1 and req.index == 0
            wanted = req.params.prompt_logprobs is not None
            plps = tuple(req.prompt_logprobs) if first and wanted else ()
            outputs.append(self._output(req, (tok,), delta, (lp,) if lp else (), plps))
        return outputs

    def _with_choices(self, sampled: list[Request]) -> tuple[list[Request], list[int]]:
        """`sampled` with the other choices of each request whose prompt pass just ended
        (n > 1) after it, and for each sequence the logits row it samples from: a choice's
        first token comes from its request's row (one prompt pass for all n)."""
        seqs: list[Request] = []
        rows: list[int] = []
        for j, req in enumerate(sampled):
            forked = self._fork(req) if req.forks_now else []
            seqs += [req, *forked]
            rows += [j] * (1 + len(forked))
        return seqs, rows

    def _finish(self, req: Request, reason: FinishReason | None, keep_blocks: bool = False) -> None:
        self.scheduler.remove(req)
        req.finish(reason)
        self.requests.pop(req.request_id, None)
        if not keep_blocks and self.blocks.has(req.request_id):
            self.blocks.free(req.request_id)
        group = self.groups.get(req.group_id)
        if group is not None and all(seq.is_finished for seq in group):
            del self.groups[req.group_id]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Request]:
        """Run prompts to completion in one batch (the colocated path); results in order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [
            self.add_request(f"gen-{id(self)}-{i}-{time.monotonic_ns()}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))
        ]
        while self.has_unfinished():
            self.step()  # the requests above collect their own tokens
        return reqs
