"""Typed messages that cross a Ray actor call between the router and the worker pools.

Both sides import this module: the router never imports a worker module, and workers never
import the router. KV bytes never ride these messages; a ticket travels as the serialized
`pdserve.v1.TransferTicket` protobuf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.engine import EngineStats
from engine.loop import EngineFailed
from engine.prefix_hash import BlockEvent
from engine.request import FinishReason
from engine.sampling import SamplingParams, TokenLogprob

__all__ = [
    "DecodeStart",
    "FinishReason",
    "FirstToken",
    "IndexUpdate",
    "PrefillResult",
    "PrefillTask",
    "ReserveResult",
    "Role",
    "TokenBatch",
    "WorkerRequest",
    "WorkerStats",
]


class NotServing(EngineFailed):
    """A worker refused a new request: it is draining (before it stops or changes role), or
    serves the other role now. Its callers place the request on another worker; the worker
    itself is well (`router.clients.WorkerDraining`), and what it holds runs to its end."""


class Role(str, enum.Enum):
    """What a pool worker runs."""

    PREFILL = "prefill"  # prompt passes; KV pushed to a decode worker
    DECODE = "decode"  # reservations, KV landing, the token loop
    COLOCATED = "colocated"  # a decode worker that also runs every prompt pass


@dataclass(frozen=True)
class WorkerRequest:
    """What any worker needs to run (part of) a request; already validated by the router."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str = ""


@dataclass(frozen=True)
class ReserveResult:
    """The decode worker's answer to a reservation: a ticket, or no room now."""

    ticket: bytes | None  # serialized pdserve.v1.TransferTicket
    num_free_blocks: int
    reason: str = ""  # why there is no ticket


@dataclass(frozen=True)
class PrefillTask:
    request: WorkerRequest
    ticket: bytes  # serialized pdserve.v1.TransferTicket naming the destination blocks


@dataclass(frozen=True)
class FirstToken:
    """The first token of one choice, sampled from the prompt pass's logits."""

    token_id: int
    text: str  # its text delta
    logprob: TokenLogprob | None
    finish_reason: FinishReason | None  # STOP or LENGTH: it already ended the choice


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    choices: tuple[FirstToken, ...]  # one per choice (SamplingParams.n), by index
    num_cached_tokens: int  # prompt tokens reused from the prefill worker's prefix cache
    queue_ms: float  # arrival on the worker until its prefill step began
    prefill_ms: float  # the prompt pass (all chunks)
    transfer_ms: float  # end of the prompt pass until the decode side acknowledged
    error: str = ""  # set when the transfer failed; the request cannot continue
    transfer_bytes: int = 0  # KV payload bytes pushed for this request
    transfer_total_ms: float = 0.0  # first KV push until acknowledged (overlaps the pass)
    # SamplingParams.prompt_logprobs: one per prompt position (the first None)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()

    @property
    def finished(self) -> bool:
        """The first tokens already ended every choice (EOS, max_tokens=1, ...)."""
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def first_token_ids(self) -> tuple[int, ...]:
        return tuple(c.token_id for c in self.choices)


@dataclass(frozen=True)
class TokenSink:
    """Where a request's tokens go (`pool_api.token_stream`): the router's listener and the
    secret the worker's hello must carry."""

    address: str  # HOST:PORT
    secret: bytes = field(repr=False)


@dataclass(frozen=True)
class DecodeStart:
    """Continue a reserved request on its decode worker once its KV has landed."""

    request_id: str
    transfer_id: str
    first_token_ids: tuple[int, ...]  # one per choice (SamplingParams.n)
    sink: TokenSink  # where its tokens go (the router's token sink)
    transfer_timeout_s: float = 10.0


@dataclass(frozen=True)
class TokenBatch:
    """New tokens of one choice of a request since its previous delta
    (`pool_api.token_stream`)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: bool = False  # the choice ended (an error or an abort ends the request)
    finish_reason: FinishReason | None = None  # set when finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""  # the request failed on the worker (e.g. its transfer broke)
    first_token_s: float | None = None  # worker clock (perf_counter) of the first token
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # with the first token, when asked
    index: int = 0  # the choice (SamplingParams.n > 1)


class StatKey(str, enum.Enum):
    """The keys of `WorkerStats.extra` (the dict carries their `.value`s)."""

    ENGINE_STEPS_TOTAL = "engine_steps_total"  # steps that ran a forward
    ENGINE_STEP_SECONDS_TOTAL = "engine_step_seconds_total"  # their wall time
    TRANSFER_FAILURES_TOTAL = "transfer_failures_total"  # prefill: transfers that failed
    TRANSFER_BYTES_TOTAL = "transfer_bytes_total"  # prefill: KV payload pushed
    KV_BYTES_RECEIVED_TOTAL = "kv_bytes_received_total"  # decode: KV payload landed
    KV_BLOCKS_SHARED_TOTAL = "kv_blocks_shared_total"  # decode: prompt blocks found cached
    DECODE_WORKSPACE_BYTES = "decode_workspace_bytes"  # decode: the workspace's memory
    DECODE_WORKSPACE_FALLBACKS_TOTAL = "decode_workspace_fallbacks_total"  # page gathers
    # decode: constrained requests whose token #1 from the prefill side the matcher accepted
    # (checked, not recomputed), and refused
    GRAMMAR_FIRST_TOKENS_CHECKED_TOTAL = "grammar_first_tokens_checked_total"
    GRAMMAR_REJECTIONS_TOTAL = "grammar_rejections_total"


@dataclass(frozen=True)
class KernelTiming:
    """One kernel candidate of one op, as the worker's start-up selection timed it at the
    model's shapes (`engine.kernels.select`); /metrics shows them."""

    op: str  # decode_attention | prefill_attention | projections
    kernel: str
    median_ms: float | None  # None: not timed (outside tolerance, or not batch-invariant)
    chosen: bool


@dataclass(frozen=True)
class WorkerStats:
    name: str
    role: Role
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_reserved: int  # decode: reservations waiting for their KV
    queued_prefill_tokens: int  # prompt tokens not yet computed
    num_requests_total: int
    num_preemptions_total: int
    extra: dict[str, float] = field(default_factory=dict)  # StatKey values -> gauges, counters
    kv_bytes_per_block: int = 0  # K + V of one block over all layers (what a transfer moves)
    kernels: tuple[KernelTiming, ...] = ()  # the start-up kernel selection's timings
    draining: bool = False  # refuses new requests (a drain before it stops or flips)
    pid: int = 0  # the worker's process (an operator's `pdserve pool status`, chaos tools)

    @classmethod
    def of(
        cls,
        name: str,
        role: Role,
        engine: EngineStats,
        num_reserved: int,
        num_requests_total: int,
        extra: dict[str, float],
        kernels: tuple[KernelTiming, ...] = (),
        draining: bool = False,
        pid: int = 0,
    ) -> WorkerStats:
        """A worker's load: its engine's stats plus what only the worker knows."""
        if engine.decode_workspace_bytes is not None:
            extra = {
                StatKey.DECODE_WORKSPACE_BYTES.value: float(engine.decode_workspace_bytes),
                StatKey.DECODE_WORKSPACE_FALLBACKS_TOTAL.value: float(
                    engine.decode_workspace_fallbacks_total
                ),
                **extra,
            }
        return cls(
            name=name,
            role=role,
            num_free_blocks=engine.num_free_blocks,
            num_total_blocks=engine.num_total_blocks,
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_reserved=num_reserved,
            queued_prefill_tokens=engine.queued_prefill_tokens,
            num_requests_total=num_requests_total,
            num_preemptions_total=engine.num_preemptions_total,
            extra=extra,
            kv_bytes_per_block=engine.kv_bytes_per_block,
            kernels=kernels,
            draining=draining,
            pid=pid,
        )


@dataclass(frozen=True)
class IndexUpdate:
    """A worker's block events since the last update (router-pulled, in-memory mode)."""

    worker: str
    epoch: str
    events: tuple[BlockEvent, ...]
    held: tuple[int, ...] | None = None  # everything held now, on periodic refreshes
