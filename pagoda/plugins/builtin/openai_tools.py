"""OpenAI's tool and structured-output fields, as the three OpenAI endpoints share them.

    chat        tools: [{"type": "function", "function": {name, description, parameters, strict}}]
                tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
                response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}
    responses   tools: [{"type": "function", name, description, parameters, strict}]
                tool_choice: "none" | "auto" | "required" | {"type": "function", "name": ...}
                text.format: {"type": "text" | "json_object" | "json_schema", name, schema, strict}
    completions response_format as chat's, or one of guided_json / guided_regex / guided_choice / guided_grammar

Every field becomes a `Constraint` (pagoda/core/constraint.py) or a `ToolChoice` with its `Tool`s, parts of the
endpoint's `Turn` (pagoda/plugins/turn.py); a bad one is a RequestError naming it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from pagoda.core.constraint import Constraint
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.tools import Tool, ToolChoice, check_schema


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    """Responses' `text.format`: the json_schema fields sit beside `type`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionName(msgspec.Struct):
    name: str


class ChatNamedChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class ResponsesNamedChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


ChoiceMode = Literal["none", "auto", "required"]


def format_constraint(kind: str, schema: dict[str, Any] | None, field: str) -> Constraint | None:
    """text -> None; json_object -> any object; json_schema -> its schema (checked), naming `field`."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", field)
    if schema is None:
        raise RequestError(f"{field}.schema is required for type json_schema", f"{field}.schema")
    return Constraint.json_schema(check_schema(schema, f"{field}.schema"), field)


def response_format(fmt: ResponseFormat | None, field: str = "response_format") -> Constraint | None:
    """Chat's and completions' `response_format` as a constraint."""
    if fmt is None:
        return None
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise RequestError(f"{field}.json_schema is required for type json_schema", f"{field}.json_schema")
    schema = fmt.json_schema.schema if fmt.json_schema else None
    return format_constraint(fmt.type, schema, f"{field}.json_schema" if fmt.type == "json_schema" else field)


def text_format(text: TextConfig | None) -> Constraint | None:
    """Responses' `text.format` as a constraint."""
    if text is None or text.format is None:
        return None
    return format_constraint(text.format.type, text.format.schema, "text.format")


def guided(body: Any) -> Constraint | None:
    """Completions' vLLM-style extensions: at most one of guided_json, guided_regex, guided_choice, guided_grammar."""
    given = [f for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(body, f) is not None]
    if len(given) > 1 or (given and body.response_format is not None):
        names = given + (["response_format"] if body.response_format is not None else [])
        raise RequestError(f"give at most one of {', '.join(names)}", given[-1])
    if not given:
        return response_format(body.response_format)
    field = given[0]
    value = getattr(body, field)
    if field == "guided_json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as exc:
            raise RequestError(f"guided_json must be a JSON schema (object or JSON text): {exc.msg}", field) from None
        return Constraint.json_schema(check_schema(schema, field), field)
    if field == "guided_choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError("guided_choice must be a non-empty list of non-empty strings", field)
        return Constraint("choice", json.dumps(list(value)), field)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{field} must be a non-empty string", field)
    return Constraint("regex" if field == "guided_regex" else "grammar", value, field)


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None, field: str) -> Tool:
    """One function tool, its parameters' schema checked (naming `field`)."""
    if parameters is not None:
        check_schema(parameters, field)
    return Tool(name=name, description=description or "", parameters=parameters)


def chat_tools(tools: list[ChatTool] | None) -> list[Tool]:
    """Chat's function tools."""
    return [function_tool(t.function.name, t.function.description, t.function.parameters,
                          f"tools[{i}].function.parameters") for i, t in enumerate(tools or [])]


def responses_tools(tools: list[ResponsesTool] | None) -> list[Tool]:
    """Responses' function tools (flat: name and parameters beside `type`)."""
    return [function_tool(t.name, t.description, t.parameters, f"tools[{i}].parameters")
            for i, t in enumerate(tools or [])]


def tool_choice(raw: ChoiceMode | ChatNamedChoice | ResponsesNamedChoice | None, tools: list[Tool],
                parallel: bool | None) -> tuple[ToolChoice, str]:
    """The choice (default: auto with tools, none without) and the field a bad one is named by (the turn checks it
    against the tools)."""
    if isinstance(raw, ChatNamedChoice):
        return ToolChoice("named", raw.function.name, parallel is not False), "tool_choice.function.name"
    if isinstance(raw, ResponsesNamedChoice):
        return ToolChoice("named", raw.name, parallel is not False), "tool_choice.name"
    return ToolChoice(raw or ("auto" if tools else "none"), None, parallel is not False), "tool_choice"
