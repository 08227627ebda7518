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


def context_length_message(max_len: int, num_prompt: int, max_tokens: int) -> str:
    """OpenAI's wording, which clients match on."""
    return (
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


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
        raise ContextLengthError("prompt", f"needs {need} KV blocks; the cache has {num_kv_blocks}")
    need = ceil_div(n + max(params.max_tokens - 1, 1), block_size)
    if not prefill_only and need > num_kv_blocks:
        raise ContextLengthError(
            "max_tokens",
            f"{n} prompt + {params.max_tokens} completion tokens need {need} KV "
            f"blocks; the cache has {num_kv_blocks}",
        )
