"""Limits at the edge: an oversized or malformed request is refused before it is tokenized,
with INVALID_ARGUMENT / 400 naming the field, never a 500, and never reaches a worker.

Unit checks of `router.validation.EdgeLimits` and `prepare`, then a matrix of bad requests
against a real `pdserve serve` (tiny preset: max_model_len 2048, so prompt text is bounded at
65536 characters and the HTTP body at about 1.4 MB).
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest

from engine.sampling import InvalidParameterError
from pdserve.client import Client, make_request
from protos.pdserve.v1 import generation_pb2 as gen
from router.config import RouterConfig
from router.validation import EdgeLimits, ModelLimits, prepare
from tests.serve_proc import ServeProcess, shared_server

LIMITS = EdgeLimits.of(RouterConfig(), 2048)


def _request(**fields: Any) -> gen.GenerateRequest:
    sampling = fields.pop("sampling", {})
    req = gen.GenerateRequest(sampling=gen.SamplingParams(**sampling), **fields)
    return req


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"text": "x" * 65537}, "prompt"),
        ({"token_ids": gen.TokenIds(ids=[1] * 2049)}, "prompt"),
        ({"model": "m" * 257}, "model"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
        ({"request_id": "r" * 257}, "request_id"),
        ({"text": "hi", "sampling": {"stop": ["a"] * 17}}, "stop"),
        ({"text": "hi", "sampling": {"stop": ["a" * 257]}}, "stop"),
        ({"text": "hi", "sampling": {"stop_token_ids": [1] * 257}}, "stop_token_ids"),
    ],
)
def test_edge_limits_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        LIMITS.check(_request(**fields))
    assert info.value.field == field


def test_within_the_limits_passes() -> None:
    LIMITS.check(_request(text="x" * 65536, sampling={"stop": ["a" * 256] * 16}))


def test_an_oversized_prompt_is_never_tokenized() -> None:
    class Untouchable:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise AssertionError("tokenized a prompt over the limit")

    with pytest.raises(InvalidParameterError, match="65536 are accepted"):
        prepare(_request(text="y" * 10**6), Untouchable(), ModelLimits("m", 512, 2048))  # type: ignore[arg-type]


def test_a_long_model_name_is_not_echoed_whole() -> None:
    with pytest.raises(LookupError) as info:
        prepare(_request(text="hi", model="n" * 200), None, ModelLimits("m", 512, 2048))
    assert len(str(info.value)) < 150


# ---- against a server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    return shared_server("tiny-server", tmp_path_factory)


def _post(
    server: ServeProcess, body: bytes | dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, dict[str, Any], float]:
    t0 = time.monotonic()
    status, _, raw = server.request("POST", path, body)
    return status, json.loads(raw or b"{}").get("error", {}), time.monotonic() - t0


BAD_HTTP: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("10 MB prompt", {"model": "tiny", "prompt": "z" * (10 << 20)}, None),
    ("100k-char prompt", {"model": "tiny", "prompt": "z" * 100_000}, "prompt"),
    ("deep JSON", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("depth 40", b'{"prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "x"),
    ("surrogate prompt", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("surrogate stop", b'{"prompt": "a", "stop": ["\\udfff"]}', "stop"),
    ("surrogate model", b'{"prompt": "a", "model": "\\ud800"}', "model"),
    ("surrogate salt", b'{"prompt": "a", "cache_salt": "\\ud83d"}', "cache_salt"),
    ("17 stops", {"prompt": "a", "stop": [str(i) for i in range(17)]}, "stop"),
    ("long stop", {"prompt": "a", "stop": ["s" * 300]}, "stop"),
    ("many stop ids", {"prompt": "a", "stop_token_ids": list(range(300))}, "stop_token_ids"),
    ("1 MB model", {"prompt": "a", "model": "m" * (1 << 20)}, "model"),
    ("long salt", {"prompt": "a", "cache_salt": "c" * 10_000}, "cache_salt"),
    ("3000 ids", {"prompt": list(range(1, 3001))}, "prompt"),
]


@pytest.mark.parametrize(("name", "body", "field"), BAD_HTTP, ids=[c[0] for c in BAD_HTTP])
def test_http_rejects_at_the_edge(
    server: ServeProcess, name: str, body: bytes | dict[str, Any], field: str | None
) -> None:
    status, error, elapsed_s = _post(server, body)
    assert status == 400, (name, error)
    assert error.get("param") == field, error
    assert len(error.get("message", "")) < 300
    assert elapsed_s < 2.0, f"{name}: {elapsed_s:.2f} s"


def test_chat_content_over_the_limit_is_refused_before_the_template(server: ServeProcess) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w" * 70_000}]}
    status, error, _ = _post(server, body, "/v1/chat/completions")
    assert (status, error.get("param")) == (400, "messages")


@pytest.mark.parametrize("num_messages", [20_000, 300])
def test_a_chat_too_long_for_the_model_names_messages(
    server: ServeProcess, num_messages: int
) -> None:
    """Many short messages whose rendered prompt is over a limit (the edge's character
    bound, or the context length once tokenized) are refused naming `messages`, the field
    the client sent, not `prompt` (which a chat client never sends)."""
    messages = [{"role": "user", "content": "hi there"}] * num_messages
    body = {"model": "tiny", "messages": messages}
    status, error, _ = _post(server, body, "/v1/chat/completions")
    assert (status, error.get("param")) == (400, "messages"), error


def test_health_answers_while_a_huge_prompt_is_half_sent(server: ServeProcess) -> None:
    """A 10 MB body stalled halfway holds no lock and no event-loop turn: /health answers
    while it waits, and the finished body is still a 400. (A timing bound on /health under a
    flood of such bodies measured the shared machine, not the server: it failed CI at 101 ms.)
    """
    import socket
    from urllib.parse import urlsplit

    assert server.ssl_context is None, "this check speaks plain HTTP"
    url = urlsplit(server.base_url)
    body = json.dumps({"model": "tiny", "prompt": "q" * (10 << 20)}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as upload:
        upload.sendall(head + body[: len(body) // 2])
        for _ in range(3):  # the upload is mid-body all along: the server has not answered it
            status, _, raw = server.request("GET", "/health", timeout_s=10)
            assert status == 200, raw
        upload.settimeout(0.0)
        with pytest.raises(BlockingIOError):  # nothing has come back on the upload yet
            upload.recv(1)
        upload.settimeout(30)
        upload.sendall(body[len(body) // 2 :])
        answer = b""
        while chunk := upload.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"request body is over" in answer


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"prompt": "z" * 100_000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": list(range(1, 3001))}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "a", "cache_salt": "c" * 1000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "a", "stop": ["x"] * 100}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": "z" * (16 << 20)}, grpc.StatusCode.RESOURCE_EXHAUSTED),  # over the receive size
    ],
)
def test_grpc_rejects_at_the_edge(
    server: ServeProcess, kwargs: dict[str, Any], code: grpc.StatusCode
) -> None:
    client = Client(server.grpc_target, timeout_s=10)
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(make_request(prompt, **kwargs)))
    assert info.value.code() == code, info.value.details()
    assert len(info.value.details() or "") < 300
    # and the server still serves
    assert client.generate("still here", max_tokens=2).complete is not None


# ---- the fuzz matrix -----------------------------------------------------------------------
# Every case is one field of an otherwise valid request set to a bad (or odd) value. The
# server may accept it (200, a full answer) or refuse it (400 naming that field); it must
# never answer 500, never hang, and nothing may stay held afterwards.
SURROGATE = "\x00SURROGATE\x00"  # replaced by a raw \ud800 escape in the JSON body
FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty",
)  # fmt: skip
INT_FIELDS = ("max_tokens", "top_k", "min_tokens", "n", "seed", "logprobs")
BAD_NUMBERS: tuple[Any, ...] = ("x", [1], {"a": 1}, True, -1e9, 1e9, float("nan"), float("inf"))
BAD_INTS: tuple[Any, ...] = ("x", 1.5, [1], True, -5, 2**31, 2**63, 10**30)


def _http_cases() -> list[tuple[str, str, str, Any]]:
    """(case id, endpoint, field, value); endpoint "c" = completions, "chat"."""
    cases: list[tuple[str, str, str, Any]] = []

    def add(endpoint: str, field: str, values: tuple[Any, ...] | list[Any]) -> None:
        for i, v in enumerate(values):
            cases.append((f"{endpoint}-{field}-{i}", endpoint, field, v))

    for f in FLOAT_FIELDS:
        add("c", f, BAD_NUMBERS)
    for f in INT_FIELDS:
        add("c", f, BAD_INTS)
    for f in ("ignore_eos", "stream"):
        add("c", f, ("yes", 1, [], {}))
    for f in ("model", "cache_salt"):
        add("c", f, (1, [], {}, SURROGATE, "x" * 100_000))
    add("c", "stop", (5, [1], [[]], ["a"] * 17, ["x" * 300], [None], SURROGATE, [SURROGATE]))
    add("c", "stop_token_ids", ("x", [-1], [2**40], ["a"], [1.5], list(range(300))))
    add("c", "prompt", ("", [], [[1, 2]], [-1], [10**6], [1.5], None, 5, {"a": 1}, SURROGATE))
    add("c", "stream_options", ("x", {"include_usage": "yes"}, []))
    add("c", "echo", (True,))
    add("c", "best_of", (0, 17))
    add("c", "suffix", ("x",))
    add("c", "logit_bias", ({"1": 1},))
    add("chat", "messages", (
        [], "x", [{"role": "bogus", "content": "a"}], [{"content": "a"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": SURROGATE}], [{"role": "user", "content": "w" * 70_000}], [5],
    ))  # fmt: skip
    add("chat", "tools", ([{"type": "function"}],))
    add("chat", "response_format", ({"type": "json_schema"}, "x"))
    add("chat", "logprobs", ("x", 3))
    add("chat", "top_logprobs", (-1, "x", 10**6))
    add("chat", "max_completion_tokens", ("x", -1, 0, 2**31))
    return cases


HTTP_CASES = _http_cases()


def _body(endpoint: str, field: str, value: Any) -> bytes:
    base: dict[str, Any] = {"max_tokens": 2, "temperature": 0.0}
    if endpoint == "chat":
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    if value is None:
        base.pop(field, None)
        raw = json.dumps({**base, field: None})
    else:
        raw = json.dumps({**base, field: value})  # NaN and Infinity as Python writes them
    return raw.replace(json.dumps(SURROGATE)[1:-1], "\\ud800").encode()


def _names_the_field(param: str | None, field: str, body: bytes) -> bool:
    """A rejection of `field` names it, a part of it (`messages[0].role`), or the name it
    maps to; a body that is not JSON at all (NaN, Infinity) has no field to name."""
    if param is None:
        return b"NaN" in body or b"Infinity" in body
    aliases = {
        "top_logprobs": ("logprobs",),
        "prompt": ("prompt_token_ids",),
    }
    return any(
        param == n or param.startswith((f"{n}[", f"{n}.")) for n in (field, *aliases.get(field, ()))
    )


def test_the_fuzz_matrix_is_large_enough() -> None:
    assert len(HTTP_CASES) >= 150 and len(GRPC_CASES) >= 60


def test_http_fuzz_matrix(server: ServeProcess) -> None:
    failures = []
    for name, endpoint, field, value in HTTP_CASES:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        body = _body(endpoint, field, value)
        t0 = time.monotonic()
        status, _, raw = server.request("POST", path, body)
        elapsed_s = time.monotonic() - t0
        reply = json.loads(raw or b"{}")
        error = reply.get("error", {})
        if status == 200:
            ok = "choices" in reply or raw.startswith(b"data:")
        else:
            ok = status == 400 and _names_the_field(error.get("param"), field, body)
        if not ok or elapsed_s > 5.0:
            failures.append((name, status, error or raw[:200], round(elapsed_s, 2)))
    assert failures == [], failures
    _assert_nothing_held(server)


def _grpc_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(case id, field the rejection must name, make_request kwargs)."""
    s: list[tuple[str, str, dict[str, Any]]] = []
    nan, inf = float("nan"), float("inf")
    for f, values in {
        "temperature": (-1.0, nan, inf, 1e9),
        "top_p": (-0.1, 1.5, nan, 0.0),
        "top_k": (-5, -1, 0, 2**31 - 1),
        "min_p": (-1.0, 2.0, nan),
        "repetition_penalty": (0.0, -1.0, nan, 1e9),
        "frequency_penalty": (-3.0, 3.0, nan),
        "presence_penalty": (-3.0, 3.0, nan),
        "seed": (-1, 2**63 - 1),
        "max_tokens": (0, -1, 2**31 - 1),
        "min_tokens": (-1, 100, 2**31 - 1),
        "n": (0, 17, -1),
        "logprobs": (-1, 21, 1000),
        "stop": (["a"] * 17, ["x" * 300], [""], ["\ud800"]),
        "stop_token_ids": ([-1], [10**9], [2**31 - 1], [1] * 257),
        "cache_salt": ("s" * 300, "\ud800"),
        "model": ("nope", "m" * 300),
        "request_id": ("r" * 300, "\ud800", "r" * 256),
    }.items():
        for i, v in enumerate(values):
            s.append((f"{f}-{i}", f, {f: v}))
    prompts = ([], [10**9], [-1], [0] * 2049, list(range(1, 3000)), "", "x" * 70_000, "\ud800")
    for i, p in enumerate(prompts):
        s.append((f"prompt-{i}", "prompt", {"prompt": p}))
    return s


GRPC_CASES = _grpc_cases()
# A max_tokens past the context is refused as vLLM does: naming the prompt it would not fit.
_GRPC_FIELD_NAMES = {
    "prompt": ("prompt", "text", "token_ids"),
    "max_tokens": ("max_tokens", "prompt"),
}


def test_grpc_fuzz_matrix(server: ServeProcess) -> None:
    client = Client(server.grpc_target, timeout_s=10)
    failures = []
    for name, field, kwargs in GRPC_CASES:
        kwargs = dict(kwargs)
        prompt, model = kwargs.pop("prompt", "hi"), kwargs.pop("model", "")
        kwargs.setdefault("max_tokens", 2)
        try:
            req = make_request(prompt, **kwargs)
            req.model = model
        except (ValueError, TypeError, OverflowError):
            continue  # protobuf itself refuses the value: it cannot reach the server
        try:
            out = list(client.stream(req))
            ok = out and out[-1].HasField("complete")
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            names = _GRPC_FIELD_NAMES.get(field, (field,))
            if code == grpc.StatusCode.NOT_FOUND:
                ok = field == "model"
            else:
                ok = code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(names)
            if not ok:
                failures.append((name, code, details[:200]))
                continue
        if not ok:
            failures.append((name, "no complete", ""))
    assert failures == [], failures
    _assert_nothing_held(server)


def _assert_nothing_held(server: ServeProcess) -> None:
    client = Client(server.grpc_target, timeout_s=10)

    def held() -> list[tuple[str, int]]:
        info = client.stub.GetServerInfo(gen.GetServerInfoRequest(), timeout=10)
        return [(w.name, w.num_total_blocks - w.num_free_blocks) for w in info.workers]

    assert server.wait_for(lambda: not any(n for _, n in held()), timeout_s=15.0), held()


def test_a_chat_without_max_tokens_gets_the_room_its_kv_cache_has() -> None:
    """A KV cache smaller than the context: the default max_tokens is what one request can
    hold there, so a client that sent none never gets a 400 naming max_tokens."""
    from engine.sampling import SamplingParams
    from engine.validation import ContextLengthError, check_request

    limits = ModelLimits("m", 512, 8192, block_size=16, num_kv_blocks=64)  # 1024 tokens
    room = limits.room_after(100)
    assert room == 925
    assert ModelLimits("m", 512, 8192).room_after(100) == 8092  # no cache known: the context
    prompt = [4 + i % 400 for i in range(100)]
    check_request(prompt, SamplingParams(max_tokens=room), 512, 8192, 16, 64)  # fits
    with pytest.raises(ContextLengthError, match="max_tokens"):
        check_request(prompt, SamplingParams(max_tokens=room + 1), 512, 8192, 16, 64)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "z" * 600_000}, "prompt"),  # characters, at the edge
        ("/v1/completions", {"prompt": list(range(1, 3001))}, "prompt"),  # token ids
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2048}, "prompt"),  # + max_tokens
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "w" * 70_000}]}, "messages"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2048}, "messages"),
    ],
)  # fmt: skip
def test_every_length_refusal_is_a_context_length_error(
    server: ServeProcess, path: str, body: dict[str, Any], param: str
) -> None:
    """Whichever limit catches an over-long request (its characters before tokenizing, its
    tokens, prompt plus max_tokens), clients see OpenAI's code and vLLM's words."""
    status, error, _ = _post(server, {"model": "tiny", **body}, path)
    assert status == 400, error
    assert error["code"] == "context_length_exceeded", error
    assert error["message"].startswith("This model's maximum context length is 2048 tokens.")
    assert error["param"] == param, error


def test_a_request_the_kv_cache_cannot_hold_reads_as_a_context_length_error() -> None:
    from engine.sampling import SamplingParams
    from engine.validation import ContextLengthError, check_request

    with pytest.raises(ContextLengthError, match="maximum context length is 2048 tokens"):
        check_request(list(range(4, 300)), SamplingParams(max_tokens=8), 512, 2048, 16, 8)


@pytest.mark.parametrize(("n", "ok"), [(None, True), (1, True), (4, True), (0, False), (-1, False)])
def test_n_zero_is_refused_not_taken_for_one(n: int | None, ok: bool) -> None:
    """OpenAI refuses n = 0 ("less than the minimum of 1"); an unset n is 1."""
    from engine.sampling import InvalidParameterError
    from protos.pdserve.v1 import generation_pb2 as gen
    from router.validation import check_choices

    s = gen.SamplingParams() if n is None else gen.SamplingParams(n=n)
    if ok:
        check_choices(s, max_n=16)
        return
    with pytest.raises(InvalidParameterError, match=r"must be in \[1, 16\]") as e:
        check_choices(s, max_n=16)
    assert e.value.field == "n"
