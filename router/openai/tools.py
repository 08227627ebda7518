"""Tool calling on /v1/chat/completions, as OpenAI and vLLM define it.

`tool_choice` decides how calls come about (`ToolPlan`):
- `none`: no tools in the prompt, plain text out;
- `auto` (the default when tools are sent and `--enable-auto-tool-choice` is on): the tools
  are rendered through the chat template's `tools` variable, the model decides, and the
  `--tool-call-parser` reads its calls from the text (`hermes`, `llama3_json`, `mistral`). A
  template that never reads `tools` would drop them without a word: refused, naming
  `--chat-template`;
- `required`, or a named function: forced by a grammar (engine.structured), so the output is
  always a call to a given tool with schema-valid arguments, whatever the template knows.
  `required` writes a JSON list of `{"name", "parameters"}` (one item unless
  `parallel_tool_calls`), a named call writes the arguments object itself.

`finish_reason` is `tool_calls` only when at least one call was read. The next turn's
assistant `tool_calls` and `tool` messages go back through the template (arguments as
objects, as HF templates read them).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from protos.pdserve.v1 import generation_pb2 as gen
from router.openai.base import RequestPart, bad_request

MAX_TOOLS = 128
_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's function name rule
Mode = Literal["none", "auto", "required", "named"]
PARSERS = ("hermes", "llama3_json", "mistral")


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: StrictStr = Field(pattern=_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["function"]
    function: Function


class ToolsPart(RequestPart):
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id or f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request with tools does: how calls come about and how they are read."""

    mode: Mode
    tools: tuple[Tool, ...]
    parallel: bool = True
    named: str = ""  # mode named: the function
    parser: str | None = None  # mode auto

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as HF's apply_chat_template(tools=...) receives them."""
        if self.mode == "none":
            return None
        return rendered(self.tools)

    def grammar(self) -> gen.StructuredOutput | None:
        """The constraint that forces the calls (required, named), else None."""
        if self.mode == "named":
            (tool,) = [t for t in self.tools if t.function.name == self.named]
            return gen.StructuredOutput(json_schema=json.dumps(tool.function.parameters))
        if self.mode != "required":
            return None
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.function.name},
                        "parameters": t.function.parameters,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return gen.StructuredOutput(json_schema=json.dumps(schema))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of the model's whole output."""
        if self.mode == "named":
            return "", [ToolCall(self.named, _compact(text))]
        if self.mode == "required":
            items = [i for i in _complete_items(text) if isinstance(i, dict)]
            return "", [
                ToolCall(str(i["name"]), json.dumps(i["parameters"]))
                for i in items
                if "name" in i and "parameters" in i
            ]
        if self.mode == "auto" and self.parser is not None:
            return PARSE[self.parser](text, {t.function.name for t in self.tools})
        return text, []


def _complete_items(text: str) -> list[Any]:
    """The items of a JSON list written under the `required` grammar, also when it was cut
    short (max_tokens): every item that is complete."""
    try:
        items = json.loads(text)
        return items if isinstance(items, list) else []
    except ValueError:
        pass
    decoder, out, at = json.JSONDecoder(), [], text.find("[") + 1
    while 0 < at < len(text):
        while at < len(text) and text[at] in " \n\t,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        out.append(item)
    return out


def rendered(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools as HF's apply_chat_template(tools=...) takes them."""
    return [t.model_dump(exclude_none=True) for t in tools]


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


def _call(obj: Any, names: set[str], args_key: str) -> ToolCall | None:
    """A call to an offered tool, or None (the model wrote something else)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(str(obj["name"]), args if isinstance(args, str) else json.dumps(args))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them; the
    text before the first is the content."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call(json.loads(body), names, "arguments")
        except ValueError:
            continue
        if call is not None:
            calls.append(call)
    return (text[:start].strip() if calls else text), calls


def parse_llama3_json(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Llama 3's JSON calls: `{"name": ..., "parameters": {...}}`, `;`-separated, maybe
    after `<|python_tag|>`; anything else is content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(obj, names, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return "", calls


def parse_mistral(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    try:
        items, _ = json.JSONDecoder().raw_decode(text[start + len("[TOOL_CALLS]") :].strip())
    except ValueError:
        return text, []
    if not isinstance(items, list):
        return text, []
    calls = [c for c in (_call(i, names, "arguments") for i in items) if c is not None]
    return (text[:start].strip() if calls else text), calls


PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def plan_tools(
    body: dict[str, Any], auto_enabled: bool, parser: str | None, template_reads_tools: bool
) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools in play), or the 400 naming the field."""
    part = ToolsPart.of(body)
    tools = tuple(part.tools or ())
    choice = part.tool_choice
    if choice is None:
        choice = "auto" if tools and auto_enabled else "none"
    if len({t.function.name for t in tools}) < len(tools):
        raise bad_request("tools", "each tool needs a name of its own")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) and choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_request("tool_choice", "a named choice is {type: function, function: {name}}")
        if name not in {t.function.name for t in tools}:
            raise bad_request("tool_choice", f"names {name[:64]!r}, which is not in tools")
        return ToolPlan("named", tools, part.parallel_tool_calls, named=name)
    if choice not in ("none", "auto", "required"):
        raise bad_request("tool_choice", "must be none, auto, required or a named function")
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice", f"tool_choice {choice} needs tools")
    if choice == "required":
        return ToolPlan("required", tools, part.parallel_tool_calls)
    if not auto_enabled or parser is None:
        raise bad_request(
            "tool_choice",
            '"auto" tool choice needs --enable-auto-tool-choice and --tool-call-parser',
        )
    if not template_reads_tools:
        raise bad_request(
            "tool_choice",
            "this model's chat template never reads `tools`, so the model would not see them: "
            "serve it with a tool-capable --chat-template (required and named calls work "
            "without one)",
        )
    return ToolPlan("auto", tools, part.parallel_tool_calls, parser=parser)


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message as HF templates read it: tool call arguments as objects."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    if not isinstance(calls, list):
        return m
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            out.append(c)  # not OpenAI's shape: the template sees it as sent
            continue
        f = dict(c["function"])
        if isinstance(f.get("arguments"), str):
            with contextlib.suppress(ValueError):
                f["arguments"] = json.loads(f["arguments"])
        out.append({**c, "function": f})
    return {**m, "tool_calls": out}
