"""The OpenAI-compatible HTTP API end to end, driven by the official `openai` package.

One `pdserve serve --grpc-port 0 --http-port 0` subprocess (tiny preset, temporary
PDSERVE_HOME) serves the module. Greedy text over HTTP must equal the gRPC result for the same
prompt (chat: the chat-template-rendered prompt), usage must count right (a repeated long
prompt hits the prefix cache), errors keep OpenAI's shape and status, and a client that
disconnects mid-stream frees its request on both pools.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from engine.validation import context_length_message
from pdserve.client import Client
from tests.in_process import asgi_call, router_without_workers
from tests.serve_proc import ServeProcess, shared_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(420)  # the first test includes the server's start

MAX_TOKENS = 12
MAX_MODEL_LEN = 2048  # the tiny preset's context window
PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on different workers.",
]
LONG_PROMPT = " ".join(f"word{i} and the next one" for i in range(40))  # ~ 200+ tokens


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    return shared_server("tiny-server", tmp_path_factory)


@pytest.fixture(scope="module")
def oa(server: ServeProcess) -> Any:
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def grpc_client(server: ServeProcess) -> Iterator[Client]:
    c = Client(server.grpc_target, timeout_s=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(server: ServeProcess) -> Tokenizer:
    path = Path(server.home) / "models" / "tiny-seed0-float32"  # what `--model tiny` resolved
    return Tokenizer.from_dir(path, ModelConfig.from_hf(path))


def greedy(**kw: Any) -> dict[str, Any]:
    return dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}, **kw)


def grpc_greedy(client: Client, prompt: str | list[int]) -> Any:
    out = client.generate(prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert out.complete is not None
    return out


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def metric_sum(server: ServeProcess, name: str, role: str) -> float:
    """The sum of `name`'s samples labelled `role` (0 when there is none yet)."""
    return sum(
        v
        for (n, labels), v in samples(server.metrics_text()).items()
        if n == name and dict(labels).get("role") == role
    )


# ---- tests --------------------------------------------------------------------------------
def test_health_and_models(server: ServeProcess, oa: Any) -> None:
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    models = oa.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completions_match_grpc(oa: Any, grpc_client: Client) -> None:
    for prompt in PROMPTS:
        ref = grpc_greedy(grpc_client, prompt)
        resp = oa.completions.create(model="tiny", prompt=prompt, **greedy())
        [choice] = resp.choices
        assert choice.text == ref.text, prompt
        assert choice.finish_reason == "length"
        assert resp.object == "text_completion" and resp.model == "tiny"
        assert resp.usage.prompt_tokens == ref.complete.usage.prompt_tokens
        assert resp.usage.completion_tokens == MAX_TOKENS
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + MAX_TOKENS
        assert resp.usage.prompt_tokens_details.cached_tokens >= 0

        chunks = list(
            oa.completions.create(
                model="tiny",
                prompt=prompt,
                stream=True,
                stream_options={"include_usage": True},
                **greedy(),
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.text, prompt
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert chunks[-1].usage.prompt_tokens == ref.complete.usage.prompt_tokens
        assert all(c.usage is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1


def test_chat_matches_grpc(oa: Any, grpc_client: Client, tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    # the template's ids, no BOS added on top: HF's apply_chat_template(tokenize=True)
    ref = grpc_greedy(grpc_client, tokenizer.encode_chat(messages))
    resp = oa.chat.completions.create(model="tiny", messages=messages, **greedy())
    [choice] = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert resp.object == "chat.completion"
    assert resp.usage.prompt_tokens == ref.complete.usage.prompt_tokens
    assert resp.usage.completion_tokens == MAX_TOKENS

    chunks = list(
        oa.chat.completions.create(
            model="tiny",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(max_completion_tokens=MAX_TOKENS),
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_cached_tokens_on_repeated_prompt(oa: Any) -> None:
    first = oa.completions.create(model="tiny", prompt=LONG_PROMPT, **greedy())
    second = oa.completions.create(model="tiny", prompt=LONG_PROMPT, **greedy())
    n = first.usage.prompt_tokens
    assert n > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < n, (cached, n)
    assert second.choices[0].text == first.choices[0].text


def test_logprobs_seed_and_stop(oa: Any) -> None:
    resp = oa.completions.create(model="tiny", prompt=PROMPTS[1], logprobs=2, **greedy())
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)

    chat = oa.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=3,
        **greedy(),
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    assert all(len(c.top_logprobs) == 3 for c in content)

    sampled = [
        oa.completions.create(
            model="tiny", prompt=PROMPTS[0], temperature=1.0, top_p=0.9, seed=1234, max_tokens=8
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]

    full = oa.completions.create(model="tiny", prompt=PROMPTS[0], **greedy()).choices[0].text
    stop = full[4:6]
    assert stop.strip(), full
    cut = oa.completions.create(model="tiny", prompt=PROMPTS[0], stop=[stop], **greedy())
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]


def test_context_length_error_verbatim(oa: Any, tokenizer: Tokenizer) -> None:
    prompt = "hello world " * 100
    n = len(tokenizer.encode(prompt))
    max_tokens = MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["message"] == context_length_message(MAX_MODEL_LEN, n, max_tokens)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "prompt"
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, "best_of"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "hi", "echo": "yes"}, "echo"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),  # a batch mixing strings and id lists
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": [1, 2, 1 << 20]}, "prompt_token_ids"),
        # bounded before anything is built for the choices (a formatter each)
        ({"prompt": "hi", "n": 2_000_000_000}, "n"),
        ({"prompt": ["a", "b"], "best_of": 2_000_000_000}, "best_of"),
        ({"prompt": "hi", "request_id": "a\u001fb"}, "request_id"),
    ],
)
def test_completion_bad_requests(server: ServeProcess, body: dict[str, Any], param: str) -> None:
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def test_a_chat_with_too_many_choices_is_refused_at_once(server: ServeProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2_000_000_000}
    status, _, raw = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "n", raw


def test_malformed_bodies(server: ServeProcess, oa: Any) -> None:
    for raw in (b'{"prompt": "hi",', b'{"prompt": "\xff\xfe"}', b"[1, 2]", b"NaN", b""):
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, _, body = server.request("POST", path, raw)
            assert status == 400, (raw, path, body)
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = server.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as info:
        oa.completions.create(model="not-served", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    status, _, body = server.request("GET", "/v1/nope")
    assert status == 404 and "error" in json.loads(body)


def test_disconnect_mid_stream_frees_request(server: ServeProcess, oa: Any) -> None:
    def idle() -> bool:
        s = samples(server.metrics_text())
        running = sum(
            v
            for (n, _), v in s.items()
            if n in ("pdserve:num_requests_running", "pdserve:num_requests_waiting")
        )
        usage = [v for (n, _), v in s.items() if n == "pdserve:kv_cache_usage_perc"]
        return running == 0 and len(usage) == 2 and sum(usage) == 0

    assert server.wait_for(idle, 20), "server not idle before the test"
    done_before = metric_sum(server, "pdserve:request_success_total", "router")
    stream = oa.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=MAX_MODEL_LEN - 64,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].text) > 0
        if got >= 5:  # the decode worker is running it now
            break
    assert server.wait_for(
        lambda: metric_sum(server, "pdserve:num_requests_running", "decode") == 1, 5
    )
    stream.close()
    # ~2000 tokens take far longer than this: idle now means the request was cancelled
    assert server.wait_for(idle, 8), server.metrics_text()
    # a client that left counts once, as an abort (vLLM's finished_reason="abort")
    assert metric_sum(server, "pdserve:request_success_total", "router") == done_before + 1

    # the same for a client that gives up on a non-streaming answer
    body = json.dumps(
        {"prompt": PROMPTS[2], "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}
    ).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert server.wait_for(
            lambda: metric_sum(server, "pdserve:num_requests_running", "decode") == 1, 10
        )
    assert server.wait_for(idle, 8), server.metrics_text()
    assert metric_sum(server, "pdserve:request_success_total", "router") == done_before + 2


# ---- in process, no server ----------------------------------------------------------------
def _router(**cfg: Any) -> Any:
    from router.config import RouterConfig

    return router_without_workers(
        RouterConfig(**cfg), num_free_blocks=6, num_running=1, num_requests_total=3
    )


def _asgi(app: Any, method: str, path: str, headers: dict[str, str] | None = None) -> Any:
    status, _, body = asgi_call(app, method, path, headers=headers)
    return status, body


def test_health_503_when_draining_or_not_ready() -> None:
    from router.config import PolicySettings
    from router.http import create_app

    router = _router()
    app = create_app(router)
    assert _asgi(app, "GET", "/health")[0] == 200
    router.draining = True
    status, body = _asgi(app, "GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "draining"
    router.draining = False
    router.decode.workers[0].healthy = False
    assert _asgi(app, "GET", "/health")[0] == 503
    router.decode.workers[0].healthy = True
    router.prefill.workers[0].stats = None  # never answered yet: prompts prefill on decode
    status, body = _asgi(app, "GET", "/health")  # workers (`recompute`): serving, degraded
    assert status == 200 and json.loads(body)["status"] == "degraded", body
    assert "no prefill worker" in " ".join(json.loads(body)["degraded"])
    fail = _router(policy=PolicySettings(prefill_failure_policy="fail"))
    fail.prefill.workers[0].stats = None
    assert _asgi(create_app(fail), "GET", "/health")[0] == 503  # `fail`: nothing can serve


def test_auth_and_metrics_in_process() -> None:
    from router.http import create_app

    router = _router(api_key="k-123")
    app = create_app(router)
    assert _asgi(app, "GET", "/v1/models")[0] == 401
    assert _asgi(app, "GET", "/v1/models", {"Authorization": "Bearer nope"})[0] == 401
    status, body = _asgi(app, "GET", "/v1/models", {"Authorization": "Bearer k-123"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == "m"
    status, body = _asgi(app, "GET", "/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    usage = {s.labels["worker"]: s.value for s in fams["pdserve:kv_cache_usage_perc"].samples}
    assert usage == {"pdserve-prefill-0": 0.25, "pdserve-decode-0": 0.25}
    assert "k-123" not in repr(router.cfg)


def test_failure_mapping() -> None:
    import grpc

    from router.active import RequestFailed
    from router.http import from_failed

    busy = from_failed(RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    assert (busy.status, busy.headers.get("Retry-After"), busy.code) == (
        429,
        "1",
        "rate_limit_exceeded",
    )
    down = from_failed(RequestFailed(grpc.StatusCode.UNAVAILABLE, "server is draining"))
    assert (down.status, down.type, down.message) == (503, "server_error", "server is draining")
    auth = from_failed(RequestFailed(grpc.StatusCode.UNAUTHENTICATED, "no key"))
    assert auth.status == 401
    assert from_failed(RequestFailed(grpc.StatusCode.NOT_FOUND, "no such model")).status == 404


def test_an_app_that_is_gone_leaves_its_router_collectable() -> None:
    """FastAPI caches every endpoint's signature, keyed on the callable, in module-level
    caches: endpoints bound to the router's objects kept each app's router (and the workers
    a test or the census hosts in-process) alive for as long as the process lived."""
    import gc
    import weakref

    from router.config import RouterConfig
    from router.http import create_app

    router = router_without_workers(RouterConfig())
    app = create_app(router)
    status, _, _ = asgi_call(app, "GET", "/v1/models")  # its routes ran, their caches filled
    assert status == 200
    ref = weakref.ref(router)
    del app, router
    gc.collect()
    assert ref() is None, "something still holds the router of an app that is gone"
