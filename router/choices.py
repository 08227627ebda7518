"""best_of: of a request's sequences, return the n with the highest cumulative logprob.

The workers run `best_of` sequences from the prompt's one pass (`SamplingParams.n`); the
router holds their chunks until every one has ended, ranks them by the sum of their
tokens' logprobs (vLLM's `cumulative_logprob`; ties keep the lower index), and sends the
winners as choices 0 .. n-1: one chunk each with all its tokens, then the completion. The
sampled tokens' logprobs are always computed for this (`router.validation` asks for them);
a request that did not ask for logprobs gets none. Usage counts every generated token, as
OpenAI bills best_of.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from protos.pdserve.v1 import generation_pb2 as gen
from router.active import ActiveRequest

Responses = AsyncIterator[gen.GenerateResponse]


def _merged(chunks: list[gen.GenerateChunk]) -> gen.GenerateChunk:
    out = gen.GenerateChunk()
    for c in chunks:
        out.token_ids.extend(c.token_ids)
        out.text += c.text
        out.logprobs.extend(c.logprobs)
        out.prompt_logprobs.extend(c.prompt_logprobs)
    return out


def ranked(chunks: dict[int, list[gen.GenerateChunk]], num_seqs: int) -> list[int]:
    """Sequence indexes, best first: by cumulative logprob, ties to the lower index."""

    def cumulative(i: int) -> float:
        return sum(lp.logprob for c in chunks.get(i, []) for lp in c.logprobs)

    return sorted(range(num_seqs), key=lambda i: (-cumulative(i), i))


async def best_of(act: ActiveRequest, stream: Responses) -> Responses:
    """`stream`'s responses with the best `act.n` of its sequences as its choices."""
    hide_logprobs = act.request.params.logprobs == 0 and not act.asked_logprobs
    try:
        async for resp in _ranked(act, stream, hide_logprobs):
            yield resp
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # the flow's own cleanup now


async def _ranked(act: ActiveRequest, stream: Responses, hide_logprobs: bool) -> Responses:
    chunks: dict[int, list[gen.GenerateChunk]] = {}
    prompt: list[gen.TokenLogprob] = []
    async for resp in stream:
        if resp.HasField("chunk"):
            c = resp.chunk
            prompt.extend(c.prompt_logprobs)  # choice 0's first chunk (once per request)
            del c.prompt_logprobs[:]
            chunks.setdefault(c.index, []).append(c)
            continue
        done = resp.complete
        if done.finish_reason != gen.FINISH_REASON_ABORT:
            reasons = list(done.choice_finish_reasons)
            winners = ranked(chunks, act.num_seqs)[: act.n]
            for new, old in enumerate(winners):
                c = _merged(chunks.get(old, []))
                c.index = new
                if new == 0:
                    c.prompt_logprobs.extend(prompt)
                if hide_logprobs:
                    del c.logprobs[:]
                if act.n > 1:
                    c.finish_reason = reasons[old]
                yield gen.GenerateResponse(request_id=resp.request_id, chunk=c)
            del done.choice_finish_reasons[:]
            if act.n > 1:
                done.choice_finish_reasons.extend(reasons[old] for old in winners)
            done.finish_reason = reasons[winners[0]]
        yield resp
