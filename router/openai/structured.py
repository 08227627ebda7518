"""Structured outputs and logit control on the HTTP API: each form clients send (OpenAI's
`response_format`, vLLM's `structured_outputs`, the legacy `guided_*` fields, which are
honoured and never silently dropped) as the `GenerateRequest.structured_output` the router
compiles and bounds (router/validation.py, router/grammar_check.py), and `logit_bias`."""

from __future__ import annotations

import json
from typing import Any

from pydantic import StrictInt, StrictStr

from protos.pdserve.v1 import generation_pb2 as gen
from router.openai.base import HTTPError, Number, RequestPart, bad_request


def _json_text(v: object) -> str:
    """A schema (or structural tag) given as an object, or as JSON text, as JSON text."""
    if isinstance(v, str):
        return v
    return json.dumps(v)


class Structured(RequestPart):
    """What constrains the output, in each form clients send it: OpenAI's `response_format`,
    vLLM's `structured_outputs`, and the legacy `guided_*` fields (honoured, never dropped).
    At most one may be set. `logit_bias` too (OpenAI's: token id as a string -> bias)."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    logit_bias: dict[StrictStr, Number | StrictInt] | None = None

    def _forms(self) -> list[tuple[str, gen.StructuredOutput]]:
        """(field, constraint) for each form the body sets."""
        forms = []
        if self.response_format is not None:
            so = _response_format(self.response_format)
            if so is not None:
                forms.append(("response_format", so))
        if self.structured_outputs is not None:
            forms.append(("structured_outputs", _structured_outputs(self.structured_outputs)))
        if self.guided_json is not None:
            schema = _json_text(self.guided_json)
            forms.append(("guided_json", gen.StructuredOutput(json_schema=schema)))
        if self.guided_regex is not None:
            forms.append(("guided_regex", gen.StructuredOutput(regex=self.guided_regex)))
        if self.guided_choice is not None:
            choice = gen.ChoiceList(choices=self.guided_choice)
            forms.append(("guided_choice", gen.StructuredOutput(choice=choice)))
        if self.guided_grammar is not None:
            forms.append(("guided_grammar", gen.StructuredOutput(grammar=self.guided_grammar)))
        return forms

    def apply(self, r: gen.GenerateRequest) -> str:
        """Set the constraint and logit_bias on `r`; the field the constraint came from
        (what an error about it names), or "" when there is none."""
        forms = self._forms()
        if len(forms) > 1:
            raise bad_request(
                forms[1][0], f"only one structured output form per request ({forms[0][0]} is set)"
            )
        for token, bias in (self.logit_bias or {}).items():
            try:
                r.sampling.logit_bias[int(token)] = float(bias)
            except ValueError:
                raise bad_request(
                    "logit_bias", f"keys must be token ids, got {token[:32]!r}"
                ) from None
        if not forms:
            return ""
        name, so = forms[0]
        r.structured_output.CopyFrom(so)
        return name


def _response_format(v: dict[str, Any]) -> gen.StructuredOutput | None:
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return gen.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise bad_request("response_format", "json_schema must be an object with a schema")
        schema = spec.get("schema", {})
        strict = spec.get("strict")
        return gen.StructuredOutput(json_schema=json.dumps(schema), lenient=strict is not True)
    raise bad_request("response_format", "type must be one of 'text', 'json_object', 'json_schema'")


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _structured_outputs(v: dict[str, Any]) -> gen.StructuredOutput:
    """vLLM's `structured_outputs`: exactly one of its constraint keys."""
    keys = [k for k in _STRUCTURED_KEYS if v.get(k) not in (None, False)]
    if len(keys) != 1:
        raise bad_request("structured_outputs", f"set exactly one of {', '.join(_STRUCTURED_KEYS)}")
    key, value = keys[0], v[keys[0]]
    if key == "json":
        if not isinstance(value, dict | str):
            raise bad_request("structured_outputs", "json must be a schema (object or text)")
        return gen.StructuredOutput(json_schema=_json_text(value))
    if key == "json_object":
        return gen.StructuredOutput(json_object=True)
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad_request("structured_outputs", "choice must be a list of strings")
        return gen.StructuredOutput(choice=gen.ChoiceList(choices=value))
    if key == "structural_tag":
        if not isinstance(value, dict | str):
            raise bad_request("structured_outputs", "structural_tag must be an object or text")
        return gen.StructuredOutput(structural_tag=_json_text(value))
    if not isinstance(value, str):
        raise bad_request("structured_outputs", f"{key} must be a string")
    return (
        gen.StructuredOutput(regex=value) if key == "regex" else gen.StructuredOutput(grammar=value)
    )


def structured_field(d: dict[str, Any]) -> str:
    """The body's field that constrains its output ("" if none): what the router's errors
    about `structured_output` name on HTTP."""
    try:
        forms = Structured.of(d)._forms()
    except HTTPError:
        return ""
    return forms[0][0] if forms else ""
