"""n > 1 and best_of through the service, on the real default model, colocated and
disaggregated (in-process workers behind a started Router, `tests.in_process`).

What must hold: a seeded n = 4 request gives four different choices, the same four on a
second call, choice i being the n = 1 request with seed + i, and the same choices whether
colocated or disaggregated; greedy n = 4 gives four copies of the n = 1 answer; the prompt
is computed and transferred once (the prefill worker's request count, the KV bytes of one
transfer, the router's prompt-token counter); usage counts the prompt once; best_of keeps the
choice with the highest cumulative logprob; the HTTP shapes are OpenAI's and vLLM's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.client import make_request
from pdserve.config import ServeConfig
from pdserve.models import DEFAULT_MODEL, resolve_model
from protos.pdserve.v1 import generation_pb2 as gen
from router.http import create_app
from router.metrics import RouterMetrics
from tests.in_process import all_of, asgi_request, run_with_workers

pytestmark = pytest.mark.timeout(600)

PROMPT = "Write one sentence about the sea."
SEEDED = {"temperature": 0.8, "seed": 7, "max_tokens": 16, "ignore_eos": True}
# raw ids, two of the same length and no shared prefix: the transfer's size is the prompt's
IDS_A = [1000 + 7 * i for i in range(40)]
IDS_B = [2000 + 7 * i for i in range(40)]


class Answer:
    """One request's answer: each choice's tokens, text, logprobs and finish reason."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.finish: dict[int, int] = {}
        self.complete = gen.GenerateComplete()
        self.kv_bytes = 0

    def add(self, c: gen.GenerateChunk) -> None:
        self.tokens.setdefault(c.index, []).extend(c.token_ids)
        self.text[c.index] = self.text.get(c.index, "") + c.text
        self.logprobs.setdefault(c.index, []).extend(lp.logprob for lp in c.logprobs)
        if c.finish_reason:
            self.finish[c.index] = c.finish_reason

    @property
    def choices(self) -> list[list[int]]:
        return [self.tokens[i] for i in sorted(self.tokens)]


async def _ask(router: Any, request: gen.GenerateRequest) -> Answer:
    act = await router.admit(request)
    out = Answer()
    completed = False
    try:
        async for resp in router.run(act):
            if resp.HasField("chunk"):
                out.add(resp.chunk)
            else:
                out.complete, completed = resp.complete, True
    finally:
        router.finish(act, completed)
    out.kv_bytes = act.kv_transfer_bytes
    return out


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def _http(app: Any, path: str, body: dict[str, Any]) -> Any:
    status, _, raw = await asgi_request(app, "POST", path, body)
    assert status == 200, raw
    if not body.get("stream"):
        return json.loads(raw)
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


Body = Callable[[Any, Any, Any], Any]


def _serve(real_dir: Path, colocated: bool, body: Body) -> None:
    cfg = ServeConfig.load(
        None,
        {
            "model": {"model": str(real_dir)},
            "transfer": {"transport": "local"},
            "colocated": colocated,
            "cache": {"num_blocks": 128},  # room enough; the default 1024 is 754 MiB a worker
            # every prompt pass on the prefill side
            "router": {"policy": {"local_prefill_threshold": 0}},
        },
    )
    run_with_workers(cfg, real_dir, body)


@pytest.fixture(scope="module")
def real_dir() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def answers(real_dir: Path) -> dict[str, dict[str, Any]]:
    """Every request of this module's gRPC-level checks, in each mode."""
    out: dict[str, dict[str, Any]] = {}
    for mode in ("disaggregated", "colocated"):
        got: dict[str, Any] = {}

        async def body(router: Any, prefill: Any, decode: Any, got: dict[str, Any] = got) -> None:
            metrics = RouterMetrics.install(router)
            before = prefill.num_requests_total
            got["n4_ids"] = await _ask(router, make_request(IDS_A, n=4, **SEEDED))
            got["prefill_requests"] = prefill.num_requests_total - before
            got["prompt_tokens_counted"] = _metric(
                metrics.render().decode(), "pdserve:prompt_tokens_total"
            )
            calls = {
                "n1_ids": _ask(router, make_request(IDS_B, **SEEDED)),
                "s4": _ask(router, make_request(PROMPT, n=4, **SEEDED)),
                "s4_again": _ask(router, make_request(PROMPT, n=4, **SEEDED)),
            }
            for i in range(4):
                seeded = {**SEEDED, "seed": SEEDED["seed"] + i}
                calls[f"s1_{i}"] = _ask(router, make_request(PROMPT, **seeded))
            greedy = {"temperature": 0.0, "max_tokens": 12}
            calls["g4"] = _ask(router, make_request(PROMPT, n=4, **greedy))
            calls["g1"] = _ask(router, make_request(PROMPT, **greedy))
            three = {**SEEDED, "seed": 11}
            calls["n3_lp"] = _ask(router, make_request(PROMPT, n=3, logprobs=0, **three))
            calls["best_of3"] = _ask(router, make_request(PROMPT, best_of=3, **three))
            calls["best2_of3"] = _ask(router, make_request(PROMPT, n=2, best_of=3, **three))
            choice = make_request(PROMPT, n=3, **{**SEEDED, "max_tokens": 8})
            choice.structured_output.choice.choices.extend(["yes", "no", "maybe"])
            calls["choice"] = _ask(router, choice)
            got.update(await all_of((prefill, decode), calls))
            if not router.colocated:
                got["http"] = await _http_answers(create_app(router))

        _serve(real_dir, mode == "colocated", body)
        out[mode] = got
    return out


async def _http_answers(app: Any) -> dict[str, Any]:
    seeded = {"temperature": 0.8, "seed": 5, "max_tokens": 8, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": PROMPT}], "n": 2, **seeded}
    return {
        "completions": await _http(app, "/v1/completions", {"prompt": PROMPT, "n": 2, **seeded}),
        "chat": await _http(app, "/v1/chat/completions", chat),
        "chat_stream": await _http(app, "/v1/chat/completions", {**chat, "stream": True}),
        "batch": await _http(
            app, "/v1/completions", {"prompt": [PROMPT, "The sky is"], "n": 2, **seeded}
        ),
        "sky": await _http(app, "/v1/completions", {"prompt": "The sky is", "n": 2, **seeded}),
        "echo": await _http(
            app, "/v1/completions", {"prompt": PROMPT, "n": 2, "echo": True, **seeded}
        ),
    }


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_seeded_choices_differ_reproduce_and_follow_seed_plus_i(
    answers: dict[str, dict[str, Any]], mode: str
) -> None:
    got = answers[mode]
    s4: Answer = got["s4"]
    assert len(s4.choices) == 4 and all(len(c) == 16 for c in s4.choices)
    assert len({tuple(c) for c in s4.choices}) == 4, s4.text
    assert got["s4_again"].choices == s4.choices
    assert [got[f"s1_{i}"].choices[0] for i in range(4)] == s4.choices
    assert s4.finish == {i: gen.FINISH_REASON_LENGTH for i in range(4)}
    assert list(s4.complete.choice_finish_reasons) == [gen.FINISH_REASON_LENGTH] * 4
    assert all(s4.text[i] for i in range(4))


def test_disaggregated_choices_equal_colocated(answers: dict[str, dict[str, Any]]) -> None:
    """The prefill worker samples each choice's first token and the decode worker continues
    its seeded stream: the same tokens as one engine that does both."""
    for key in ("s4", "g4", "n3_lp", "choice"):
        assert answers["disaggregated"][key].choices == answers["colocated"][key].choices, key


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_greedy_choices_are_the_n1_answer(answers: dict[str, dict[str, Any]], mode: str) -> None:
    got = answers[mode]
    assert got["g4"].choices == [got["g1"].choices[0]] * 4


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_one_prompt_pass_one_transfer_and_usage_counts_the_prompt_once(
    answers: dict[str, dict[str, Any]], mode: str
) -> None:
    got = answers[mode]
    n4, n1 = got["n4_ids"], got["n1_ids"]
    usage = n4.complete.usage
    assert usage.prompt_tokens == len(IDS_A)
    assert usage.completion_tokens == 4 * 16
    assert got["prompt_tokens_counted"] == len(IDS_A)  # the router's counter: once
    if mode == "disaggregated":
        assert got["prefill_requests"] == 1  # one prompt pass for the four choices
        assert n4.kv_bytes == n1.kv_bytes > 0  # one transfer, the size of an n = 1 prompt's
    else:
        assert got["prefill_requests"] == 0


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_best_of_keeps_the_highest_cumulative_logprob(
    answers: dict[str, dict[str, Any]], mode: str
) -> None:
    got = answers[mode]
    cands = got["n3_lp"]
    ranked = sorted(range(3), key=lambda i: (-sum(cands.logprobs[i]), i))
    best = got["best_of3"]
    assert best.choices == [cands.tokens[ranked[0]]]
    assert best.logprobs == {0: []}  # not asked for: not returned
    assert best.complete.usage.completion_tokens == 3 * 16  # every generated token
    assert got["best2_of3"].choices == [cands.tokens[i] for i in ranked[:2]]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_each_choice_follows_the_grammar(answers: dict[str, dict[str, Any]], mode: str) -> None:
    choice = answers[mode]["choice"]
    assert sorted(choice.text) == [0, 1, 2]
    assert all(t in ("yes", "no", "maybe") for t in choice.text.values()), choice.text


def test_http_n_choices(answers: dict[str, dict[str, Any]]) -> None:
    """OpenAI's shapes: n choices indexed 0 .. n-1, usage with the prompt once; a batch of
    prompts numbers prompt i's choice j as i * n + j (vLLM); echo leads every choice."""
    http = answers["disaggregated"]["http"]
    comp = http["completions"]
    assert [c["index"] for c in comp["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in comp["choices"])
    assert comp["usage"]["completion_tokens"] == 16
    batch = http["batch"]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in batch["choices"][:2]] == [c["text"] for c in comp["choices"]]
    assert [c["text"] for c in batch["choices"][2:]] == [c["text"] for c in http["sky"]["choices"]]
    assert batch["usage"]["prompt_tokens"] == (
        comp["usage"]["prompt_tokens"] + http["sky"]["usage"]["prompt_tokens"]
    )
    texts = [c["text"] for c in comp["choices"]]
    assert [c["text"] for c in http["echo"]["choices"]] == [PROMPT + t for t in texts]


def test_http_chat_stream_interleaves_choices_by_index(
    answers: dict[str, dict[str, Any]],
) -> None:
    http = answers["disaggregated"]["http"]
    whole = http["chat"]
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    content: dict[int, str] = {0: "", 1: ""}
    roles: list[int] = []
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in http["chat_stream"]:
        [c] = chunk["choices"]
        delta = c["delta"]
        if delta.get("role") == "assistant":
            roles.append(c["index"])
        content[c["index"]] += delta.get("content") or ""
        if c["finish_reason"]:
            finishes[c["index"]].append(c["finish_reason"])
    assert sorted(roles) == [0, 1]
    assert finishes == {0: ["length"], 1: ["length"]}
    assert [content[0], content[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert re.fullmatch(r"chatcmpl-\w+", http["chat_stream"][0]["id"])
