"""The router's responses as OpenAI's JSON (docs/http.md): `text_completion`,
`chat.completion` and their streamed chunks, usage, logprobs and finish reasons, and the SSE
framing the chunks travel in.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from protos.pdserve.v1 import generation_pb2 as gen
from router.openai.tools import ToolPlan

_FINISH = {
    gen.FINISH_REASON_STOP: "stop",
    gen.FINISH_REASON_LENGTH: "length",
    gen.FINISH_REASON_ABORT: "abort",
    gen.FINISH_REASON_UNSPECIFIED: "stop",
}


def finish_reason(c: gen.GenerateComplete) -> str:
    return _FINISH[c.finish_reason]


def finish_name(reason: int) -> str:
    """A proto finish reason as OpenAI names it."""
    return _FINISH[reason]  # type: ignore[index]


def choice_finish(c: gen.GenerateComplete, index: int) -> str:
    """Choice `index`'s finish reason as OpenAI names it (n > 1: the completion's entry)."""
    reasons = c.choice_finish_reasons
    return _FINISH[reasons[index] if index < len(reasons) else c.finish_reason]


def _finite(x: float) -> float:
    """JSON has no -inf: a token the sampler could never pick gets a very low logprob."""
    return x if math.isfinite(x) else -9999.0


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Completions' logprobs of the echoed prompt, then of the output."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def _tool_finish(calls: list[Any], finish: str | None) -> str | None:
    """`tool_calls` when calls were read and the output was not cut short (a cut one keeps
    `length`, with the calls it completed)."""
    return "tool_calls" if calls and finish != "length" else finish


def usage_dict(c: gen.GenerateComplete) -> dict[str, Any]:
    u = c.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: a JSON object, or a bare word (`[DONE]`)."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n".encode()


@dataclass
class Formatter:
    """OpenAI's JSON for one request: `text_completion` or `chat.completion`. One per
    request: completions' logprobs count text offsets across its chunks."""

    chat: bool
    id: str
    model: str
    tokenizer: Tokenizer | None
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # vLLM's return_tokens_as_token_ids: logprobs name each token `token_id:<id>`
    token_ids_as_tokens: bool = False
    tools: ToolPlan | None = None  # chat with tools in play: calls are read from the text
    # The prompt's part, set by the HTTP layer once the request is admitted: completions'
    # `echo` (the prompt's text leads the text; with logprobs its tokens lead the logprobs,
    # the first with none) and vLLM's `prompt_logprobs` (the choice's, chat: the response's)
    echo: bool = False
    echo_logprobs: bool = False
    want_prompt_logprobs: bool = False
    prompt_ids: tuple[int, ...] = ()
    prompt_text: str = ""
    prompt_sent: bool = False  # streamed: the prompt's part went out with the first chunk
    _call_id: str = ""  # a streamed named call's id, once its first fragment went out
    _offset: int = 0  # completions logprobs: text offset of the next token

    @property
    def has_prompt_part(self) -> bool:
        return self.echo or self.want_prompt_logprobs

    def asked(self, body: dict[str, Any]) -> Formatter:
        """The prompt's part of the answer the body asks for (echo, prompt_logprobs)."""
        self.echo = not self.chat and body.get("echo") is True
        self.echo_logprobs = self.echo and body.get("logprobs") is not None
        self.want_prompt_logprobs = body.get("prompt_logprobs") is not None
        return self

    def admitted(self, prompt_ids: Sequence[int], request: gen.GenerateRequest) -> None:
        """What the prompt's part needs once the request is admitted: its ids and (echo)
        its text, as sent or decoded from its ids."""
        if not self.has_prompt_part:
            return
        self.prompt_ids = tuple(prompt_ids)
        if request.WhichOneof("prompt") == "text":
            self.prompt_text = request.text
        elif self.tokenizer is not None:
            self.prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)

    def _echo_logprobs(self, plps: Sequence[gen.TokenLogprob]) -> dict[str, Any]:
        """The prompt's tokens as completions' logprobs entries (the first has none; each
        top list also names the prompt's own token, as vLLM's echo does)."""
        entries: list[gen.TokenLogprob | None] = [None, *plps]
        return self._completion_entries(list(zip(self.prompt_ids, entries, strict=False)), True)

    def _vllm_prompt_logprobs(self, plps: Sequence[gen.TokenLogprob]) -> list[Any]:
        """vLLM's `prompt_logprobs`: None, then per position {token id: {logprob, rank,
        decoded_token}} of the prompt's token and the top alternatives."""
        out: list[Any] = [None]
        for lp in plps:
            entry = {
                str(t.token_id): {
                    "logprob": _finite(t.logprob),
                    "rank": r,
                    "decoded_token": self._text_of(t.token_id),
                }
                for r, t in enumerate(lp.top, start=1)
            }
            entry[str(lp.token_id)] = {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": self._text_of(lp.token_id),
            }
            out.append(entry)
        return out

    def prompt_part(
        self, plps: Sequence[gen.TokenLogprob]
    ) -> tuple[str, dict[str, Any] | None, list[Any] | None]:
        """Once per request: (echoed text, echoed logprobs entries, vLLM prompt_logprobs)."""
        self.prompt_sent = True
        text = self.prompt_text if self.echo and not self.chat else ""
        entries = self._echo_logprobs(plps) if self.echo_logprobs and not self.chat else None
        vllm = self._vllm_prompt_logprobs(plps) if self.want_prompt_logprobs else None
        return text, entries, vllm

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None or self.token_ids_as_tokens:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _text_of(self, token_id: int) -> str:
        """The token's own text (vLLM's prompt_logprobs `decoded_token`, which
        return_tokens_as_token_ids does not change)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self._token(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode())}

    def _chat_logprobs(self, lps: list[gen.TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            entry = self._chat_entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._chat_entry(t.token_id, t.logprob) for t in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, lps: list[gen.TokenLogprob]) -> dict[str, Any]:
        return self._completion_entries([(lp.token_id, lp) for lp in lps], False)

    def _completion_entries(
        self, entries: list[tuple[int, gen.TokenLogprob | None]], own_in_top: bool
    ) -> dict[str, Any]:
        """Completions' logprobs lists for (token id, its logprob or None) in text order;
        text offsets count on from the last call's."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, lp in entries:
            s = self._token(token_id)
            tokens.append(s)
            offsets.append(self._offset)
            self._offset += len(s)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_finite(lp.logprob))
            top = {self._token(t.token_id): _finite(t.logprob) for t in lp.top}
            tops.append({**top, s: _finite(lp.logprob)} if own_in_top else top)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def logprobs(self, lps: list[gen.TokenLogprob]) -> dict[str, Any] | None:
        if not lps:
            return None
        return self._chat_logprobs(lps) if self.chat else self._completion_logprobs(lps)

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    # streaming
    def chunk(
        self,
        text: str,
        lps: list[gen.TokenLogprob],
        finish: str | None = None,
        role: bool = False,
        prompt: Sequence[gen.TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        """`prompt`: the request's prompt logprobs, given with its first chunk: the prompt's
        part (`prompt_part`) goes out with it."""
        choice: dict[str, Any] = {"index": 0}
        echoed, entries, vllm = "", None, None
        if prompt is not None and self.has_prompt_part and not self.prompt_sent:
            echoed, entries, vllm = self.prompt_part(prompt)
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text or role:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = echoed + text
        choice["logprobs"] = _joined(entries, self.logprobs(lps))
        choice["finish_reason"] = finish
        if vllm is not None:
            choice["prompt_logprobs"] = vllm
        out = self._envelope([choice], stream=True)
        if self.include_usage:
            out["usage"] = None
        return out

    @property
    def streams_arguments(self) -> bool:
        """A named tool call streams its arguments as they come: the whole output is them."""
        return self.tools is not None and self.tools.mode == "named"

    def arguments_chunk(self, text: str) -> dict[str, Any]:
        """A named call's next fragment of arguments; the first also carries its id, type
        and name (OpenAI's streamed tool-call shape)."""
        assert self.tools is not None
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if not self._call_id:
            self._call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
            call = {
                "index": 0,
                "id": self._call_id,
                "type": "function",
                "function": {"name": self.tools.named, "arguments": text},
            }
        chunk = self.chunk("", [])
        chunk["choices"][0]["delta"] = {"tool_calls": [call]}
        return chunk

    def of_chunk(
        self, c: gen.GenerateChunk, prompt: Sequence[gen.TokenLogprob] = ()
    ) -> dict[str, Any] | None:
        """The streamed chunk of a router chunk; None when it carries nothing to send (no
        text, no logprobs, and the prompt's part, if asked, already sent). `prompt`: the
        request's prompt logprobs when this choice's chunks do not carry them (n > 1)."""
        if c.text or c.logprobs or (self.has_prompt_part and not self.prompt_sent):
            plps = list(c.prompt_logprobs) or list(prompt)
            return self.chunk(c.text, list(c.logprobs), prompt=plps)
        return None

    def tool_chunks(self, text: str, finish: str | None) -> list[dict[str, Any]]:
        """A streamed tool request's ending, once its whole text is in: the content (if
        any), one delta per call in OpenAI's shape (`index`, `id`, `function.name` and the
        whole `arguments`), and the finish chunk (`tool_calls` when there is a call)."""
        assert self.tools is not None
        if self.streams_arguments:  # its arguments went out as they came
            out = [] if self._call_id else [self.arguments_chunk("")]
            return [*out, self.chunk("", [], _tool_finish([self._call_id], finish))]
        content, calls = self.tools.parse(text)
        out = [self.chunk(content, [])] if content else []
        for i, call in enumerate(calls):
            chunk = self.chunk("", [])
            chunk["choices"][0]["delta"] = {"tool_calls": [call.to_openai(index=i)]}
            out.append(chunk)
        out.append(self.chunk("", [], _tool_finish(calls, finish)))
        return out

    def usage_chunk(self, c: gen.GenerateComplete) -> dict[str, Any]:
        out = self._envelope([], stream=True)
        out["usage"] = usage_dict(c)
        return out

    # whole response
    def full(
        self,
        text: str,
        lps: list[gen.TokenLogprob],
        c: gen.GenerateComplete,
        prompt: Sequence[gen.TokenLogprob] = (),
        index: int = 0,
    ) -> dict[str, Any]:
        """The whole response with this choice; `index`: which one (n > 1: its finish
        reason is the completion's entry for it)."""
        choice: dict[str, Any] = {"index": index}
        finish: str | None = choice_finish(c, index)
        echoed, entries, vllm = (
            self.prompt_part(prompt) if self.has_prompt_part else ("", None, None)
        )
        if self.tools is not None:
            content, calls = self.tools.parse(text)
            choice["message"] = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [call.to_openai() for call in calls],
            }
            finish = _tool_finish(calls, finish)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = echoed + text
        choice["logprobs"] = _joined(entries, self.logprobs(lps))
        choice["finish_reason"] = finish
        if vllm is not None and not self.chat:
            choice["prompt_logprobs"] = vllm
        out = self._envelope([choice], stream=False)
        if vllm is not None and self.chat:
            out["prompt_logprobs"] = vllm  # vLLM's chat response carries it at the top
        out["usage"] = usage_dict(c)
        return out
