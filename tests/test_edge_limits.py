"""Limits at the edge: an oversized or malformed request is refused before it is tokenized,
with INVALID_ARGUMENT / 400 naming the field, never a 500, and never reaches a worker.

Unit checks of `router.validation.EdgeLimits` and `prepare`, then a matrix of bad requests
against a real `pdserve serve` (tiny preset: max_model_len 2048, so prompt text is bounded at
65536 characters and the HTTP body at about 1.4 MB).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from engine.sampling import InvalidParameterError
from pdserve.client import Client, make_request
from protos.pdserve.v1 import generation_pb2 as gen
from router.config import RouterConfig
from router.validation import EdgeLimits, ModelLimits, prepare
from tests.serve_proc import ServeProcess

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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("edge"))
    yield proc
    proc.stop()


def _post(server: ServeProcess, body: bytes | dict[str, Any], path: str = "/v1/completions"):
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


def test_health_answers_while_a_huge_prompt_is_refused(server: ServeProcess) -> None:
    import threading

    done = threading.Event()

    def flood() -> None:
        for _ in range(3):
            _post(server, {"prompt": "q" * (10 << 20)})
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    worst = 0.0
    while not done.is_set():
        t0 = time.monotonic()
        status, _, _ = server.request("GET", "/health")
        worst = max(worst, time.monotonic() - t0)
        assert status == 200
    assert worst < 0.1, f"/health took {worst * 1e3:.0f} ms"


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
