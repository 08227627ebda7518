"""Shaping the router's state into `pdserve.v1` responses; pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import FinishReason
from engine.sampling import TokenLogprob
from pool_api.token_stream import FINISH_TO_PROTO, logprob_pb, prompt_logprobs_pb
from protos.pdserve.v1 import generation_pb2 as gen
from router.active import ActiveRequest


def chunk(
    request_id: str,
    ids: Sequence[int],
    text: str,
    logprobs: Sequence[TokenLogprob],
    prompt_logprobs: Sequence[TokenLogprob | None] = (),
    index: int = 0,
    finish: FinishReason | None = None,
) -> gen.GenerateResponse:
    """`index`, `finish`: the choice, and (n > 1) its finish reason on its last chunk."""
    return gen.GenerateResponse(
        request_id=request_id,
        chunk=gen.GenerateChunk(
            token_ids=list(ids),
            text=text,
            logprobs=[logprob_pb(lp) for lp in logprobs],
            prompt_logprobs=prompt_logprobs_pb(prompt_logprobs),
            index=index,
            finish_reason=FINISH_TO_PROTO[finish] if finish is not None else None,
        ),
    )


def complete(act: ActiveRequest, reason: FinishReason) -> gen.GenerateResponse:
    """The request's last message: why it ended, usage, where its time went and who ran it."""
    t = act.timings
    first = act.first_sent_s
    ttft = (first - act.arrival_s) * 1e3 if first else 0.0
    decode = (act.last_sent_s - first) * 1e3 if first and act.last_sent_s else 0.0
    return gen.GenerateResponse(
        request_id=act.request_id,
        complete=gen.GenerateComplete(
            finish_reason=FINISH_TO_PROTO[reason],
            usage=gen.Usage(
                prompt_tokens=act.num_prompt_tokens,
                completion_tokens=act.num_sent,
                cached_tokens=act.cached_tokens,
            ),
            timings=gen.Timings(
                queue_ms=t.queue_ms or 0.0,
                prefill_ms=t.prefill_ms or 0.0,
                transfer_ms=t.transfer_ms or 0.0,
                ttft_ms=ttft,
                decode_ms=decode,
            ),
            prefill_worker=act.prefill.name if act.prefill else "",
            decode_worker=act.decode.name if act.decode else "",
            choice_finish_reasons=(
                [FINISH_TO_PROTO[act.choices_ended.get(i, reason)] for i in range(act.num_seqs)]
                if act.num_seqs > 1
                else []
            ),
        ),
    )
