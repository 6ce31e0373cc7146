"""OpenAI chat completions: POST /v1/chat/completions (messages through the model's chat template)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import msgspec

from pagoda.core.outputs import RequestOutput
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.builtin import openai_tools as ot
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import Call, Completion, Endpoint, Event
from pagoda.plugins.protocol import Generation, RequestError, ServeContext, join_text_parts, make_sampling_params
from pagoda.plugins.tools import ArgumentsDelta, CallStarted, TextDelta, ToolEvent, parse_arguments, tool_use


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
    called: set[str] = set()
    for i, m in enumerate(messages):
        message: dict[str, Any] = oc.template_message(m.role, join_text_parts(m.content, f"{field}[{i}].content"))
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": parse_arguments(c.function.arguments, f"{field}[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
            called.update(c.id for c in m.tool_calls)
        if m.role == "tool":
            if not m.tool_call_id:
                raise RequestError(f"{field}[{i}]: a tool message needs tool_call_id", f"{field}[{i}].tool_call_id")
            if m.tool_call_id not in called:
                raise RequestError(f"{field}[{i}].tool_call_id {m.tool_call_id!r} names no earlier assistant tool call",
                                   f"{field}[{i}].tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


class ChatCompletions(oc.Choices, Endpoint):
    name = "openai-chat"
    protocol = "chat"
    path = "/v1/chat/completions"
    body_type = ChatRequest
    id_prefix = "chatcmpl-"
    errors = oc.OPENAI_ERRORS

    def prepare(self, body: ChatRequest, ctx: ServeContext) -> Generation:
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs to be true", "top_logprobs")
        tools = ot.chat_tools(body.tools)
        choice = ot.tool_choice(body.tool_choice, tools, body.parallel_tool_calls, "tool_choice")
        constraint, parser, listed = tool_use(ctx, tools, choice, ot.response_format(body.response_format),
                                              "response_format")
        ids = ctx.encode_chat(template_messages(body.messages), listed)
        max_tokens = body.max_completion_tokens or body.max_tokens or ctx.default_max_tokens(len(ids))
        params = make_sampling_params(
            limits=ctx.limits,
            max_tokens=max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            constraint=constraint,
            **body.sampling_fields(),
        )
        return Generation(ids, params, stream=body.stream, cache_salt=body.cache_salt, tool_parser=parser, n=body.n)

    def _logprobs(self, call: Call, tokens) -> dict[str, Any] | None:
        return {"content": oc.chat_logprobs(call, tokens)} if call.body.logprobs else None

    def _chunk(self, call: Call, delta: dict[str, Any], finish_reason: str | None,
               logprobs: Any = None) -> dict[str, Any]:
        chunk = {
            "id": call.id,
            "object": "chat.completion.chunk",
            "created": call.created,
            "model": call.model,
            "choices": [{"index": call.index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
        }
        if call.body.include_usage:
            chunk["usage"] = None
        return chunk

    def _message(self, call: Call, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for the answer's text, and whether it holds tool calls."""
        parser = call.generation.tool_parser
        if parser is None:
            return {"role": "assistant", "content": text, "refusal": None}, False
        parsed = parser.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None, "refusal": None}
        if parsed.calls:
            message["tool_calls"] = [{"id": ot.call_id(call, i), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for i, c in enumerate(parsed.calls)]
        elif message["content"] is None:
            message["content"] = ""
        return message, bool(parsed.calls)

    def _finish_reason(self, reason, called: bool) -> str:
        text_reason = oc.finish_reason(reason)
        return "tool_calls" if called and text_reason == "stop" else text_reason

    def _delta(self, call: Call, event: ToolEvent) -> dict[str, Any] | None:
        """A stream delta for one parser event: content, a call's first delta (id, name), an arguments fragment."""
        if isinstance(event, TextDelta):
            return {"content": event.text}
        if isinstance(event, CallStarted):
            return {"tool_calls": [{"index": event.index, "id": ot.call_id(call, event.index), "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        if isinstance(event, ArgumentsDelta):
            return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        return None

    def render(self, call: Call, completion: Completion) -> dict[str, Any]:
        message, called = self._message(call, completion.text)
        return {
            "id": call.id,
            "object": "chat.completion",
            "created": call.created,
            "model": call.model,
            "choices": [{
                "index": call.index,
                "message": message,
                "finish_reason": self._finish_reason(completion.finish_reason, called),
                "logprobs": self._logprobs(call, completion.logprobs),
            }],
            "usage": oc.usage(completion.num_prompt_tokens, completion.num_output_tokens, completion.num_cached_tokens),
        }

    async def render_stream(self, call: Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[Event]:
        yield Event(self._chunk(call, {"role": "assistant", "content": ""}, None))
        parser = call.generation.tool_parser
        reader = parser.stream() if parser is not None else None
        last = None
        async for out in outputs:
            last = out
            if reader is None:
                if out.new_text or out.logprobs:
                    yield Event(self._chunk(call, {"content": out.new_text}, None, self._logprobs(call, out.logprobs)))
                continue
            logprobs = self._logprobs(call, out.logprobs) if out.logprobs else None
            for event in reader.feed(out.new_text) + (reader.finish() if out.finished else []):
                delta = self._delta(call, event)
                if delta is not None:
                    yield Event(self._chunk(call, delta, None, logprobs))
                    logprobs = None  # a token's logprobs ride on the first delta it makes
            if logprobs is not None:
                yield Event(self._chunk(call, {"content": ""}, None, logprobs))
        if last is None:
            return
        called = reader is not None and reader.num_calls > 0
        yield Event(self._chunk(call, {}, self._finish_reason(last.finish_reason, called)))
        if call.body.include_usage:
            yield Event(oc.usage_chunk(self._chunk(call, {}, None), last))
        yield Event("[DONE]")

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        body = {**oc.client_fields(ask), "messages": ask.messages()}
        if ask.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ask.json_schema}}
        return body

    def client_answer(self) -> ChatAnswer:
        return ChatAnswer()


class ChatAnswer(oc.ChoicesAnswer):
    """A client's view of a chat completion: the message's content, or each chunk's delta."""

    def choice_text(self, choice: dict[str, Any], unary: bool) -> str:
        return (choice["message"] if unary else choice["delta"]).get("content") or ""


@hookimpl
def pagoda_register_protocols(register):
    register(ChatCompletions())
