"""Request fields pdserve does not honour (docs/http.md#request-fields).

OpenAI's completions and chat completions fields and vLLM's extras, each either honoured
(router/openai/protocol.py maps it), accepted and harmless (`HARMLESS`: it cannot change
the output, so it is read and dropped, as OpenAI drops `user`), or refused here with a 400
naming it unless its value is one that changes nothing (`REFUSED`: `echo: false`, `n`
checks aside, `function_call: none`, ...). A field in neither table and not
honoured is unknown: ignored, as vLLM does.

`unsupported` runs before the prompt is parsed, in the order of `REFUSED`; a null is the
same as an absent field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Endpoint = Literal["completions", "chat", "tokenize"]  # tokenize: POST /tokenize with messages
BOTH: frozenset[Endpoint] = frozenset({"completions", "chat"})
CHAT: frozenset[Endpoint] = frozenset({"chat"})
COMPLETIONS: frozenset[Endpoint] = frozenset({"completions"})
TEMPLATE: frozenset[Endpoint] = frozenset({"chat", "tokenize"})  # what renders the template
ALL: frozenset[Endpoint] = BOTH | TEMPLATE


def _empty(v: Any) -> bool:
    return v in ({}, [], "")


def _is(*values: Any) -> Callable[[Any], bool]:
    """Harmless when equal to one of `values` (1 and 1.0 alike; a boolean is not 1)."""

    def check(v: Any) -> bool:
        return any(v == x and isinstance(v, bool) == isinstance(x, bool) for x in values)

    return check


def _text_only(v: Any) -> bool:
    return v == {"type": "text"}


def _text_modalities(v: Any) -> bool:
    return v in (["text"], [])


def _no_function_call(v: Any) -> bool:
    return v in ("none", "auto")


@dataclass(frozen=True)
class Refused:
    """A field answered with a 400 unless its value is `harmless`."""

    name: str
    endpoints: frozenset[Endpoint]
    harmless: Callable[[Any], bool]
    why: str
    example: Any  # a value that is refused (the tests walk the table with it)


# fmt: off
REFUSED: tuple[Refused, ...] = (
    # OpenAI
    Refused("echo", CHAT, _is(False), "echo on chat must be false (completions honour it)",
            True),
    Refused("suffix", COMPLETIONS, _empty, "no suffix", "tail"),
    Refused("functions", CHAT, _empty, "the legacy functions: send tools", [{"name": "f"}]),
    Refused("function_call", CHAT, _no_function_call, "the legacy function_call: send tool_choice",
            {"name": "f"}),
    Refused("audio", CHAT, _empty, "text output only", {"voice": "alloy", "format": "wav"}),
    Refused("modalities", CHAT, _text_modalities, "text output only: ['text']",
            ["text", "audio"]),
    Refused("web_search_options", CHAT, _empty, "no web search", {"search_context_size": "low"}),
    Refused("reasoning_effort", CHAT, _empty, "no reasoning controls", "low"),
    Refused("verbosity", CHAT, _empty, "no verbosity control", "low"),
    # vLLM's sampling and request extras
    Refused("use_beam_search", BOTH, _is(False), "no beam search", True),
    Refused("length_penalty", BOTH, _is(1.0), "no beam search, so length_penalty must be 1",
            0.5),
    Refused("include_stop_str_in_output", BOTH, _is(False),
            "the stop string is never included", True),
    Refused("skip_special_tokens", BOTH, _is(True), "special tokens are always skipped", False),
    Refused("spaces_between_special_tokens", BOTH, _is(True),
            "special tokens are always skipped", False),
    Refused("truncate_prompt_tokens", BOTH, _empty, "no prompt truncation", 8),
    Refused("logits_processors", BOTH, _empty, "no logits processors", ["m.P"]),
    Refused("guided_decoding_backend", BOTH, _is("xgrammar", "auto", ""),
            "the grammar backend is xgrammar", "outlines"),
    Refused("guided_whitespace_pattern", BOTH, _empty,
            "JSON whitespace follows the backend's default", " "),
    Refused("structural_tag", BOTH, _empty,
            "send it as structured_outputs.structural_tag", "{}x"),
    Refused("chat_template", TEMPLATE, _empty,
            "a request may not bring its own template (vLLM's default too)", "{{ 'x' }}"),
    Refused("documents", TEMPLATE, _empty, "no documents for the template",
            [{"title": "t", "text": "x"}]),
    Refused("mm_processor_kwargs", ALL, _empty, "text only", {"num_crops": 4}),
    Refused("prompt_embeds", COMPLETIONS, _empty, "no prompt embeddings", "AAAA"),
    Refused("priority", BOTH, _is(0), "no priority scheduling", 1),
    Refused("kv_transfer_params", BOTH, _empty,
            "pdserve disaggregates on its own; there is no external KV connector",
            {"do_remote_decode": True}),
    Refused("vllm_xargs", BOTH, _empty, "no extension arguments", {"k": 1}),
)
# fmt: on

# Accepted and dropped: none of them can change the output.
HARMLESS: dict[str, str] = {
    "user": "an end-user id for abuse monitoring (OpenAI drops it too)",
    "safety_identifier": "OpenAI's successor to user",
    "metadata": "tags for stored completions; nothing is stored",
    "store": "nothing is stored",
    "service_tier": "one processing tier",
    "prompt_cache_key": "a cache-routing hint; pdserve routes by prefix itself",
    "prediction": "a latency hint: the output is the same without it",
    "include_reasoning": "no reasoning parser: reasoning text stays in the content",
}


def unsupported(body: dict[str, Any], endpoint: Endpoint) -> tuple[str, str] | None:
    """(field, message) of the first field of `REFUSED` that `body` sets to a value that
    would change the output, or None."""
    for f in REFUSED:
        if endpoint not in f.endpoints:
            continue
        v = body.get(f.name)
        if v is not None and not f.harmless(v):
            return f.name, f"{f.name} is not supported ({f.why})"
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("continuous_usage_stats"):
        name = "stream_options.continuous_usage_stats"
        return name, f"{name} is not supported (usage comes once, in the last chunk)"
    return None
