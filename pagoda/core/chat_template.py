"""Render a model's chat template (jinja2) into the prompt text.

Templates come from model files we did not write, so they run in jinja2's
immutable sandbox. The environment matches what Hugging Face templates are
written against, so that the same template gives the same text here:
trim_blocks and lstrip_blocks on, the loop-controls extension, a `tojson`
that does not HTML-escape, `raise_exception(msg)` and `strftime_now(fmt)`,
and a `{% generation %}` block tag that renders its body unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; rendering ignores the mark."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` name token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and ', which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; `render` turns messages into prompt text."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source:
            raise ValueError("source must be a non-empty template string")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=False,
            extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse: {e} (line {e.lineno})") from e
        self.source = source
        # Hugging Face's own test: a template that reads a `tools` variable renders tool lists itself.
        self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        special_tokens: Mapping[str, str | None] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`; `special_tokens` gives bos_token, eos_token, ... by name; `tools` (the
        OpenAI function shape) is handed to a template that reads it (messages may then carry `tool_calls` and
        `tool` results as Hugging Face templates expect them)."""
        _check_messages(messages)
        context: dict[str, Any] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        context.update(extra)
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} mappings")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a mapping with a string 'role'")
