"""Tools as the protocols share them: the tool list, the choice, and the parser type a model family's format plugs into.

A protocol reads its own fields into `Tool`s and a `ToolChoice` (pagoda/plugins/turn.py checks them together and
asks the parser for the constraint); a `ToolParser` (registered by a plugin through
`pagoda_register_tool_parsers`, picked by `pagoda serve --tool-parser NAME`) owns everything about the model's
call syntax: the default prompt that teaches it to a model whose chat template knows no tools, how a past call
is written back into the prompt, the constraint that forces a valid call, and reading calls out of the text,
whole (`parse`) or as it streams (`stream().feed(delta)`, pagoda/plugins/tool_stream.py). A call is written as

    BEGIN {"name": NAME, "<key>": ARGUMENTS} END        e.g. <tool_call>{"name": ..., "arguments": {...}}</tool_call>

and its `arguments` are reported as the exact JSON text the model wrote, so the fragments a stream sends join
into what the unary answer holds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from pagoda.core.constraint import Constraint
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.tool_stream import CallStream, ParsedOutput, collect


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, what it does, its parameters' JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None  # None = any object

    @property
    def schema(self) -> dict[str, Any]:
        return dict(self.parameters) if self.parameters else {"type": "object"}

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates and the default prompt list it ({"type": "function", "function": ...})."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema}}


@dataclass(frozen=True)
class ToolChoice:
    """none: no calls; auto: text or calls; required: at least one call; named: a call of `name`."""

    mode: Literal["none", "auto", "required", "named"] = "auto"
    name: str | None = None
    parallel: bool = True  # more than one call in an answer

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def check_schema(schema: Any, field: str) -> dict[str, Any]:
    """A JSON schema that is itself valid (Draft 2020-12), or a RequestError naming `field`."""
    if not isinstance(schema, Mapping):
        raise RequestError(f"{field} must be a JSON schema object", field)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise RequestError(f"{field} is not a valid JSON schema: {exc.message}", field) from None
    return dict(schema)


class ToolParser:
    """A model family's call syntax; subclass it and set the class attributes (see the module's docstring)."""

    name: str  # what --tool-parser names
    begin: str = ""  # written before each call ("" = calls only at the start of the answer)
    end: str = ""  # written after each call
    key: str = "arguments"  # the wrapper's key for the arguments
    trigger: str = ""  # the text that starts a call when the model may choose (a prefix of call_prefix)

    # -- prompting -------------------------------------------------------------------------------------
    def call_prefix(self, name: str) -> str:
        return f'{self.begin}{{"name": {json.dumps(name)}, "{self.key}": '

    def call_suffix(self) -> str:
        return "}" + self.end

    def call_text(self, name: str, arguments: str) -> str:
        """A past call as the model writes it (history rendered for a template without tools)."""
        return self.call_prefix(name) + arguments + self.call_suffix()

    def result_message(self, content: str) -> dict[str, str]:
        """A tool's result as a message for a template without tools."""
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}

    def format_hint(self) -> str:
        """How to write a call, for the default prompt."""
        return f"To call a function, reply with:\n{self.call_text('<function-name>', '<arguments-json-object>')}"

    def system_prompt(self, tools: Sequence[Tool]) -> str:
        """The default tool prompt: the tools as JSON and the call syntax, for a system message."""
        listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to answer. The functions, as JSON:\n"
                f"<tools>\n{listing}\n</tools>\n\n{self.format_hint()}")

    # -- constraining ----------------------------------------------------------------------------------
    def constraint(self, tools: Sequence[Tool], choice: ToolChoice, field: str = "tools") -> Constraint | None:
        """A structural tag (xgrammar's JSON format): forced -> exactly one valid call; auto -> text or calls,
        each call valid once begun; none -> no constraint."""
        if choice.mode == "none" or not tools:
            return None
        chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        tags = [{"type": "tag", "begin": self.call_prefix(t.name),
                 "content": {"type": "json_schema", "json_schema": t.schema}, "end": self.call_suffix()}
                for t in chosen]
        if choice.forced:
            fmt: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        else:
            fmt = {"type": "triggered_tags", "triggers": [self.trigger or self.call_prefix("")[:2]], "tags": tags,
                   "at_least_one": False, "stop_after_first": not choice.parallel}
        spec = json.dumps({"type": "structural_tag", "format": fmt}, sort_keys=True, separators=(",", ":"))
        return Constraint("structural_tag", spec, field)

    # -- parsing ---------------------------------------------------------------------------------------
    def stream(self) -> CallStream:
        """A fresh incremental reader for one answer."""
        return CallStream(self)

    def parse(self, text: str) -> ParsedOutput:
        """The whole answer's content and calls (the same reading as the stream's)."""
        return collect(self.stream().feed(text, final=True))

    def __repr__(self) -> str:
        return f"<tool parser {self.name!r}>"


def plain_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool],
                   parser: ToolParser) -> list[dict[str, Any]]:
    """A conversation with tools for a template that knows none: the default tool prompt in the system message,
    past calls written in the parser's syntax, tool results as user messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append(parser.result_message(m.get("content") or ""))
        elif m.get("tool_calls"):
            calls = [parser.call_text(c["function"]["name"], json.dumps(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(([m["content"]] if m.get("content") else []) + calls)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        section = parser.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def parse_arguments(text: str, field: str) -> Any:
    """A past call's arguments (JSON text) as the value templates get; RequestError naming `field` if not JSON."""
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise RequestError(f"{field} must be JSON text: {exc.msg}", field) from None


def require_parser(parser: ToolParser | None) -> ToolParser:
    """The server's tool parser, or a 400 when it has none."""
    if parser is None:
        raise RequestError("this server has no tool parser (pagoda serve --tool-parser NAME)", "tools")
    return parser


class CallHistory:
    """The calls a conversation has made so far: a tool result must answer one of them."""

    def __init__(self) -> None:
        self.call_ids: set[str] = set()

    def called(self, call_id: str) -> None:
        """An earlier message made the call `call_id`."""
        self.call_ids.add(call_id)

    def check_result(self, call_id: str | None, field: str, what: str) -> None:
        """A result naming `call_id` (in `field`) answers an earlier call, `what` in the protocol's words."""
        if call_id not in self.call_ids:
            raise RequestError(f"{field} {call_id!r} names no earlier {what}", field)
