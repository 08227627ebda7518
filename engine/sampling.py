"""Sampling parameters, their validation, and the sampler.

The sampler turns a step's float32 logits ``[B, V]`` into one token per request. Greedy rows
with no penalties take one batched argmax; anything else is processed per row (penalties,
temperature, top-k, top-p, min-p) and drawn with the request's own `torch.Generator`, so a
seeded request yields the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import InvalidParameterError as InvalidParameterError  # re-exported

if TYPE_CHECKING:
    from engine.structured import StructuredOutput

GREEDY_EPS = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value
MAX_N = 256  # sequences of one request the engine takes (the router's bound is lower)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Defaults follow OpenAI/vLLM: temperature 1.0, top_p 1.0."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # top-N alternatives per sampled token (0: sampled only)
    # vLLM's prompt_logprobs (and echo + logprobs): each prompt token's logprob and top-N,
    # from the prompt pass itself (0: the token's own only; None: off)
    prompt_logprobs: int | None = None
    # added to the logits before anything else (OpenAI's logit_bias): (token id, bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None  # the output's grammar (engine.structured)
    # vLLM's token controls: only these ids may be sampled (None: any); and token sequences
    # never to complete (`bad_words` as the router tokenized them): a one-token word is
    # never sampled, a longer one's last token not right after the rest of it
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # sequences from this prompt's one pass (OpenAI's n, or best_of where the router keeps
    # the best n): each samples its own first token from the same logits, and choice i
    # with a seed draws from seed + i
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidParameterError naming the first bad field: the sampler's knobs
        first, then the request's lengths, stops and seed (the order users see errors in)."""
        for name, ok, message in self._sampler_checks() + self._request_checks(vocab_size):
            if not ok:
                raise InvalidParameterError(name, message)

    def _sampler_checks(self) -> list[tuple[str, bool, str]]:
        """(field, valid, message) for the knobs that shape the distribution."""
        return [
            (
                "temperature",
                math.isfinite(self.temperature) and self.temperature >= 0,
                f"must be a finite number >= 0, got {self.temperature}",
            ),
            ("top_p", 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"),
            (
                "top_k",
                self.top_k is None or self.top_k >= 1,
                f"must be >= 1 (or unset), got {self.top_k}",
            ),
            ("min_p", 0 <= self.min_p <= 1, f"must be in [0, 1], got {self.min_p}"),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                f"must be > 0, got {self.repetition_penalty}",
            ),
            (
                "frequency_penalty",
                -2 <= self.frequency_penalty <= 2,
                f"must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                "presence_penalty",
                -2 <= self.presence_penalty <= 2,
                f"must be in [-2, 2], got {self.presence_penalty}",
            ),
        ]

    def _request_checks(self, vocab_size: int | None) -> list[tuple[str, bool, str]]:
        """(field, valid, message) for lengths, logprobs, stops and seed; stop token ids are
        checked only when the vocabulary size is known."""
        checks: list[tuple[str, bool, str]] = [
            ("max_tokens", self.max_tokens >= 1, f"must be >= 1, got {self.max_tokens}"),
            (
                "min_tokens",
                0 <= self.min_tokens <= self.max_tokens,
                f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                "stop",
                all(isinstance(s, str) and s for s in self.stop),
                "stop strings must be non-empty",
            ),
            (
                "seed",
                self.seed is None or 0 <= self.seed < 2**63,
                f"must be in [0, 2^63), got {self.seed}",
            ),
            ("n", 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}], got {self.n}"),
        ]
        return checks + self._token_checks(vocab_size)

    def _token_checks(self, vocab_size: int | None) -> list[tuple[str, bool, str]]:
        """(field, valid, message) for the fields that name tokens: logit_bias,
        allowed_token_ids, stop_token_ids (ids checked when the vocabulary size is known)."""
        bias_ok = all(
            math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias
        )
        checks = [
            ("logit_bias", bias_ok, f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "must not be empty (unset allows every token)",
            ),
        ]
        if vocab_size is None:
            return checks
        fields = (
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logit_bias", tuple(t for t, _ in self.logit_bias)),
            ("stop_token_ids", self.stop_token_ids),
        )
        for name, ids in fields:
            outside = [t for t in ids if not 0 <= t < vocab_size]
            checks.append(
                (
                    name,
                    not outside,
                    f"ids {outside[:8]} are outside the vocabulary [0, {vocab_size})",
                )
            )
        return checks


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int = 0  # the token's rank in its distribution, 1 = the best (0: not computed)


@dataclass
class SamplingState:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    banned_until_min_tokens: tuple[int, ...] = field(default_factory=tuple)
    matcher: Any = None  # an xgrammar GrammarMatcher: the row is constrained to its grammar


def _process_logits(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """In place, before any row is sampled: each row's logit_bias, its bans (tokens outside
    allowed_token_ids, a bad word's last token, EOS and stop ids before min_tokens), then
    each constrained row's grammar bitmask. Rows with none of these are not touched.

    The grammar wins over the bans: a constrained row they leave without any token the
    grammar allows (`min_tokens` past a complete grammar, `allowed_token_ids` outside it)
    is masked by the grammar alone, so every token sampled is one its matcher accepts."""
    unbanned: dict[int, torch.Tensor] = {}
    with torch.inference_mode():  # the forward's logits are inference tensors
        for i, s in enumerate(states):
            p = s.params
            if p.logit_bias:
                ids, bias = zip(*p.logit_bias, strict=True)
                logits[i, list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
            allowed, banned = p.allowed_token_ids, _banned(s)
            if s.matcher is not None and (allowed is not None or banned):
                unbanned[i] = logits[i].clone()
            if allowed is not None:
                keep = logits[i, list(allowed)].clone()
                logits[i].fill_(-math.inf)
                logits[i, list(allowed)] = keep
            if banned:
                logits[i, banned] = -math.inf
        constrained = [(i, s.matcher) for i, s in enumerate(states) if s.matcher is not None]
        if not constrained:
            return
        from engine.structured import apply_bitmask, fill_bitmask

        bitmask, rows = fill_bitmask(constrained, logits.shape[0], logits.shape[1])
        apply_bitmask(logits, bitmask, rows)
        for i, row in unbanned.items():
            if not torch.isfinite(logits[i]).any():
                logits[i] = row
                apply_bitmask(logits, bitmask, [i])


def _banned(s: SamplingState) -> list[int]:
    """The tokens `s` may not take now: a bad word's completion, and EOS / stop ids while
    the output is shorter than min_tokens."""
    banned = _banned_words(s.params, s.output_token_ids) if s.params.bad_words_token_ids else []
    if s.banned_until_min_tokens and len(s.output_token_ids) < s.params.min_tokens:
        banned.extend(s.banned_until_min_tokens)
    return banned


def _banned_words(p: SamplingParams, output: Sequence[int]) -> list[int]:
    """The tokens that would complete one of `p`'s bad words now (vLLM's rule: a word's
    last token, where the output ends with the rest of it)."""
    banned = []
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and tuple(output[-len(prefix) :]) == prefix):
            banned.append(word[-1])
    return banned


def sample(
    logits: torch.Tensor, states: Sequence[SamplingState]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [B, V] float32 -> one token id per row, plus logprobs where asked."""
    assert logits.shape[0] == len(states), "one sampling state per logits row"
    raw_logprobs = None
    if any(s.params.logprobs is not None for s in states):
        # The model's own distribution (vLLM's default, raw_logprobs): before bias and mask.
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    _process_logits(logits, states)
    tokens: list[int | None] = [None] * len(states)
    simple = [i for i, s in enumerate(states) if _is_plain_greedy(s)]
    if simple:
        picked = logits[simple].argmax(dim=-1).tolist()
        for i, t in zip(simple, picked, strict=True):
            tokens[i] = t
    for i, s in enumerate(states):
        if tokens[i] is None:
            tokens[i] = _sample_row(logits[i].clone(), s)
    out = [int(t) for t in tokens if t is not None]
    return out, [
        _logprobs(raw_logprobs, i, out[i], s.params.logprobs) for i, s in enumerate(states)
    ]


def _is_plain_greedy(s: SamplingState) -> bool:
    return s.params.greedy and not s.params.needs_penalties


def _sample_row(row: torch.Tensor, s: SamplingState) -> int:
    p = s.params
    if p.needs_penalties:
        _apply_penalties(row, s)
    if p.greedy:
        return int(row.argmax())
    row = row / p.temperature
    if p.top_k is not None and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, -math.inf)
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i.
    noise = torch.empty_like(probs).exponential_(generator=s.generator)
    return int((probs / noise).argmax())


def skip_draw(state: SamplingState, vocab_size: int) -> None:
    """Advance a seeded request's generator past the draw `sample` made for a token sampled
    elsewhere (a prefill worker's token #1): the decode side's next draws are then the
    colocated engine's, so a seeded request gives the same tokens either way."""
    if state.generator is not None and not state.params.greedy:
        torch.empty(vocab_size).exponential_(generator=state.generator)


def _apply_penalties(row: torch.Tensor, s: SamplingState) -> None:
    p = s.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(s.prompt_token_ids) | set(s.output_token_ids)), dtype=torch.long
        )
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if s.output_token_ids and (p.frequency_penalty or p.presence_penalty):
        ids, counts = torch.tensor(list(s.output_token_ids), dtype=torch.long).unique(
            return_counts=True
        )
        row[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty


def _logprobs(raw: torch.Tensor | None, i: int, token: int, n: int | None) -> TokenLogprob | None:
    if raw is None or n is None:
        return None
    top: tuple[tuple[int, float], ...] = ()
    if n > 0:
        vals, ids = raw[i].topk(n)
        top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token, float(raw[i, token]), top)
