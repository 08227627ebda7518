"""vLLM's extra endpoints and request fields on pdserve's HTTP API (docs/http.md).

In process (a router without workers, no tokenizer): every field pdserve does not honour is
a 400 naming it on both generation endpoints, harmless values pass, the auth rules, the
probes, the model card and the API docs, and the tokenize endpoints' input checks. Against
one `pdserve serve --model tiny` for the module: /tokenize and /detokenize agree with the
checkpoint's tokenizer, chat's template flags (`add_generation_prompt`,
`continue_final_message`, `add_special_tokens`) render as /tokenize says, and `pdserve bench
--base-url` counts ShareGPT tokens through the server's /tokenize.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from router.openai.fields import HARMLESS, REFUSED
from tests.in_process import asgi_call as call
from tests.in_process import router_without_workers
from tests.serve_proc import ServeProcess, shared_server

pytestmark = pytest.mark.timeout(420)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is"},
]
BASE: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"messages": CHAT[:2], "max_tokens": 2}),
    "tokenize": ("/tokenize", {"messages": CHAT[:2]}),
}


# ---- in process ---------------------------------------------------------------------------
def _app(**cfg: Any) -> Any:
    from router.config import RouterConfig
    from router.http import create_app

    return create_app(router_without_workers(RouterConfig(**cfg)))


def _error(status: int, body: bytes) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_every_refused_field_is_a_400_naming_it() -> None:
    app = _app()
    walked = 0
    for f in REFUSED:
        for endpoint in sorted(f.endpoints):
            path, base = BASE[endpoint]
            status, _, raw = call(app, "POST", path, {**base, f.name: f.example})
            assert status == 400, (f.name, endpoint, raw)
            err = _error(status, raw)
            assert err["param"] == f.name, (endpoint, err)
            assert err["type"] == "invalid_request_error"
            assert f.name in err["message"] and "not supported" in err["message"]
            walked += 1
    assert walked >= 40  # the whole table, on each endpoint it refuses on
    body = {**BASE["chat"][1], "stream": True, "stream_options": {"continuous_usage_stats": True}}
    status, _, raw = call(app, "POST", "/v1/chat/completions", body)
    assert _error(status, raw)["param"] == "stream_options.continuous_usage_stats"


# OpenAI's and vLLM's request fields that pdserve maps (router/openai/protocol.py)
HONOURED = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logprobs",
    "top_logprobs", "n", "best_of", "stream", "stream_options", "top_k", "min_p",
    "repetition_penalty",
    "min_tokens", "ignore_eos", "stop_token_ids", "cache_salt", "add_special_tokens",
    "add_generation_prompt", "continue_final_message", "return_tokens_as_token_ids",
    "request_id", "logit_bias", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "chat_template_kwargs", "tools",
    "tool_choice", "parallel_tool_calls", "allowed_token_ids", "bad_words", "prompt_logprobs",
}  # fmt: skip


def test_every_known_field_has_a_decision() -> None:
    refused = {f.name for f in REFUSED}
    assert not (refused & HONOURED) and not (refused & set(HARMLESS))
    known = {
        # OpenAI completions and chat completions
        "echo", "best_of", "suffix", "logit_bias", "user", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call", "response_format", "audio",
        "modalities", "prediction", "metadata", "store", "service_tier", "reasoning_effort",
        "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier",
        # vLLM's extras
        "use_beam_search", "length_penalty", "include_stop_str_in_output",
        "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
        "prompt_logprobs", "allowed_token_ids", "bad_words", "logits_processors",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
        "structured_outputs", "chat_template", "chat_template_kwargs", "documents",
        "mm_processor_kwargs", "prompt_embeds", "priority", "kv_transfer_params",
        "vllm_xargs", "include_reasoning",
    }  # fmt: skip
    assert known <= refused | set(HARMLESS) | HONOURED, known - refused - set(HARMLESS)


HARMLESS_VALUES: dict[str, Any] = {
    "echo": False,
    "best_of": 1,
    "suffix": "",
    "logit_bias": {},
    "tool_choice": "none",
    "function_call": "auto",
    "tools": [],
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "priority": 0,
    "bad_words": [],
    "user": "someone",
    "safety_identifier": "x",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prediction": {"type": "content", "content": "x"},
    "parallel_tool_calls": True,
    "include_reasoning": False,
    "a_field_nobody_knows": {"x": 1},
}


def test_harmless_values_pass() -> None:
    from router.openai.protocol import completion_request

    assert set(HARMLESS) <= set(HARMLESS_VALUES)
    for name, value in HARMLESS_VALUES.items():
        completion_request({"prompt": [5, 6], name: value}, "r")  # no 400
    app = _app()
    chat = {**BASE["chat"][1], **HARMLESS_VALUES}
    status, _, raw = call(app, "POST", "/v1/chat/completions", chat)
    # past every field check: the 400 is that this router has no tokenizer
    assert status == 400 and _error(status, raw)["param"] == "messages", raw


def test_auth_rules_probes_and_docs() -> None:
    app = _app(api_key="k-1")
    key = {"Authorization": "Bearer k-1"}
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/m", None),
        ("POST", "/v1/completions", {"prompt": "hi"}),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [5]}),
    ]:
        status, headers, raw = call(app, method, path, body)
        assert status == 401, (path, raw)
        assert _error(status, raw)["code"] == "invalid_api_key"
        assert headers["www-authenticate"] == "Bearer"
    for method, path in [
        ("GET", "/health"),
        ("GET", "/ping"),
        ("POST", "/ping"),
        ("GET", "/version"),
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("GET", "/redoc"),
        ("GET", "/openapi.json"),
    ]:
        assert call(app, method, path)[0] == 200, path
    status, _, raw = call(app, "GET", "/version")
    assert set(json.loads(raw)) == {"version"} and json.loads(raw)["version"]
    assert json.loads(call(app, "GET", "/ping")[2]) == {"status": "ok"}
    schema = json.loads(call(app, "GET", "/openapi.json")[2])
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/ping"):
        assert path in schema["paths"], path
    status, _, raw = call(app, "GET", "/v1/models/m", headers=key)
    card = json.loads(raw)
    assert status == 200 and card["id"] == "m" and card["object"] == "model"
    assert card["max_model_len"] == 2048
    status, _, raw = call(app, "GET", "/v1/models/other", headers=key)
    assert status == 404 and _error(status, raw)["code"] == "model_not_found"


def test_ping_follows_health() -> None:
    from router.config import RouterConfig
    from router.http import create_app

    router = router_without_workers(RouterConfig())
    app = create_app(router)
    router.draining = True
    for method in ("GET", "POST"):
        status, _, raw = call(app, method, "/ping")
        assert status == 503 and json.loads(raw)["status"] == "draining"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x" * (32 * 2048 + 1)}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "hi", "model": "m" * 300}, 400, "model"),
        ("/tokenize", {"prompt": "hi"}, 400, "prompt"),  # this router has no tokenizer
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x" * 70000}]}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            400,
            "continue_final_message",
        ),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 2.5]}, 400, "tokens"),
        ("/detokenize", {"tokens": [5] * 2049}, 400, "tokens"),
        ("/detokenize", {"tokens": [5, 512]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [5], "model": "other"}, 404, "model"),
        ("/detokenize", b"[1]", 400, None),
    ],
)
def test_tokenize_input_checks(
    path: str, body: dict[str, Any] | bytes, status: int, param: str | None
) -> None:
    got, _, raw = call(_app(), "POST", path, body)
    assert got == status, raw
    assert _error(got, raw)["param"] == param, raw


# ---- against `pdserve serve --model tiny` -------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    return shared_server("tiny-server", tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(server: ServeProcess) -> Tokenizer:
    path = Path(server.home) / "models" / "tiny-seed0-float32"  # what `--model tiny` resolved
    return Tokenizer.from_dir(path, ModelConfig.from_hf(path))


def post(server: ServeProcess, path: str, body: dict[str, Any]) -> Any:
    status, _, raw = server.request("POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


def greedy(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0.0, "max_tokens": 6, "ignore_eos": True, **kw}


def test_tokenize_and_detokenize(server: ServeProcess, tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    got = post(server, "/tokenize", {"model": "tiny", "prompt": text})
    ids = tokenizer.encode(text)
    assert got == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    assert bare == tokenizer.encode(text, False)
    back = post(server, "/detokenize", {"model": "tiny", "tokens": ids})
    assert back == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert text in back["prompt"]

    chat = post(server, "/tokenize", {"messages": CHAT[:2]})["tokens"]
    assert chat == tokenizer.encode_chat(CHAT[:2])
    plain = post(server, "/tokenize", {"messages": CHAT[:2], "add_generation_prompt": False})
    assert plain["tokens"] == tokenizer.encode_chat(CHAT[:2], add_generation_prompt=False)
    special = post(server, "/tokenize", {"messages": CHAT[:2], "add_special_tokens": True})
    rendered = tokenizer.apply_chat_template(CHAT[:2])
    assert special["tokens"] == tokenizer.encode(rendered, True)
    cont = post(server, "/tokenize", {"messages": CHAT, "continue_final_message": True})
    text_cont = tokenizer.decode(cont["tokens"], skip_special_tokens=False)
    assert text_cont.endswith("The colour is"), text_cont  # open-ended: no end-of-turn after


@pytest.mark.parametrize(
    "flags",
    [
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"add_generation_prompt": False},
        {"add_special_tokens": True},
    ],
)
def test_chat_template_flags(server: ServeProcess, flags: dict[str, Any]) -> None:
    """Chat renders as /tokenize says: its output is the completion of those very ids."""
    messages = CHAT if flags.get("continue_final_message") else CHAT[:2]
    ids = post(server, "/tokenize", {"messages": messages, **flags})["tokens"]
    chat = post(server, "/v1/chat/completions", greedy(messages=messages, **flags))
    ref = post(server, "/v1/completions", greedy(prompt=ids))
    assert chat["choices"][0]["message"]["content"] == ref["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == len(ids) == ref["usage"]["prompt_tokens"]


def test_completion_extras(server: ServeProcess, tokenizer: Tokenizer) -> None:
    text = "Prefill and decode run on different workers."
    bare = post(server, "/v1/completions", greedy(prompt=text, add_special_tokens=False))
    ids = tokenizer.encode(text, False)
    assert bare["usage"]["prompt_tokens"] == len(ids)
    ref = post(server, "/v1/completions", greedy(prompt=ids))
    assert bare["choices"][0]["text"] == ref["choices"][0]["text"]

    lp = post(
        server, "/v1/completions", greedy(prompt=text, logprobs=1, return_tokens_as_token_ids=True)
    )
    tokens = lp["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and all(t.startswith("token_id:") for t in tokens), tokens

    status, headers, _ = server.request(
        "POST", "/v1/completions", greedy(prompt=text, request_id="my-request-7")
    )
    assert (
        status == 200
        and {k.lower(): v for k, v in headers.items()}["x-request-id"] == "my-request-7"
    )
    # vLLM's legacy guided_* fields are honoured (vLLM itself drops them silently)
    constrained = post(server, "/v1/completions", greedy(prompt=text, guided_regex="[ab]{3}"))
    assert re.fullmatch("[ab]{3}", constrained["choices"][0]["text"]), constrained
    assert constrained["choices"][0]["finish_reason"] == "stop"


SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "What is the capital of France? Tell me more."},
            {"from": "gpt", "value": "Paris is the capital of France, on the Seine."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Write a haiku about prefill and decode."},
            {"from": "gpt", "value": "Prompt fills the cache, tokens trickle one by one."},
        ]
    },
]


def test_bench_tokenizes_through_the_server(
    server: ServeProcess,
    tokenizer: Tokenizer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pdserve.tools.bench as bench_mod
    from pdserve.cli import main

    def no_local(name: str) -> Any:
        raise AssertionError(f"loaded a local tokenizer {name!r}")

    monkeypatch.setattr(bench_mod, "load_tokenizer", no_local)
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(SHAREGPT))
    result = tmp_path / "result.json"
    common = ["--base-url", server.base_url, "--disable-tqdm", "--save-result"]
    capsys.readouterr()
    sharegpt = ["--dataset-name", "sharegpt", "--dataset-path", str(dataset)]
    args = ["--num-prompts", "2", "--sharegpt-output-len", "4", "--result-filename", str(result)]
    rc = main(["bench", *common, *sharegpt, *args])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(result.read_text())
    assert data["tokenizer_id"] == "tiny" and data["model_id"] == "tiny"
    humans = [e["conversations"][0]["value"] for e in SHAREGPT]
    assert sorted(data["input_lens"]) == sorted(len(tokenizer.encode(h)) for h in humans)
    # the random dataset draws ids under the vocabulary the model card gives
    random = ["--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2"]
    rc = main(["bench", *common, *random, "--result-filename", str(result)])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(result.read_text())["completed"] == 2


@pytest.mark.parametrize("top", [21, -1])
def test_top_logprobs_out_of_range_is_a_400_naming_it(top: int) -> None:
    body = {**BASE["chat"][1], "logprobs": True, "top_logprobs": top}
    status, _, raw = call(_app(), "POST", "/v1/chat/completions", body)
    assert status == 400, raw
    assert _error(status, raw)["param"] == "top_logprobs"


def test_developer_is_the_system_turn_and_template_kwargs_are_bounded(
    server: ServeProcess,
) -> None:
    """OpenAI's `developer` role renders as `system`; `chat_template_kwargs` reach the
    template (an unknown one changes nothing), within bounds, never over the request's own
    variables."""
    user = {"role": "user", "content": "hi"}
    dev = post(
        server, "/tokenize", {"messages": [{"role": "developer", "content": "Be brief."}, user]}
    )
    sys_ = post(
        server, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, user]}
    )
    assert dev["tokens"] == sys_["tokens"]
    kw = post(
        server,
        "/tokenize",
        {"messages": [user], "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert kw["tokens"] == post(server, "/tokenize", {"messages": [user]})["tokens"]
    for bad in ({"messages": []}, {f"k{i}": i for i in range(40)}):
        status, _, raw = server.request(
            "POST", "/v1/chat/completions", greedy(messages=[user], chat_template_kwargs=bad)
        )
        assert status == 400 and json.loads(raw)["error"]["param"] == "chat_template_kwargs", raw


def test_template_kwargs_are_template_variables() -> None:
    from engine.chat_template import ChatTemplate

    t = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
        "{{ 'think' if enable_thinking else 'no-think' }}{{ tools | length if tools else '' }}",
        {},
    )
    msgs = [{"role": "user", "content": "x"}]
    assert t.render(msgs, extra={"enable_thinking": True}) == "user:x;think"
    assert t.render(msgs) == "user:x;no-think"
    assert t.render(msgs, extra={"tools": [{"a": 1}, {"b": 2}]}) == "user:x;no-think2"
    assert t.reads("tools") and t.reads("enable_thinking") and not t.reads("documents")


def _ids_of(resp: dict[str, Any]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in resp["choices"][0]["logprobs"]["tokens"]]


def test_token_controls(server: ServeProcess, tokenizer: Tokenizer) -> None:
    """vLLM's allowed_token_ids and bad_words, as vLLM answers them: only allowed tokens;
    no bad word's token sequence (as written, or after a space) in the output."""
    from router.validation import bad_words_token_ids

    text = "Prefill and decode run on different workers."
    ask = greedy(prompt=text, max_tokens=12, logprobs=0, return_tokens_as_token_ids=True)
    free = _ids_of(post(server, "/v1/completions", ask))
    allowed = sorted(set(free[1:5]) | {7, 8})
    got = _ids_of(post(server, "/v1/completions", {**ask, "allowed_token_ids": allowed}))
    assert set(got) <= set(allowed) and len(got) == 12

    word = tokenizer.decode(free[2:4]).strip() or tokenizer.decode(free[2:3])
    banned = bad_words_token_ids(tokenizer, [word])
    assert banned, word
    got = _ids_of(post(server, "/v1/completions", {**ask, "bad_words": [word]}))
    for seq in banned:
        n = len(seq)
        assert all(tuple(got[i : i + n]) != seq for i in range(len(got) - n + 1)), (word, seq)

    status, _, raw = server.request("POST", "/v1/completions", {**ask, "allowed_token_ids": []})
    assert status == 400 and json.loads(raw)["error"]["param"] == "allowed_token_ids", raw


def test_a_list_of_prompts_is_answered_as_vllm_does(server: ServeProcess) -> None:
    """One choice per prompt, in order, `index` numbered across them, each the same as the
    prompt alone; usage summed; streamed, each chunk carries its choice's index and one
    usage chunk closes the stream."""
    prompts = ["The quick brown fox", "Prefill and decode", "hello world"]
    alone = [post(server, "/v1/completions", greedy(prompt=p)) for p in prompts]
    batch = post(server, "/v1/completions", greedy(prompt=prompts))
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone)

    ids = [[5, 6, 7, 8], [9, 10, 11]]
    by_ids = post(server, "/v1/completions", greedy(prompt=ids))
    assert by_ids["usage"]["prompt_tokens"] == 7 and len(by_ids["choices"]) == 2

    body = greedy(prompt=prompts, stream=True, stream_options={"include_usage": True})
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200
    events = [
        json.loads(line[len("data: ") :])
        for line in raw.decode().splitlines()
        if line.startswith("data: {")
    ]
    texts = {i: "" for i in range(3)}
    finished = set()
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finished.add(c["index"])
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c["text"] for c in batch["choices"]]
    assert events[-1]["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # cached ones differ
        assert events[-1]["usage"][key] == batch["usage"][key]
    assert raw.decode().rstrip().endswith("data: [DONE]")
