"""Function calls on POST /v1/responses: `function_call` / `function_call_output` input items, and the output
items (and stream events) of an answer read for tool calls.

An answer read by the tool parser becomes output items in the order the model wrote them: a `message` for each
stretch of text, a `function_call` (`call_id` "call_...", item id "fc_...") for each call. The stream opens each
item when it begins:

    message        output_item.added, content_part.added, output_text.delta..., output_text.done,
                   content_part.done, output_item.done
    function_call  output_item.added (arguments ""), function_call_arguments.delta..., function_call_arguments.done,
                   output_item.done

and the unary body is built by the same `OutputItems`, so both hold the same items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagoda.plugins.protocol import Event, Exchange
from pagoda.plugins.request_fields import RequestError, join_text_parts
from pagoda.plugins.tool_render import ToolRenderer
from pagoda.plugins.tools import CallHistory, parse_arguments

TEXT_PART_TYPES = ("input_text", "output_text", "text")


def input_message(item: Any, i: int, messages: list[dict[str, Any]], history: CallHistory) -> dict[str, Any] | None:
    """A function_call or function_call_output item as a chat-template message (a call joins the assistant
    message before it); None when it joined one. A result must name an earlier call."""
    if item.type == "function_call":
        if not item.call_id or not item.name:
            raise RequestError(f"input[{i}]: a function_call item needs call_id and name", f"input[{i}].call_id")
        history.called(item.call_id)
        entry = {"id": item.call_id, "type": "function", "function": {
            "name": item.name, "arguments": parse_arguments(item.arguments or "", f"input[{i}].arguments")}}
        if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
            messages[-1]["tool_calls"].append(entry)
            return None
        return {"role": "assistant", "content": "", "tool_calls": [entry]}
    history.check_result(item.call_id, f"input[{i}].call_id", "function_call item")
    output = item.output if isinstance(item.output, str) else join_text_parts(item.output, f"input[{i}].output",
                                                                             TEXT_PART_TYPES)
    return {"role": "tool", "tool_call_id": item.call_id, "content": output}


class OutputItems(ToolRenderer[Event]):
    """The output items of one answer, built from the parser's events; `emit` makes each step's stream events."""

    def __init__(self, exchange: Exchange, emit: Callable[..., Event]) -> None:
        super().__init__(exchange)
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.text_item: dict[str, Any] | None = None  # the message being written
        self.call_items: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item

    def text(self, text: str) -> list[Event]:
        out = self._open_message() if self.text_item is None else []
        self.text_item["content"][0]["text"] += text
        return out + [self.emit("response.output_text.delta", **self._at(self.text_item), delta=text, logprobs=[])]

    def call_started(self, index: int, name: str) -> list[Event]:
        out = self._close_message("completed")
        item = {"type": "function_call", "id": self.exchange.state.id("fc_", index), "call_id": self.call_id(index),
                "name": name, "arguments": "", "status": "in_progress"}
        self.call_items[index] = item
        self.items.append(item)
        return out + [self.emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def arguments(self, index: int, text: str) -> list[Event]:
        item = self.call_items[index]
        item["arguments"] += text
        return [self.emit("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=self.items.index(item), delta=text)]

    def call_ended(self, index: int) -> list[Event]:
        return self._close_call(self.call_items[index], "completed")

    def close(self, status: str) -> list[Event]:
        """The answer ended: what is still open is closed with `status`."""
        out = self._close_message(status)
        for item in self.call_items.values():
            if item["status"] == "in_progress":
                out += self._close_call(item, status)
        return out

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def _open_message(self) -> list[Event]:
        n = sum(item["type"] == "message" for item in self.items)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.text_item = {"type": "message", "id": self.exchange.state.id("msg_", n), "role": "assistant",
                          "status": "in_progress", "content": [part]}
        self.items.append(self.text_item)
        added = {**self.text_item, "content": []}
        return [self.emit("response.output_item.added", output_index=len(self.items) - 1, item=added),
                self.emit("response.content_part.added", **self._at(self.text_item), part=dict(part))]

    def _close_message(self, status: str) -> list[Event]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        return [self.emit("response.output_text.done", **self._at(item), text=part["text"], logprobs=[]),
                self.emit("response.content_part.done", **self._at(item), part=dict(part)),
                self.emit("response.output_item.done", output_index=self.items.index(item), item=_copy(item))]

    def _close_call(self, item: dict[str, Any], status: str) -> list[Event]:
        item["status"] = status
        index = self.items.index(item)
        return [self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]),
                self.emit("response.output_item.done", output_index=index, item=dict(item))]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item.get("content", [])]}
