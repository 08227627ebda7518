"""Tool calling on /v1/chat/completions (router/openai/tools.py).

The parsers and the choice rules on their own, then the real default model behind `pdserve
serve`, driven with the official `openai` client: `required` and named calls are forced by a
grammar, so every one is a call to a given tool with arguments that validate against its
schema, streamed or not; a whole round trip (the call, a `tool` message, the answer) goes
back through the template; `auto` reads the model's text with the `hermes` parser on a
template that renders the tools (a Hermes-style one, given with --chat-template).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from pdserve.models import pdserve_home
from router.openai.base import HTTPError
from router.openai.tools import parse_hermes, parse_llama3_json, parse_mistral, plan_tools
from tests.serve_proc import ServeProcess

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(600)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city",
                     "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": ADD}},
]  # fmt: skip
SCHEMA = {"get_weather": WEATHER, "add": ADD}
PROMPTS = [
    "What is the weather in Paris?",
    "Add 2 and 3.",
    "Is it cold in Oslo today?",
    "What is 40 plus 2?",
]
NAMES = {"get_weather", "add"}
T = TypeVar("T")

# A Hermes-style template (Qwen2.5's format) that renders `tools` and the tool turns.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You can call these functions. To call one, write <tool_call>{"name": NAME, "arguments": \
{...}}</tool_call>.
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# ---- parsers and rules --------------------------------------------------------------------
def test_hermes_reads_each_call_and_the_content_before() -> None:
    text = (
        'Let me check.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
        "</tool_call>"
    )
    content, calls = parse_hermes(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Oslo", "unit": "c"}),
    ]
    assert parse_hermes("no call here", NAMES) == ("no call here", [])
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert parse_hermes(unknown, NAMES) == (unknown, [])  # a tool nobody offered: text


def test_llama3_json_and_mistral_read_their_formats() -> None:
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; ' + (
        '{"name": "add", "parameters": {"a": 3, "b": 4}}'
    )
    _, calls = parse_llama3_json(text, NAMES)
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert parse_llama3_json("Hello {there}", NAMES) == ("Hello {there}", [])
    content, calls = parse_mistral(
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', NAMES
    )
    assert content == "Sure." and calls[0].name == "add"


@pytest.mark.parametrize(
    ("body", "auto", "reads", "message"),
    [
        ({"tools": TOOLS, "tool_choice": "auto"}, False, True, "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, True, False, "--chat-template"),
        ({"tool_choice": "required"}, True, True, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
         True, True, "not in tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, True, True, "must be none, auto"),
    ],
)  # fmt: skip
def test_a_choice_that_cannot_be_honoured_is_a_400_naming_tool_choice(
    body: dict[str, Any], auto: bool, reads: bool, message: str
) -> None:
    with pytest.raises(HTTPError) as e:
        plan_tools(body, auto, "hermes" if auto else None, reads)
    assert e.value.param == "tool_choice" and message in e.value.message


def test_without_auto_tools_default_to_none_and_required_needs_no_parser() -> None:
    assert plan_tools({"tools": TOOLS}, False, None, False) is None
    plan = plan_tools({"tools": TOOLS, "tool_choice": "required"}, False, None, False)
    assert plan is not None and plan.grammar() is not None


# ---- the real model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    logs = tmp_path_factory.mktemp("tools-serve")
    template = logs / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    args = ("--chat-template", str(template), "--enable-auto-tool-choice")
    proc = ServeProcess(
        logs,
        (*args, "--tool-call-parser", "hermes"),
        model=None,
        env={"PDSERVE_HOME": str(pdserve_home())},
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def _streamed_calls(stream: Any) -> tuple[list[dict[str, Any]], str | None]:
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def at_once(
    check: Callable[[T], None], items: Sequence[T], also: Callable[[None], None] | None = None
) -> None:
    """Every item's request at once (the server batches them; each is checked on its own),
    re-raising the first failure. `also` runs beside them."""
    with ThreadPoolExecutor(len(items) + 1) as pool:
        extra = pool.submit(also, None) if also is not None else None
        list(pool.map(check, items))
        if extra is not None:
            extra.result()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "add", "get_weather"])
def test_forced_calls_are_always_valid(client: Any, choice: str, stream: bool) -> None:
    """Every prompt at once (the server batches them; each is checked on its own)."""
    tool_choice: Any = choice
    if choice != "required":
        tool_choice = {"type": "function", "function": {"name": choice}}

    def check(prompt: str) -> None:
        kwargs = dict(
            model=_model(client),
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,  # one call: a small greedy model repeats calls
            temperature=0,
            max_tokens=120,
        )
        if stream:
            calls, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        else:
            r = client.chat.completions.create(**kwargs)
            msg = r.choices[0].message
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in msg.tool_calls]  # fmt: skip
            finish = r.choices[0].finish_reason
            assert msg.content is None
        assert finish == "tool_calls" and calls, (prompt, calls)
        for call in calls:
            assert call["name"] == choice or (choice == "required" and call["name"] in NAMES)
            jsonschema.validate(json.loads(call["arguments"]), SCHEMA[call["name"]])

    at_once(check, PROMPTS)


def test_parallel_required_calls_are_each_valid_even_when_cut_short(client: Any) -> None:
    """With parallel calls allowed, the model may write more calls than max_tokens holds:
    every call it completed comes back valid, and a cut list keeps finish reason length."""
    r = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
    for c in choice.message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])


def test_a_whole_round_trip(client: Any) -> None:
    """The call, the tool's answer as a `tool` message, and the model's reply to it: the
    next turn renders the assistant's tool call and the tool's answer through the template."""
    model = _model(client)
    messages: list[Any] = [{"role": "user", "content": "Add 2 and 3."}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0,
        max_tokens=60,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    second = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=40,
    )  # fmt: skip
    assert second.choices[0].message.content
    assert not second.choices[0].message.tool_calls
    alone = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=1)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the two turns went in


def test_auto_renders_the_tools_and_reads_calls_with_hermes(client: Any) -> None:
    """`auto` (the default with tools on this server): the template got the tools (the
    prompt grew by them), and whatever the model wrote comes back read by the parser: calls
    to offered tools with JSON arguments and finish reason tool_calls, or plain content."""
    model = _model(client)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=1)

    def check(prompt: str) -> None:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
            temperature=0, max_tokens=80,
        )  # fmt: skip
        choice = r.choices[0]
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 40
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for c in choice.message.tool_calls:
                assert c.function.name in NAMES and isinstance(
                    json.loads(c.function.arguments), dict
                )
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content

    at_once(check, PROMPTS)


def test_parse_with_a_pydantic_model(client: Any) -> None:
    """`client.chat.completions.parse(response_format=<pydantic model>)`: a json_schema
    response_format that the output always satisfies."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    r = client.chat.completions.parse(
        model=_model(client),
        messages=[{"role": "user", "content": "Paris, as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=60,
    )
    assert isinstance(r.choices[0].message.parsed, City)


def test_structured_output_forms_through_the_client(client: Any, server: ServeProcess) -> None:
    """Every form of structured output an app sends, through the official client's
    extra_body where it is not an OpenAI field."""
    model = _model(client)
    ask = [{"role": "user", "content": "Pick a capital city."}]
    forms: list[tuple[dict[str, Any], Any]] = [
        ({"guided_choice": ["Paris", "London"]}, lambda t: t in ("Paris", "London")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, lambda t: 3 <= len(t) <= 9),
        ({"structured_outputs": {"grammar": 'root ::= "city: " [A-Z] [a-z]+'}},
         lambda t: t.startswith("city: ")),
        ({"guided_json": WEATHER}, lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
    ]  # fmt: skip

    def check(form: tuple[dict[str, Any], Any]) -> None:
        extra, ok = form
        r = client.chat.completions.create(
            model=model, messages=ask, temperature=0, max_tokens=40, extra_body=extra
        )
        text = r.choices[0].message.content
        assert ok(text), (extra, text)

    def json_object(_: None) -> None:
        r = client.chat.completions.create(
            model=model, messages=ask, temperature=0, max_tokens=60,
            response_format={"type": "json_object"},
        )  # fmt: skip
        assert isinstance(json.loads(r.choices[0].message.content), dict)

    at_once(check, forms, also=json_object)


def test_tokenize_renders_the_tools_as_chat_does(client: Any, server: ServeProcess) -> None:
    messages = [{"role": "user", "content": PROMPTS[0]}]
    status, _, raw = server.request("POST", "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200, raw
    r = client.chat.completions.create(
        model=_model(client), messages=messages, tools=TOOLS, max_tokens=1
    )
    assert json.loads(raw)["count"] == r.usage.prompt_tokens
    status, _, bare = server.request("POST", "/tokenize", {"messages": messages})
    assert json.loads(bare)["count"] < r.usage.prompt_tokens


def test_malformed_tools_and_model_output_never_raise() -> None:
    """Shapes a client or a model can send that are not OpenAI's: a 400 naming the field,
    or text that is not a call; never an exception (a 500, or a stream without its end)."""
    from router.openai.tools import template_message

    for body, param in (
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
        ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "required"}, "tools"),
    ):
        with pytest.raises(HTTPError) as e:
            plan_tools(body, True, "hermes", True)
        assert e.value.param == param
    odd = '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>'
    assert parse_hermes(odd, NAMES) == (odd, [])
    assert parse_mistral("[TOOL_CALLS] 5", NAMES) == ("[TOOL_CALLS] 5", [])
    assert parse_llama3_json('{"name": {"x": 1}}', NAMES) == ('{"name": {"x": 1}}', [])
    m = {"role": "assistant", "content": "", "tool_calls": [{"function": "add"}, "x"]}
    assert template_message(m) == m
