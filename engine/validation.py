"""Request checks shared by the router (at the edge) and the engine (defence in depth).

Pure functions over ids and numbers: the router runs them with the checkpoint's config and
tokenizer only, before any worker sees the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import ceil_div
from engine.sampling import InvalidParameterError, SamplingParams


class ContextLengthError(InvalidParameterError):
    """The prompt (plus requested output) does not fit the context window."""


REDUCE = "Please reduce the length of the messages or completion."


def context_length_message(max_len: int, num_prompt: int, max_tokens: int) -> str:
    """OpenAI's wording, which clients match on."""
    return (
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
        f"completion). {REDUCE}"
    )


def too_long_message(max_len: int, what: str) -> str:
    """The same words for a prompt refused by another length limit (its characters before
    tokenizing, its token count, the KV cache): every length refusal reads, and is coded,
    as a context-length one (frameworks match on both)."""
    return f"This model's maximum context length is {max_len} tokens. However, {what}. {REDUCE}"


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    block_size: int = 0,
    num_kv_blocks: int = 0,
    prefill_only: bool = False,
) -> None:
    """Raise InvalidParameterError naming the first bad field.

    With `num_kv_blocks` set, a request must also fit an empty pool on its own: preemption
    frees other requests' blocks but never makes room beyond the pool, so one that outgrows
    it would wait forever. Its peak is every token but the last sampled one (prefill-only
    requests: the prompt plus one).
    """
    params.validate(vocab_size)
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidParameterError("prompt", "must not be empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError(
            "prompt_token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    if n + params.max_tokens > max_model_len:
        raise ContextLengthError(
            "prompt", context_length_message(max_model_len, n, params.max_tokens)
        )
    if not num_kv_blocks:
        return
    need = ceil_div(n + 1, block_size)
    if need > num_kv_blocks:
        what = (
            f"your {n} prompt tokens need {need} KV blocks and this server's cache holds "
            f"{num_kv_blocks} ({num_kv_blocks * block_size} tokens) for one request"
        )
        raise ContextLengthError("prompt", too_long_message(max_model_len, what))
    need = ceil_div(n + max(params.max_tokens - 1, 1), block_size)
    if not prefill_only and need > num_kv_blocks:
        what = (
            f"{n} prompt + {params.max_tokens} completion tokens need {need} KV blocks and "
            f"this server's cache holds {num_kv_blocks} ({num_kv_blocks * block_size} tokens) "
            "for one request"
        )
        raise ContextLengthError("max_tokens", too_long_message(max_model_len, what))
