"""A list of prompts in one /v1/completions call, answered as vLLM answers it: n choices per
prompt, in order, `index` numbered across them (prompt i's choice j is i * n + j), usage
summed. Each prompt is its own
request to the router (routed, prefix-cached and released on its own); this module only
splits the body and merges the answers."""

from __future__ import annotations

from typing import Any

from protos.pdserve.v1 import generation_pb2 as gen
from router.openai.base import bad_request
from router.openai.format import Formatter, usage_dict

MAX_BATCH_PROMPTS = 128


def batch_prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a batched completions body (strings or token-id lists, more than one),
    or None for a single prompt (a string, a list of ids, or a batch of one)."""
    v = body.get("prompt")
    if not isinstance(v, list) or len(v) < 2:
        return None
    if not all(isinstance(p, str) for p in v) and not all(isinstance(p, list) for p in v):
        return None  # a list of token ids is one prompt; a mix is refused as one prompt
    if len(v) > MAX_BATCH_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_BATCH_PROMPTS} prompts in one request")
    return v


def merged(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One response of the per-prompt responses: their choices (already numbered across
    the prompts) in order, usage summed (each prompt counted once)."""
    out = dict(bodies[0])
    out["choices"] = [c for b in bodies for c in b["choices"]]
    out["usage"] = summed([b["usage"] for b in bodies])
    return out


def summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for u in usages:
        for k in total:
            total[k] += u[k]
        cached += u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


def usage_chunk(fmt: Formatter, completes: list[gen.GenerateComplete]) -> dict[str, Any]:
    out = fmt.usage_chunk(completes[0])
    out["usage"] = summed([usage_dict(c) for c in completes])
    return out
