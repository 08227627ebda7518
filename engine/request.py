"""A request's progress through the engine, and the output objects the engine hands back.

Vocabulary (the same from proto to Redis keys): ``num_computed_tokens`` counts leading tokens
whose K/V is in the cache; ``num_cached_tokens`` is how many of those came from the prefix
cache at admission rather than from this request's own compute.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.prefix_hash import extend_block_hashes
from engine.sampling import SamplingParams, SamplingState, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer


class GrammarRejected(ValueError):
    """A token from outside this engine's sampler (a prefill worker's token #1) that the
    request's grammar does not accept: the two sides' grammars differ."""


CHOICE_SEP = "\x1f"  # a choice's sequence id: f"{request_id}{CHOICE_SEP}{index}"


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of a request (choice 0 keeps the request's id).
    Request ids may not contain the separator (the router and the engine refuse it)."""
    return request_id if index == 0 else f"{request_id}{CHOICE_SEP}{index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # needs (more) prefill
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)  # a request is itself: `in` and `remove` on queues compare identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hash_seed: bytes  # `block_manager.namespace_seed(fingerprint, cache_salt)`
    block_size: int
    detokenizer: IncrementalDetokenizer | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Stop after the first token and keep the blocks (a prefill worker's request).
    prefill_only: bool = False
    # After a preemption, recompute the generated tokens' K/V with decode rows (`prefill_end`);
    # the engine sets it when its kernels are batch-invariant (else a prompt pass is faster
    # and the tokens could change either way)
    replays: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    text: str = ""
    num_text_sent: int = 0  # leading chars of `text` already handed out (`take_text_delta`)
    num_text_checked: int = 0  # chars of `text` already searched for stop strings
    block_hashes: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    prefill_s: float = 0.0  # wall time of prefill steps that included this request
    # xgrammar GrammarMatcher of a constrained request (engine.structured): it has accepted
    # every output token; None once the request is finished (abort frees it)
    matcher: Any = None
    # prompt_logprobs: one entry per prompt position (the first is None: nothing precedes
    # it), filled by the prompt pass (`LLMEngine`); complete once it has len(prompt) entries
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # n > 1 (`SamplingParams.n`): this sequence is choice `index` of request `group_id`,
    # whose prompt pass choice 0 ran (`LLMEngine._fork`); `grammar` is the compiled grammar
    # each choice's own matcher comes from
    index: int = 0
    group_id: str = ""
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id
        if self.params.seed is not None:  # choice i draws from seed + i (vLLM's rule)
            self.generator = torch.Generator().manual_seed(self.params.seed + self.index)
        self.refresh_hashes()

    @property
    def forks_now(self) -> bool:
        """Its prompt pass just ended and its other choices are still to be made."""
        return self.params.n > 1 and self.index == 0 and not self.output_token_ids

    def fork(self, index: int, detokenizer: IncrementalDetokenizer | None, matcher: Any) -> Request:
        """Choice `index` of this request, made when its prompt pass ended: the same prompt
        (its K/V computed, its blocks the caller shares), nothing sampled yet."""
        assert not self.output_token_ids, "choices fork before the first token"
        return Request(
            request_id=choice_id(self.request_id, index),
            prompt_token_ids=self.prompt_token_ids,  # never mutated: shared
            params=self.params,
            hash_seed=self.hash_seed,
            block_size=self.block_size,
            detokenizer=detokenizer,
            eos_token_ids=self.eos_token_ids,
            prefill_only=self.prefill_only,
            replays=self.replays,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            arrival_s=self.arrival_s,
            prefill_s=self.prefill_s,
            matcher=matcher,
            index=index,
            group_id=self.request_id,
            grammar=self.grammar,
            block_hashes=list(self.block_hashes),
            # choice 0 carries the prompt's logprobs: none to compute for this one
            prompt_logprobs=[None] * len(self.prompt_token_ids)
            if self.params.prompt_logprobs is not None
            else [],
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt pass must keep every position's hidden state (not yet computed)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_end(self) -> int:
        """One past the last position a prompt pass computes for it: every token, except
        for a sequence that `replays` and recomputes after a preemption. Its generated
        tokens first got their K/V from decode rows, and they get it from decode rows again
        (`replaying`): a prompt pass would compute the same values with other arithmetic,
        and a greedy token at a near-tie would change (batch invariance:
        docs/architecture.md, `scheduler.py`)."""
        if self.replays and self.output_token_ids:
            return len(self.prompt_token_ids)
        return self.num_tokens

    @property
    def replaying(self) -> bool:
        """Its next decode row feeds a token it already generated (after a preemption),
        writing that token's K/V and sampling nothing."""
        return self.num_computed_tokens < self.num_tokens - 1

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return (
            self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
        )

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def refresh_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.hash_seed)

    def computed_hashes(self) -> list[int]:
        """Hashes of blocks whose K/V is fully computed (safe to share)."""
        return self.block_hashes[: self.num_computed_tokens // self.block_size]

    def sampling_state(self) -> SamplingState:
        banned = () if self.params.ignore_eos else self.eos_token_ids
        return SamplingState(
            self.params,
            self.prompt_token_ids,
            self.output_token_ids,
            self.generator,
            tuple(banned) + self.params.stop_token_ids,
            self.matcher,
        )

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> str:
        """Record a sampled token; returns the text it completes (maybe empty). Streams use
        `take_text_delta`, which also holds back what a stop string may still trim."""
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        if self.matcher is not None and not self.matcher.accept_token(token_id):
            # The sampler masks what the grammar forbids: only a token from elsewhere (a
            # prefill worker's token #1) can get here.
            raise GrammarRejected(f"{self.request_id}: token {token_id} breaks its grammar")
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        self.refresh_hashes()
        if self.detokenizer is None or self._is_stop_token(token_id):
            return ""
        delta = self.detokenizer.add(token_id)
        self.text += delta
        return delta

    def _is_stop_token(self, token_id: int) -> bool:
        return token_id in self.params.stop_token_ids or (
            not self.params.ignore_eos and token_id in self.eos_token_ids
        )

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Decide whether the last appended token ends the request; trims stop strings."""
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens and self._is_stop_token(last):
            return FinishReason.STOP
        if self.matcher is not None and self.matcher.is_terminated():
            return FinishReason.STOP  # the grammar is complete: nothing else may follow
        if self.params.stop:
            hit = self._find_stop_string() if n_out >= self.params.min_tokens else None
            # Stop strings completed before min_tokens are ignored, as vLLM does.
            self.num_text_checked = len(self.text)
            if hit is not None:
                self.text = self.text[:hit]
                return FinishReason.STOP
        if n_out >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def _find_stop_string(self) -> int | None:
        """Start of the first stop string that ends in text not searched before."""
        positions = [
            i
            for s in self.params.stop
            if (i := self.text.find(s, max(0, self.num_text_checked - len(s) + 1))) >= 0
        ]
        return min(positions) if positions else None

    def take_text_delta(self, final: bool) -> str:
        """Text not handed out yet. Unless `final`, a tail that may still grow into a stop
        string is held back, so a stream never shows text that a stop string then trims."""
        end = len(self.text)
        if not final:
            end -= _stop_string_overlap(self.text, self.params.stop)
        if end <= self.num_text_sent:
            return ""
        delta = self.text[self.num_text_sent : end]
        self.num_text_sent = end
        return delta

    def finish(self, reason: FinishReason | None) -> None:
        """End this request here; `reason` None marks a prefill-only request handed on."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.matcher = None


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    new_logprobs: tuple[TokenLogprob, ...] = ()
    # with its first token: each prompt token's (`SamplingParams.prompt_logprobs`)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    index: int = 0  # the choice (n > 1); `request_id` is the request's, not the choice's
    # every choice of the request has finished (n = 1: the same as `finished`)
    last: bool = False


def _stop_string_overlap(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = max((len(s) for s in stops), default=1) - 1
    for k in range(min(longest, len(text)), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return k
    return 0
