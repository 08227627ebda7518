"""Chat templates, rendered the way HF `apply_chat_template` renders them.

A checkpoint's template is Jinja written against transformers' environment, so it is
rendered in the same one: a sandbox, `trim_blocks` and `lstrip_blocks`, `loopcontrols`, a
`tojson` that keeps non-ASCII text, the `raise_exception` and `strftime_now` globals, the
`{% generation %}` block, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
as variables. A template that calls `raise_exception(msg)` fails with `ChatTemplateError(msg)`,
the template's own words, which the router returns as a 400.

Where the template comes from (`find_template`): an explicit file (`--chat-template`), else
the checkpoint's `chat_template.jinja` (transformers 5 writes it there), else the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates).

jinja2 is imported on first use: only the chat path needs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any


class ChatTemplateError(ValueError):
    """The template refused these messages (its `raise_exception`) or failed to render."""


def find_template(
    checkpoint: Path, tokenizer_config: Mapping[str, Any], override: str | Path | None = None
) -> str | None:
    """The template text by the precedence in the module docstring, or None."""
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ValueError(f"chat_template: {path} is not a file")
        return path.read_text()
    jinja_file = checkpoint / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class ChatTemplate:
    """One compiled template plus the special-token variables it may read."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)

    @cached_property
    def _compiled(self) -> Any:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationBlock(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}` marks assistant text; renders its body."""

            tags = {"generation"}  # noqa: RUF012 - jinja2's extension API

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                    lineno
                )

            def _body(self, caller: Any) -> str:
                return str(caller())

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        def tojson(
            x: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False,
        ) -> str:
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse: {e}") from e

    def reads(self, name: str) -> bool:
        """Whether the template reads the variable `name` at all (a template that never
        reads `tools` would drop them without a word)."""
        import jinja2.meta

        ast = self._compiled.environment.parse(self.source)
        return name in jinja2.meta.find_undeclared_variables(ast)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; raises ChatTemplateError with the template's own message.
        `extra`: more variables, as HF's `apply_chat_template(tools=..., **kwargs)` passes
        them (`tools`, `chat_template_kwargs` such as Qwen3's `enable_thinking`)."""
        import jinja2

        try:
            return str(
                self._compiled.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    **{**self.special_tokens, **(extra or {})},
                )
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
