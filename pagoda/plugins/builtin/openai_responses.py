"""OpenAI responses: POST /v1/responses (input items, instructions, a typed event stream).

The stream follows the event sequence the SDK's `responses.stream()` helper
accumulates: created, in_progress, output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done,
completed. Every event carries `sequence_number` and the same response id.
A response cut off by max_output_tokens ends with `response.completed` whose
response has status "incomplete" (the helper needs that event to finish).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from pagoda.core.outputs import RequestOutput
from pagoda.core.request import FinishReason
from pagoda.plugins.builtin import openai_common as oc
from pagoda.plugins.builtin import openai_tools as ot
from pagoda.plugins.builtin.openai_responses_tools import OutputItems, input_message
from pagoda.plugins.client import ClientAnswer, ClientError, ClientRequest
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import ApiError, Call, Completion, Endpoint, Event
from pagoda.plugins.protocol import Generation, RequestError, ServeContext, join_text_parts, make_sampling_params
from pagoda.plugins.tools import tool_use


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
    called: set[str] = set()
    for i, item in enumerate(body.input):
        if item.type in ("function_call", "function_call_output"):
            message = input_message(item, i, messages, called)
            if message is not None:
                messages.append(message)
            continue
        if item.type != "message":
            raise RequestError(f"input[{i}]: only message items are supported, got type {item.type!r}",
                               f"input[{i}].type")
        text = join_text_parts(item.content, f"input[{i}].content", ("input_text", "output_text", "text"))
        messages.append(oc.template_message(item.role, text))
    return messages


class Responses(Endpoint):
    name = "openai-responses"
    protocol = "responses"
    path = "/v1/responses"
    body_type = ResponsesRequest
    id_prefix = "resp_"
    errors = oc.OPENAI_ERRORS

    def prepare(self, body: ResponsesRequest, ctx: ServeContext) -> Generation:
        tools = ot.responses_tools(body.tools)
        choice = ot.tool_choice(body.tool_choice, tools, body.parallel_tool_calls, "tool_choice")
        constraint, parser, listed = tool_use(ctx, tools, choice, ot.text_format(body.text), "text.format")
        ids = ctx.encode_chat(conversation(body), listed)
        params = make_sampling_params(
            {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
            limits=ctx.limits,
            max_tokens=body.max_output_tokens or ctx.default_max_tokens(len(ids)),
            logprobs=body.top_logprobs,
            constraint=constraint,
            **body.sampling_fields(),
        )
        return Generation(ids, params, stream=body.stream, cache_salt=body.cache_salt, tool_parser=parser)

    # -- shapes ----------------------------------------------------------
    def _message_id(self, call: Call) -> str:
        return call.state.setdefault("message_id", f"msg_{secrets.token_hex(12)}")

    def _logprobs(self, call: Call, tokens) -> list[dict[str, Any]]:
        return oc.chat_logprobs(call, tokens) if call.body.top_logprobs is not None else []

    def _part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _message(self, call: Call, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "message", "id": self._message_id(call), "role": "assistant", "status": status,
                "content": content}

    def _response(self, call: Call, status: str, output: list[dict[str, Any]],
                  completion: Completion | None = None) -> dict[str, Any]:
        body: ResponsesRequest = call.body
        cut_off = completion is not None and completion.finish_reason is FinishReason.LENGTH
        return {
            "id": call.id,
            "object": "response",
            "created_at": call.created,
            "model": call.model,
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
            "usage": None if completion is None else _usage(completion.num_prompt_tokens, completion.num_output_tokens,
                                                            completion.num_cached_tokens),
        }

    def _final(self, call: Call, completion: Completion) -> dict[str, Any]:
        status = "incomplete" if completion.finish_reason is FinishReason.LENGTH else "completed"
        parser = call.generation.tool_parser
        if parser is not None:  # the same items the stream builds, from the whole text at once
            items = self._items(call, stream=False)
            reader = parser.stream()
            items.apply(reader.feed(completion.text) + reader.finish())
            items.close(status)
            return self._response(call, status, items.items, completion)
        part = self._part(completion.text, self._logprobs(call, completion.logprobs))
        return self._response(call, status, [self._message(call, status, [part])], completion)

    def render(self, call: Call, completion: Completion) -> dict[str, Any]:
        return self._final(call, completion)

    # -- stream ----------------------------------------------------------
    def _event(self, call: Call, kind: str, **fields: Any) -> Event:
        seq = call.state.get("sequence_number", 0)
        call.state["sequence_number"] = seq + 1
        return Event({"type": kind, "sequence_number": seq, **fields}, name=kind)

    def _items(self, call: Call, stream: bool = True) -> OutputItems:
        """The output items' builder; a unary body's makes no events (nor uses up sequence numbers)."""
        emit = (lambda kind, **fields: self._event(call, kind, **fields)) if stream else (lambda kind, **_: Event(kind))
        return OutputItems(call, emit, self._message_id(call))

    async def _tool_stream(self, call: Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[Event]:
        """The stream of an answer read for tool calls: each output item opens when it begins."""
        yield self._event(call, "response.created", response=self._response(call, "in_progress", []))
        yield self._event(call, "response.in_progress", response=self._response(call, "in_progress", []))
        items, reader = self._items(call), call.generation.tool_parser.stream()
        seen: list[RequestOutput] = []
        async for out in outputs:
            seen.append(out)
            for event in items.apply(reader.feed(out.new_text) + (reader.finish() if out.finished else [])):
                yield event
        if not seen:
            return
        completion = Completion.from_outputs(seen)
        status = "incomplete" if completion.finish_reason is FinishReason.LENGTH else "completed"
        for event in items.close(status):
            yield event
        yield self._event(call, "response.completed", response=self._response(call, status, items.items, completion))

    async def render_stream(self, call: Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[Event]:
        if call.generation.tool_parser is not None:
            async for event in self._tool_stream(call, outputs):
                yield event
            return
        at = {"item_id": self._message_id(call), "output_index": 0, "content_index": 0}
        yield self._event(call, "response.created", response=self._response(call, "in_progress", []))
        yield self._event(call, "response.in_progress", response=self._response(call, "in_progress", []))
        yield self._event(call, "response.output_item.added", output_index=0,
                          item=self._message(call, "in_progress", []))
        yield self._event(call, "response.content_part.added", **at, part=self._part("", []))
        seen: list[RequestOutput] = []
        async for out in outputs:
            seen.append(out)
            if out.new_text or out.logprobs:
                yield self._event(call, "response.output_text.delta", **at, delta=out.new_text,
                                  logprobs=self._logprobs(call, out.logprobs))
        if not seen:
            return
        final = self._final(call, Completion.from_outputs(seen))
        message = final["output"][0]
        part = message["content"][0]
        yield self._event(call, "response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"])
        yield self._event(call, "response.content_part.done", **at, part=part)
        yield self._event(call, "response.output_item.done", output_index=0, item=message)
        yield self._event(call, "response.completed", response=final)

    def render_stream_error(self, call: Call, error: ApiError) -> list[Event]:
        # A top-level "error" object makes the SDK raise mid-stream.
        body = self.errors.render_error(error)["error"]
        return [self._event(call, "error", code=body["code"], message=body["message"], param=body["param"], error=body)]

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
