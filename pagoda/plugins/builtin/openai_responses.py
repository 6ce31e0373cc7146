"""OpenAI responses: POST /v1/responses (input items, instructions, a typed event stream).

The stream follows the event sequence the SDK's `responses.stream()` helper
accumulates: created, in_progress, output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done,
completed. Every event carries `sequence_number` and the same response id.
A response cut off by max_output_tokens ends with `response.completed` whose
response has status "incomplete" (the helper needs that event to finish).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from pagoda.core.outputs import AnswerDelta
from pagoda.core.request import FinishReason
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.builtin import openai_tools as ot
from pagoda.plugins.builtin.openai_responses_tools import TEXT_PART_TYPES, OutputItems, input_message
from pagoda.plugins.client import ClientAnswer, ClientError, ClientRequest
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import Answer, ApiError, Endpoint, EngineRequest, Event, Exchange, ServeContext
from pagoda.plugins.request_fields import RequestError, join_text_parts
from pagoda.plugins.route import ServedModel
from pagoda.plugins.tools import CallHistory
from pagoda.plugins.turn import Turn, engine_request


class InputContent(msgspec.Struct):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant"] = "user"
    content: str | list[InputContent] | None = None
    type: str = "message"
    # function_call and function_call_output items:
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    id: str | None = None
    status: str | None = None

    def __post_init__(self) -> None:
        if self.type == "message" and self.content is None:
            raise ValueError("a message item needs content")


class ResponsesRequest(oc.Sampling, kw_only=True):
    # Known fields of OpenAI's body that pagoda does not serve -> the values that change nothing (None/false too).
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "previous_response_id": (), "conversation": (), "background": (), "reasoning": (), "prompt": (),
        "include": ([],), "truncation": ("disabled",), "context_management": (), "store": (),
        "service_tier": ("auto", "default"),
    }

    input: Annotated[str, msgspec.Meta(min_length=1)] | Annotated[list[InputItem], msgspec.Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: oc.PositiveInt | None = None
    top_logprobs: oc.TopLogprobs | None = None
    metadata: dict[str, str] | None = None
    text: ot.TextConfig | None = None
    tools: list[ot.ResponsesTool] | None = None
    tool_choice: ot.ChoiceMode | ot.ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None


def conversation(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat-template messages: instructions as the system message, then the input items (function calls
    and their outputs as an assistant's tool_calls and tool messages)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    if not body.input:
        raise RequestError("input must hold at least one item", "input")
    history = CallHistory()
    for i, item in enumerate(body.input):
        if item.type in ("function_call", "function_call_output"):
            message = input_message(item, i, messages, history)
            if message is not None:
                messages.append(message)
            continue
        if item.type != "message":
            raise RequestError(f"input[{i}]: only message items are supported, got type {item.type!r}",
                               f"input[{i}].type")
        text = join_text_parts(item.content, f"input[{i}].content", TEXT_PART_TYPES)
        messages.append(oc.template_message(item.role, text))
    return messages


def responses_turn(body: ResponsesRequest) -> Turn:
    """The body as a turn: instructions and input items, tools, choice, text format and sampling fields."""
    tools = ot.responses_tools(body.tools)
    choice, choice_field = ot.tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
    constraint = ot.text_format(body.text)
    return Turn(
        messages=conversation(body),
        tools=tools,
        tool_choice=choice,
        constraint=constraint,
        max_tokens=body.max_output_tokens,
        sampling=dict(body.sampling_fields(), logprobs=body.top_logprobs),
        stream=body.stream,
        cache_salt=body.cache_salt,
        priority=body.priority,
        choice_field=choice_field,
        format_field="text.format",
        renames={"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
    )


class Responses(Endpoint):
    name = "openai-responses"
    protocol = "responses"
    path = "/v1/responses"
    body_type = ResponsesRequest
    id_prefix = "resp_"
    errors = OPENAI_ERRORS

    def prepare(self, body: ResponsesRequest, ctx: ServeContext) -> EngineRequest:
        return engine_request(responses_turn(body), ctx)

    # -- shapes ----------------------------------------------------------
    def _message_id(self, exchange: Exchange) -> str:
        return exchange.state.id("msg_", 0)  # the first message item's (OutputItems names the later ones alike)

    def _logprobs(self, exchange: Exchange, tokens) -> list[dict[str, Any]]:
        return oc.chat_logprobs(exchange, tokens) if exchange.body.top_logprobs is not None else []

    def _part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _message(self, exchange: Exchange, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "message", "id": self._message_id(exchange), "role": "assistant", "status": status,
                "content": content}

    def _response(self, exchange: Exchange, status: str, output: list[dict[str, Any]],
                  answer: Answer | None = None) -> dict[str, Any]:
        body: ResponsesRequest = exchange.body
        cut_off = answer is not None and answer.finish_reason is FinishReason.LENGTH
        return {
            "id": exchange.id,
            "object": "response",
            "created_at": exchange.created,
            "model": exchange.model,
            "status": status,
            "output": output,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": msgspec.to_builtins(body.tool_choice) if body.tool_choice is not None else "auto",
            "tools": msgspec.to_builtins(body.tools or []),
            "metadata": body.metadata or {},
            "text": {"format": msgspec.to_builtins(body.text.format) if body.text and body.text.format
                     else {"type": "text"}},
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut_off else None,
            "usage": None if answer is None else _usage(answer.num_prompt_tokens, answer.num_output_tokens,
                                                            answer.num_cached_tokens),
        }

    def _final(self, exchange: Exchange, answer: Answer) -> dict[str, Any]:
        status = "incomplete" if answer.finish_reason is FinishReason.LENGTH else "completed"
        if exchange.request.tool_parser is not None:  # the same items the stream builds, from the whole text at once
            items = self._items(exchange, stream=False)
            items.whole(answer.text)
            items.close(status)
            return self._response(exchange, status, items.items, answer)
        part = self._part(answer.text, self._logprobs(exchange, answer.logprobs))
        return self._response(exchange, status, [self._message(exchange, status, [part])], answer)

    def render(self, exchange: Exchange, answer: Answer) -> dict[str, Any]:
        return self._final(exchange, answer)

    # -- stream ----------------------------------------------------------
    def _event(self, exchange: Exchange, kind: str, **fields: Any) -> Event:
        return Event({"type": kind, "sequence_number": exchange.state.next_event_number(), **fields}, name=kind)

    def _items(self, exchange: Exchange, stream: bool = True) -> OutputItems:
        """The output items' builder; a unary body's makes no events (nor uses up sequence numbers)."""
        emit = (lambda kind, **fields: self._event(exchange, kind, **fields)) if stream else (lambda kind, **_: Event(kind))
        return OutputItems(exchange, emit)

    async def _tool_stream(self, exchange: Exchange, deltas: AsyncIterator[AnswerDelta]) -> AsyncIterator[Event]:
        """The stream of an answer read for tool calls: each output item opens when it begins."""
        yield self._event(exchange, "response.created", response=self._response(exchange, "in_progress", []))
        yield self._event(exchange, "response.in_progress", response=self._response(exchange, "in_progress", []))
        items = self._items(exchange)
        seen: list[AnswerDelta] = []
        async for out in deltas:
            seen.append(out)
            for event in items.delta(out):
                yield event
        if not seen:
            return
        answer = Answer.from_deltas(seen)
        status = "incomplete" if answer.finish_reason is FinishReason.LENGTH else "completed"
        for event in items.close(status):
            yield event
        yield self._event(exchange, "response.completed", response=self._response(exchange, status, items.items, answer))

    async def render_stream(self, exchange: Exchange, deltas: AsyncIterator[AnswerDelta]) -> AsyncIterator[Event]:
        if exchange.request.tool_parser is not None:
            async for event in self._tool_stream(exchange, deltas):
                yield event
            return
        at = {"item_id": self._message_id(exchange), "output_index": 0, "content_index": 0}
        yield self._event(exchange, "response.created", response=self._response(exchange, "in_progress", []))
        yield self._event(exchange, "response.in_progress", response=self._response(exchange, "in_progress", []))
        yield self._event(exchange, "response.output_item.added", output_index=0,
                          item=self._message(exchange, "in_progress", []))
        yield self._event(exchange, "response.content_part.added", **at, part=self._part("", []))
        seen: list[AnswerDelta] = []
        async for out in deltas:
            seen.append(out)
            if out.new_text or out.logprobs:
                yield self._event(exchange, "response.output_text.delta", **at, delta=out.new_text,
                                  logprobs=self._logprobs(exchange, out.logprobs))
        if not seen:
            return
        final = self._final(exchange, Answer.from_deltas(seen))
        message = final["output"][0]
        part = message["content"][0]
        yield self._event(exchange, "response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"])
        yield self._event(exchange, "response.content_part.done", **at, part=part)
        yield self._event(exchange, "response.output_item.done", output_index=0, item=message)
        yield self._event(exchange, "response.completed", response=final)

    def render_stream_error(self, exchange: Exchange, error: ApiError) -> list[Event]:
        # A top-level "error" object makes the SDK raise mid-stream.
        body = self.errors.render_error(error)["error"]
        return [self._event(exchange, "error", code=body["code"], message=body["message"], param=body["param"], error=body)]

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        # a conversation's earlier turns go as input items, each turn's answer as an assistant message
        turns = ask.messages()
        prompt = ask.prompt if len(turns) == 1 else turns
        body = {**ask.sampling_fields(), "input": prompt, "max_output_tokens": ask.max_tokens}
        if ask.json_schema is not None:
            body["text"] = {"format": {"type": "json_schema", "name": "answer", "schema": ask.json_schema}}
        return body

    def client_answer(self) -> ResponseAnswer:
        return ResponseAnswer()


class ResponseAnswer(ClientAnswer):
    """A client's view of a response: the output text, its status, the usage of the final response."""

    def unary(self, body: dict[str, Any]) -> None:
        self.parts.append("".join(c["text"] for item in body["output"] for c in item.get("content", [])))
        self._final(body)

    def event(self, data: Any) -> None:
        kind = data["type"]
        if kind == "error":
            raise ClientError(data["message"])
        if kind == "response.output_text.delta":
            self.parts.append(data["delta"])
        elif kind == "response.completed":
            self._final(data["response"])

    def _final(self, response: dict[str, Any]) -> None:
        self.finish_reason = "length" if response["status"] == "incomplete" else "stop"
        self.prompt_tokens = response["usage"]["input_tokens"]
        self.output_tokens = response["usage"]["output_tokens"]
        self.cached_tokens = (response["usage"].get("input_tokens_details") or {}).get("cached_tokens", 0)


def _usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """Responses usage; `input_tokens` counts cached tokens too, as OpenAI's does."""
    return {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


@hookimpl
def pagoda_register_protocols(register):
    register(Responses())


@hookimpl
def pagoda_model_card(model: ServedModel) -> dict[str, Any]:
    """OpenAI's fields of the model card (client.models.list and retrieve read them)."""
    return oc.model_card(model)
