"""One request's choices (n >= 1) as OpenAI's JSON: a `Formatter` per choice, the router's
chunks routed to them by `index`, and each choice's end.

A choice ends at the chunk that carries its finish reason (n > 1), or at the completion
(n = 1, and any choice still open when an abort ends the request). The prompt's logprobs
come once, with choice 0's first chunk; every choice's prompt part (echo, vLLM's
prompt_logprobs) is made from them. A batch of prompts numbers its choices across them
(`base`: prompt i's first choice is i * n, as vLLM numbers them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sampling import InvalidParameterError
from engine.tokenizer import Tokenizer
from protos.pdserve.v1 import generation_pb2 as gen
from router.openai.base import bad_request
from router.openai.format import Formatter, choice_finish, finish_name
from router.openai.protocol import StreamOptions
from router.openai.tools import ToolPlan
from router.validation import check_choices


def renumbered(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    """A chunk (or a response) whose one choice is numbered `index`."""
    chunk["choices"] = [{**c, "index": index} for c in chunk["choices"]]
    return chunk


@dataclass
class Choices:
    """The formatters of one request's choices (one per choice, made alike)."""

    fmts: list[Formatter]
    base: int = 0  # the response's index of choice 0
    prompt: list[gen.TokenLogprob] = field(default_factory=list)
    _held: dict[int, list[str]] = field(default_factory=dict)  # tools: text read at the end
    _ended: set[int] = field(default_factory=set)

    @classmethod
    def of(
        cls,
        model: str,
        tokenizer: Tokenizer | None,
        max_n: int,
        chat: bool,
        response_id: str,
        opts: StreamOptions,
        body: dict[str, Any],
        greq: gen.GenerateRequest,
        base: int = 0,
        tools: ToolPlan | None = None,
    ) -> Choices:
        """A formatter for each of the request's `n` choices; `base`: its first choice's
        index in the response (a batch of prompts numbers them across the prompts). `n` and
        `best_of` are bounded first (a 400 naming the field), before anything is built."""
        s = greq.sampling
        try:
            check_choices(s, max_n)
        except InvalidParameterError as e:
            raise bad_request(e.field, str(e)) from e
        if opts.stream and s.HasField("best_of") and s.best_of > (s.n or 1):
            raise bad_request(
                "best_of", "best_of > n cannot be streamed (the best are known at the end)"
            )
        fmts = []
        for _ in range(max(s.n, 1)):
            fmt = Formatter(
                chat,
                response_id,
                model,
                tokenizer,
                opts.include_usage,
                token_ids_as_tokens=opts.return_tokens_as_token_ids,
            ).asked(body)
            fmt.tools = tools
            fmts.append(fmt)
        return cls(fmts, base)

    def admitted(self, prompt_ids: Sequence[int], request: gen.GenerateRequest) -> None:
        for fmt in self.fmts:
            fmt.admitted(prompt_ids, request)

    # ---- streaming -----------------------------------------------------------------------
    def opening(self) -> list[dict[str, Any]]:
        """Chat: each choice's first chunk names the assistant's role."""
        if not self.fmts[0].chat:
            return []
        return [self._numbered(f.chunk("", [], role=True), i) for i, f in enumerate(self.fmts)]

    def streamed(self, resp: gen.GenerateResponse) -> list[dict[str, Any]]:
        """The chunks to send for one router response (a completion ends open choices)."""
        if resp.HasField("complete"):
            open_ = [i for i in range(len(self.fmts)) if i not in self._ended]
            return [x for i in open_ for x in self._end(i, choice_finish(resp.complete, i))]
        c = resp.chunk
        self.prompt.extend(c.prompt_logprobs)
        fmt, out = self.fmts[c.index], []
        if fmt.streams_arguments:
            if c.text:
                out.append(fmt.arguments_chunk(c.text))
        elif fmt.tools is not None:
            self._held.setdefault(c.index, []).append(c.text)
        elif (chunk := fmt.of_chunk(c, self.prompt)) is not None:
            out.append(chunk)
        out = [self._numbered(x, c.index) for x in out]
        if c.finish_reason:  # n > 1: this choice's last chunk
            out += self._end(c.index, finish_name(c.finish_reason))
        return out

    def _end(self, i: int, finish: str) -> list[dict[str, Any]]:
        self._ended.add(i)
        fmt = self.fmts[i]
        if fmt.tools is not None:
            out = fmt.tool_chunks("".join(self._held.pop(i, [])), finish)
        else:
            out = [fmt.chunk("", [], finish)]
        return [self._numbered(x, i) for x in out]

    def _numbered(self, chunk: dict[str, Any], i: int) -> dict[str, Any]:
        return renumbered(chunk, self.base + i) if self.base + i else chunk

    # ---- whole responses -----------------------------------------------------------------
    def body(
        self,
        texts: dict[int, list[str]],
        lps: dict[int, list[gen.TokenLogprob]],
        prompt: Sequence[gen.TokenLogprob],
        done: gen.GenerateComplete,
    ) -> dict[str, Any]:
        """The whole response: every choice, numbered from `base`, and the request's usage
        (the prompt counted once)."""
        bodies = [
            f.full("".join(texts.get(i, [])), lps.get(i, []), done, prompt, index=i)
            for i, f in enumerate(self.fmts)
        ]
        out = bodies[0]
        out["choices"] = [{**b["choices"][0], "index": self.base + i} for i, b in enumerate(bodies)]
        return out


async def collected(choices: Choices, stream: Any) -> dict[str, Any] | None:
    """Read a request's responses to the end: its whole response, or None when the stream
    ended without a completion."""
    texts: dict[int, list[str]] = {}
    lps: dict[int, list[gen.TokenLogprob]] = {}
    prompt: list[gen.TokenLogprob] = []
    async for resp in stream:
        if resp.HasField("chunk"):
            c = resp.chunk
            texts.setdefault(c.index, []).append(c.text)
            lps.setdefault(c.index, []).extend(c.logprobs)
            prompt.extend(c.prompt_logprobs)
        else:
            return choices.body(texts, lps, prompt, resp.complete)
    return None
