"""Typed messages that cross a Ray actor call between the router and the worker pools.

This is the one leaf module both sides import: the router never imports a worker module,
and workers never import the router. KV bytes never ride these messages; a ticket travels
as the serialized `pdserve.v1.TransferTicket` protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.engine import LLMEngine


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
class PrefillResult:
    request_id: str
    first_token_id: int
    text: str  # the first token's text delta
    logprob: TokenLogprob | None
    finished: bool  # the first token already ended the request (EOS, max_tokens=1, ...)
    finish_reason: str | None  # "stop" | "length" when finished
    num_cached_tokens: int  # prompt tokens reused from the prefill worker's prefix cache
    queue_ms: float  # arrival on the worker until its prefill step began
    prefill_ms: float  # the prompt pass (all chunks)
    transfer_ms: float  # end of the prompt pass until the decode side acknowledged
    error: str = ""  # set when the transfer failed; the request cannot continue


@dataclass(frozen=True)
class DecodeStart:
    """Continue a reserved request on its decode worker once its KV has landed."""

    request_id: str
    transfer_id: str
    first_token_id: int
    transfer_timeout_s: float = 10.0


@dataclass(frozen=True)
class TokenBatch:
    """New tokens of one request since the previous poll."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""  # the request failed on the worker (e.g. its transfer broke)
    first_token_s: float | None = None  # worker clock (perf_counter) of the first token


@dataclass(frozen=True)
class WorkerStats:
    name: str
    role: str  # "prefill" | "decode" | "colocated"
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_reserved: int  # decode: reservations waiting for their KV
    queued_prefill_tokens: int  # prompt tokens not yet computed
    num_requests_total: int
    num_preemptions_total: int
    extra: dict[str, float] = field(default_factory=dict)
    kv_bytes_per_block: int = 0  # K + V of one block over all layers (what a transfer moves)

    @classmethod
    def of_engine(
        cls,
        name: str,
        role: str,
        engine: LLMEngine,
        num_reserved: int,
        num_requests_total: int,
        extra: dict[str, float] | None = None,
    ) -> WorkerStats:
        """A worker's load as its engine sees it (call on the engine thread)."""
        blocks, sched = engine.blocks, engine.scheduler
        ws = engine.runner.workspace
        if ws is not None:
            extra = {
                "decode_workspace_bytes": float(ws.bytes_held),
                "decode_workspace_fallbacks_total": float(ws.fallbacks),
                **(extra or {}),
            }
        return cls(
            name=name,
            role=role,
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_blocks,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_reserved=num_reserved,
            queued_prefill_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
            num_requests_total=num_requests_total,
            num_preemptions_total=sched.num_preemptions,
            extra=extra or {},
            kv_bytes_per_block=engine.cache.spec.page_bytes * engine.cache.spec.num_layers,
        )
