"""Request checks shared by the router (at the edge) and the engine (defence in depth).

Pure functions over ids and numbers: the router runs them with the checkpoint's config and
tokenizer only, before any worker sees the request.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise InvalidParameterError naming the first bad field."""
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
