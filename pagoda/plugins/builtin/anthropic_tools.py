"""Tools on POST /v1/messages: `tools`, `tool_choice`, `tool_use` / `tool_result` blocks, `output_config.format`.

    tools        [{"name", "description", "input_schema"}]   (server tools, which carry a `type`, are refused)
    tool_choice  {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}
    history      an assistant's tool_use blocks -> its tool_calls; a user's tool_result blocks -> tool messages,
                 each naming an earlier tool_use id
    answer       a text block for each stretch of text, a tool_use block ("toolu_..." ids, `input` the parsed
                 arguments) for each call; the stream opens each with content_block_start and sends a call's
                 arguments as input_json_delta fragments; stop_reason "tool_use" when it called
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from pagoda.core.constraint import Constraint
from pagoda.plugins.protocol import Event, Exchange
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.tool_render import ToolRenderer
from pagoda.plugins.tools import CallHistory, Tool, ToolChoice, check_schema


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # server tools (web search, ...) name a type
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    format: JsonFormat | None = None
    effort: str | None = None


def tools_of(tools: list[AnthropicTool] | None) -> list[Tool]:
    """The request's custom tools, each schema checked."""
    out = []
    for i, t in enumerate(tools or []):
        if t.type not in (None, "custom"):
            raise RequestError(f"tools.{i}.type: server tools ({t.type!r}) are not supported", f"tools.{i}.type")
        if t.input_schema is None:
            raise RequestError(f"tools.{i}.input_schema is required", f"tools.{i}.input_schema")
        out.append(Tool(t.name, t.description or "", check_schema(t.input_schema, f"tools.{i}.input_schema")))
    return out


def choice_of(raw: AnthropicToolChoice | None, tools: list[Tool]) -> tuple[ToolChoice, str]:
    """Anthropic's choice as pagoda's (auto -> auto, any -> required, tool -> named, none -> none), and the field a
    bad one is named by (the turn checks it against the tools)."""
    raw = raw or AnthropicToolChoice(type="auto" if tools else "none")
    if raw.type == "tool" and not raw.name:
        raise RequestError("tool_choice.name is required for type tool", "tool_choice.name")
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[raw.type]
    choice = ToolChoice(mode, raw.name if raw.type == "tool" else None, not raw.disable_parallel_tool_use)
    return choice, "tool_choice.name" if raw.type == "tool" else "tool_choice"


def output_format(config: OutputConfig | None) -> Constraint | None:
    if config is None or config.format is None:
        return None
    return Constraint.json_schema(check_schema(config.format.schema, "output_config.format.schema"),
                                  "output_config.format")


def message_entries(role: str, blocks: Sequence[Any], i: int, history: CallHistory) -> list[dict[str, Any]]:
    """One message's blocks as chat-template messages: text joined; tool_use -> tool_calls; tool_result -> a tool
    message (before the text that follows it), which must name an earlier tool_use."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "tool_use" and role == "assistant":
            if not b.id or not b.name:
                raise RequestError(f"{where}: a tool_use block needs id and name", f"{where}.id")
            history.called(b.id)
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}})
        elif b.type == "tool_result" and role == "user":
            history.check_result(b.tool_use_id, f"{where}.tool_use_id", "tool_use block")
            results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b.content, where)})
        else:
            raise RequestError(f"{where}: content of type {b.type!r} is not supported here", where)
    entries = list(results)
    if calls:
        entries.append({"role": role, "content": "\n".join(texts), "tool_calls": calls})
    elif texts or not results:
        entries.append({"role": role, "content": "\n".join(texts)})
    return entries


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise RequestError(f"{where}.content.{k}: only text is supported in a tool_result", f"{where}.content.{k}")
        parts.append(part.get("text") or "")
    return "\n".join(parts)


class Blocks(ToolRenderer[Event]):
    """The answer's content blocks, built from the parser's events, with each step's stream events."""

    call_id_prefix = "toolu_"

    def __init__(self, exchange: Exchange) -> None:
        super().__init__(exchange)
        self.blocks: list[dict[str, Any]] = []
        self.arguments_of: dict[int, list[str]] = {}  # the parser's call index -> its JSON text so far
        self.at: dict[int, int] = {}  # the parser's call index -> its block index
        self.open: int | None = None  # the block being written

    def text(self, text: str) -> list[Event]:
        out = []
        if self.open is None or self.blocks[self.open]["type"] != "text":
            out = self._stop() + self._start({"type": "text", "text": ""})
        self.blocks[self.open]["text"] += text
        return out + [self._delta({"type": "text_delta", "text": text})]

    def call_started(self, index: int, name: str) -> list[Event]:
        out = self._stop()
        self.arguments_of[index] = []
        self.at[index] = len(self.blocks)
        return out + self._start({"type": "tool_use", "id": self.call_id(index), "name": name, "input": {}})

    def arguments(self, index: int, text: str) -> list[Event]:
        self.arguments_of[index].append(text)
        return [self._delta({"type": "input_json_delta", "partial_json": text})]

    def call_ended(self, index: int) -> list[Event]:
        self.blocks[self.at[index]]["input"] = _input("".join(self.arguments_of[index]))
        return self._stop()

    def close(self) -> list[Event]:
        for index, block in self.at.items():
            self.blocks[block]["input"] = _input("".join(self.arguments_of[index]))
        return self._stop()

    def _start(self, block: dict[str, Any]) -> list[Event]:
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        data = {"type": "content_block_start", "index": self.open, "content_block": dict(block)}
        return [Event(data, "content_block_start")]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return Event({"type": "content_block_delta", "index": self.open, "delta": delta}, "content_block_delta")

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        return [Event({"type": "content_block_stop", "index": index}, "content_block_stop")]


def _input(arguments: str) -> Any:
    # A call cut off by max_tokens has no whole JSON: its input is left empty rather than invented.
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}
