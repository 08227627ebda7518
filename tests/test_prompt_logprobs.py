"""Prompt logprobs from the prompt pass (vLLM's `prompt_logprobs`; completions' `echo` with
`logprobs`, what lm-evaluation-harness sends for every loglikelihood task), on the real
default model against HF transformers' log-softmax, colocated and disaggregated.

In-process workers behind a started Router (`tests.in_process.run_with_workers`); the
disaggregated prompt pass runs on the prefill worker, which sends the prompt's logprobs back
with token #1. The HTTP shapes (echo's text and logprobs, vLLM's `prompt_logprobs` list) are
checked against the same reference through `pdserve serve`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.client import make_request
from pdserve.config import ServeConfig
from pdserve.models import DEFAULT_MODEL, resolve_model
from protos.pdserve.v1 import generation_pb2 as gen
from tests.in_process import run_with_workers
from tests.serve_proc import ServeProcess, shared_server

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)

PARAGRAPH = (
    "The city of Paris is the capital of France. It lies on the river Seine, in the north of "
    "the country, and has been a centre of trade, science and the arts for many centuries."
)
TOP = 3
TOL = 1e-4


@pytest.fixture(scope="module")
def real_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def reference(real_dir: Path) -> tuple[list[int], torch.Tensor]:
    """The paragraph's ids and HF float32's log-softmax at every position."""
    tok = transformers.AutoTokenizer.from_pretrained(real_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32)
    ids = tok(PARAGRAPH)["input_ids"]
    with torch.inference_mode():
        lp = torch.log_softmax(model.eval()(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, lp


def _prompt_logprobs(real_dir: Path, ids: list[int], colocated: bool) -> list[gen.TokenLogprob]:
    cfg = ServeConfig.load(
        None,
        {
            "model": {"model": str(real_dir)},
            "transfer": {"transport": "local"},
            "colocated": colocated,
            "scheduler": {"max_num_batched_tokens": 16},  # chunked: a prompt in 3 passes
            "cache": {"num_blocks": 128},  # room enough; the default is 754 MiB a worker
        },
    )
    got: list[gen.TokenLogprob] = []

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        request = make_request(ids, "plp", max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
        act = await router.admit(request)
        completed = False
        try:
            async for resp in router.run(act):
                if resp.HasField("chunk"):
                    got.extend(resp.chunk.prompt_logprobs)
                else:
                    completed = True
        finally:
            router.finish(act, completed)
        assert (prefill.num_requests_total == 0) == colocated  # where the prompt pass ran

    run_with_workers(cfg, real_dir, body)
    return got


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_prompt_logprobs_equal_hf_at_every_position(
    real_dir: Path, reference: tuple[list[int], torch.Tensor], mode: str
) -> None:
    ids, ref = reference
    got = _prompt_logprobs(real_dir, ids, mode == "colocated")
    assert len(got) == len(ids) - 1  # every position but the first, which has none
    for p, lp in enumerate(got, start=1):
        row = ref[p - 1]
        assert lp.token_id == ids[p]
        assert abs(lp.logprob - float(row[ids[p]])) < TOL, p
        assert lp.rank == int((row > row[ids[p]]).sum()) + 1, p
        want = row.topk(TOP)
        assert [t.token_id for t in lp.top] == want.indices.tolist(), p
        for t, v in zip(lp.top, want.values.tolist(), strict=True):
            assert abs(t.logprob - v) < TOL


# ---- HTTP shapes --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    return shared_server("default-model-server", tmp_path_factory)


def _post(server: ServeProcess, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200, raw
    return dict(json.loads(raw))


def test_echo_with_logprobs_scores_the_prompt(
    server: ServeProcess, reference: tuple[list[int], torch.Tensor]
) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt leads the text and the
    logprobs (its first token with none), each prompt token's logprob HF's."""
    ids, ref = reference
    body = {"prompt": PARAGRAPH, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    choice = _post(server, body)["choices"][0]
    assert choice["text"].startswith(PARAGRAPH) and len(choice["text"]) > len(PARAGRAPH)
    lps = choice["logprobs"]
    n = len(ids)
    assert len(lps["tokens"]) == n + 1 and lps["token_logprobs"][0] is None
    assert lps["top_logprobs"][0] is None
    for p in range(1, n):
        assert abs(lps["token_logprobs"][p] - float(ref[p - 1][ids[p]])) < TOL, p
    assert lps["text_offset"] == sorted(lps["text_offset"]) and lps["text_offset"][0] == 0
    assert "".join(lps["tokens"]) == choice["text"]


def test_vllm_prompt_logprobs_shape(
    server: ServeProcess, reference: tuple[list[int], torch.Tensor]
) -> None:
    """vLLM's `prompt_logprobs`: None first, then per position {token id: {logprob, rank,
    decoded_token}} of the prompt's token and the top-N; streamed, with the first chunk."""
    ids, ref = reference
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    plp = _post(server, body)["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert abs(entry["logprob"] - float(ref[p - 1][ids[p]])) < TOL
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        assert len(plp[p]) in (2, 3)  # the top 2, plus the prompt's token when not in them
    status, _, raw = server.request("POST", "/v1/completions", {**body, "stream": True})
    assert status == 200, raw
    first = json.loads(raw.decode().split("\n\n")[0].removeprefix("data: "))
    assert first["choices"][0]["prompt_logprobs"] == plp
