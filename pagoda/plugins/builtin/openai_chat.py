"""OpenAI chat completions: POST /v1/chat/completions (messages through the model's chat template)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import msgspec

from pagoda.core.outputs import AnswerDelta
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.builtin import openai_tools as ot
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import Answer, Endpoint, EngineRequest, Event, Exchange, ServeContext
from pagoda.plugins.request_fields import RequestError, join_text_parts
from pagoda.plugins.route import ServedModel
from pagoda.plugins.tool_render import ToolRenderer
from pagoda.plugins.tools import CallHistory, parse_arguments
from pagoda.plugins.turn import Turn, engine_request


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's past calls

    def __post_init__(self) -> None:
        # As OpenAI refuses them: only an assistant message may go without content; a tool result names its call.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")


class ChatRequest(oc.SamplingFields, kw_only=True):
    # Known fields of OpenAI's body that pagoda does not serve -> the values that change nothing (None/false too).
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (),
        "reasoning_effort": (), "verbosity": (), "functions": (), "function_call": ("none",),
        "service_tier": ("auto", "default"), "store": (),
    }

    messages: list[ChatMessage]
    max_tokens: oc.PositiveInt | None = None
    max_completion_tokens: oc.PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: oc.TopLogprobs | None = None
    prompt_logprobs: oc.TopLogprobs | None = None  # vLLM's extension: the response's `prompt_logprobs`
    tools: list[ot.ChatTool] | None = None
    tool_choice: ot.ChoiceMode | ot.ChatNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ot.ResponseFormat | None = None


def template_messages(messages: list[ChatMessage], field: str = "messages") -> list[dict[str, Any]]:
    """Messages as the chat template reads them: a role and plain-text content; an assistant's calls as
    `tool_calls` (arguments parsed), a tool result with its `tool_call_id`, which must name an earlier call."""
    if not messages:
        raise RequestError(f"{field} must hold at least one message", field)
    out: list[dict[str, Any]] = []
    history = CallHistory()
    for i, m in enumerate(messages):
        message: dict[str, Any] = oc.template_message(m.role, join_text_parts(m.content, f"{field}[{i}].content"))
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": parse_arguments(c.function.arguments, f"{field}[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
            for c in m.tool_calls:
                history.called(c.id)
        if m.role == "tool":
            if not m.tool_call_id:
                raise RequestError(f"{field}[{i}]: a tool message needs tool_call_id", f"{field}[{i}].tool_call_id")
            history.check_result(m.tool_call_id, f"{field}[{i}].tool_call_id", "assistant tool call")
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def chat_turn(body: ChatRequest) -> Turn:
    """The body as a turn: its messages, tools, choice, response format and sampling fields."""
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs to be true", "top_logprobs")
    tools = ot.chat_tools(body.tools)
    choice, choice_field = ot.tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
    constraint = ot.response_format(body.response_format)
    return Turn(
        messages=template_messages(body.messages),
        tools=tools,
        tool_choice=choice,
        constraint=constraint,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        sampling=dict(body.sampling_fields(), logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                      prompt_logprobs=body.prompt_logprobs),
        n=body.n,
        stream=body.stream,
        cache_salt=body.cache_salt,
        priority=body.priority,
        choice_field=choice_field,
        format_field="response_format",
    )


class ChatCompletions(oc.Choices, Endpoint):
    name = "openai-chat"
    protocol = "chat"
    path = "/v1/chat/completions"
    body_type = ChatRequest
    id_prefix = "chatcmpl-"
    errors = OPENAI_ERRORS

    def prepare(self, body: ChatRequest, ctx: ServeContext) -> EngineRequest:
        return engine_request(chat_turn(body), ctx)

    def _logprobs(self, exchange: Exchange, tokens) -> dict[str, Any] | None:
        return {"content": oc.chat_logprobs(exchange, tokens)} if exchange.body.logprobs else None

    def _chunk(self, exchange: Exchange, delta: dict[str, Any], finish_reason: str | None,
               logprobs: Any = None) -> dict[str, Any]:
        chunk = {
            "id": exchange.id,
            "object": "chat.completion.chunk",
            "created": exchange.created,
            "model": exchange.model,
            "choices": [{"index": exchange.index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
        }
        if exchange.body.include_usage:
            chunk["usage"] = None
        return chunk

    def _message(self, exchange: Exchange, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for the answer's text, and whether it holds tool calls."""
        parser = exchange.request.tool_parser
        if parser is None:
            return {"role": "assistant", "content": text, "refusal": None}, False
        parsed = parser.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None, "refusal": None}
        if parsed.calls:
            message["tool_calls"] = [{"id": exchange.state.id(ToolDeltas.call_id_prefix, i), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for i, c in enumerate(parsed.calls)]
        elif message["content"] is None:
            message["content"] = ""
        return message, bool(parsed.calls)

    def _finish_reason(self, reason, called: bool) -> str:
        text_reason = oc.finish_reason(reason)
        return "tool_calls" if called and text_reason == "stop" else text_reason

    def _with_prompt_logprobs(self, exchange: Exchange, body: dict[str, Any], entries) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` beside the choices, when asked."""
        if exchange.body.prompt_logprobs is not None and entries is not None:
            body["prompt_logprobs"] = oc.prompt_logprobs(exchange, entries)
        return body

    def render(self, exchange: Exchange, answer: Answer) -> dict[str, Any]:
        message, called = self._message(exchange, answer.text)
        return self._with_prompt_logprobs(exchange, {
            "id": exchange.id,
            "object": "chat.completion",
            "created": exchange.created,
            "model": exchange.model,
            "choices": [{
                "index": exchange.index,
                "message": message,
                "finish_reason": self._finish_reason(answer.finish_reason, called),
                "logprobs": self._logprobs(exchange, answer.logprobs),
            }],
            "usage": oc.usage(answer.num_prompt_tokens, answer.num_output_tokens, answer.num_cached_tokens),
        }, answer.prompt_logprobs)

    async def render_stream(self, exchange: Exchange, deltas: AsyncIterator[AnswerDelta]) -> AsyncIterator[Event]:
        yield Event(self._chunk(exchange, {"role": "assistant", "content": ""}, None))
        tools = ToolDeltas(exchange) if exchange.request.tool_parser is not None else None
        last = None
        async for out in deltas:
            last = out
            if out.prompt_logprobs is not None and exchange.body.prompt_logprobs is not None:  # before the answer
                yield Event(self._with_prompt_logprobs(exchange, self._chunk(exchange, {"content": ""}, None),
                                                       out.prompt_logprobs))
            if tools is None:
                if out.new_text or out.logprobs:
                    yield Event(self._chunk(exchange, {"content": out.new_text}, None,
                                            self._logprobs(exchange, out.logprobs)))
                continue
            logprobs = self._logprobs(exchange, out.logprobs) if out.logprobs else None
            for delta in tools.delta(out):
                yield Event(self._chunk(exchange, delta, None, logprobs))
                logprobs = None  # a token's logprobs ride on the first delta it makes
            if logprobs is not None:
                yield Event(self._chunk(exchange, {"content": ""}, None, logprobs))
        if last is None:
            return
        called = tools is not None and tools.num_calls > 0
        yield Event(self._chunk(exchange, {}, self._finish_reason(last.finish_reason, called)))
        if exchange.body.include_usage:
            yield Event(oc.usage_chunk(self._chunk(exchange, {}, None), last))
        yield Event("[DONE]")

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        body = {**oc.client_fields(ask), "messages": ask.messages()}
        if ask.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ask.json_schema}}
        return body

    def client_answer(self) -> ChatAnswer:
        return ChatAnswer()


class ToolDeltas(ToolRenderer[dict[str, Any]]):
    """A chat stream's deltas for an answer read for tool calls: content, a call's first delta (its id and name),
    its arguments' fragments."""

    def text(self, text: str) -> list[dict[str, Any]]:
        return [{"content": text}]

    def call_started(self, index: int, name: str) -> list[dict[str, Any]]:
        return [{"tool_calls": [{"index": index, "id": self.call_id(index), "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def arguments(self, index: int, text: str) -> list[dict[str, Any]]:
        return [{"tool_calls": [{"index": index, "function": {"arguments": text}}]}]


class ChatAnswer(oc.ChoicesAnswer):
    """A client's view of a chat completion: the message's content, or each chunk's delta."""

    def choice_text(self, choice: dict[str, Any], unary: bool) -> str:
        return (choice["message"] if unary else choice["delta"]).get("content") or ""


@hookimpl
def pagoda_register_protocols(register):
    register(ChatCompletions())


@hookimpl
def pagoda_model_card(model: ServedModel) -> dict[str, Any]:
    """OpenAI's fields of the model card (client.models.list and retrieve read them)."""
    return oc.model_card(model)
