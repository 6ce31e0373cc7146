"""Anthropic messages: POST /v1/messages (system + messages, named SSE events), and its token count.

    /v1/messages               the endpoint
    /v1/messages/count_tokens  a messages body without max_tokens -> {"input_tokens"}: the endpoint's own
                               `prepare` counts it, so the count is the prompt a message would be generated
                               from (system, template and all); answered in Anthropic's error shape
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from litestar import Request
from litestar.params import JSONBody

from pagoda.core.outputs import AnswerDelta
from pagoda.core.request import FinishReason
from pagoda.plugins.builtin import anthropic_tools as at
from pagoda.plugins.client import ClientAnswer, ClientError, ClientRequest
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import Answer, ApiError, CacheSalt, Endpoint, EngineRequest, ErrorShape, Event, Exchange
from pagoda.plugins.protocol import Priority, ServeContext
from pagoda.plugins.request_fields import RequestError, join_text_parts
from pagoda.plugins.route import Route, RouteContext, ServedModel
from pagoda.plugins.tools import CallHistory
from pagoda.plugins.turn import Turn, engine_request


class TextBlock(msgspec.Struct):
    type: str
    text: str | None = None
    # tool_use and tool_result blocks (pagoda/plugins/builtin/anthropic_tools.py):
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.type == "text" and self.text is None:
            raise ValueError("a text block needs text")


class Message(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(msgspec.Struct, kw_only=True):
    # Known fields of Anthropic's body that pagoda does not serve -> the values that change nothing (None/false too).
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "thinking": ({"type": "disabled"},), "container": (), "mcp_servers": ([],),
        "service_tier": ("auto", "standard_only"), "inference_geo": (), "speed": (),
    }

    model: str
    messages: list[Message]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
    # Extensions:
    seed: int | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    ignore_eos: bool = False
    cache_salt: CacheSalt | None = None  # the prefix cache's key (EngineRequest.cache_salt)
    priority: Priority | None = None  # lower runs first (EngineRequest.priority)
    tools: list[at.AnthropicTool] | None = None
    tool_choice: at.AnthropicToolChoice | None = None
    output_config: at.OutputConfig | None = None


def blocks_text(content: str | list[TextBlock] | None, field: str) -> str:
    return join_text_parts(content, field, index=".{}")


def check_content(message: Message, i: int, last: bool) -> None:
    """Refuse what Anthropic refuses, in its words: empty content (only a final assistant message may have none,
    as a prefill of nothing) and an empty text block."""
    if not message.content and not (last and message.role == "assistant"):
        raise RequestError(f"messages.{i}: all messages must have non-empty content except for the optional final"
                           " assistant message", f"messages.{i}.content")
    for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
        if block.type == "text" and not block.text:
            raise RequestError(f"messages.{i}.content.{j}: text content blocks must be non-empty",
                               f"messages.{i}.content.{j}.text")


def conversation(body: MessagesRequest) -> list[dict[str, Any]]:
    system = blocks_text(body.system, "system")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    if not body.messages:
        raise RequestError("messages: at least one message is required", "messages")
    history = CallHistory()
    for i, m in enumerate(body.messages):
        check_content(m, i, last=i == len(body.messages) - 1)
        if not isinstance(m.content, str) and any(b.type in ("tool_use", "tool_result") for b in m.content):
            messages += at.message_entries(m.role, m.content, i, history)
        else:
            messages.append({"role": m.role, "content": blocks_text(m.content, f"messages.{i}.content")})
    return messages


def messages_turn(body: MessagesRequest) -> Turn:
    """The body as a turn: system and messages, tools, choice, output format and sampling fields."""
    tools = at.tools_of(body.tools)
    choice, choice_field = at.choice_of(body.tool_choice, tools)
    constraint = at.output_format(body.output_config)
    return Turn(
        messages=conversation(body),
        tools=tools,
        tool_choice=choice,
        constraint=constraint,
        max_tokens=body.max_tokens,
        sampling=dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                      repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos, seed=body.seed,
                      stop=body.stop_sequences),
        stream=body.stream,
        cache_salt=body.cache_salt,
        priority=body.priority,
        choice_field=choice_field,
        format_field="output_config.format",
        renames={"stop": "stop_sequences"},
    )


def stop_reason(completion_reason: FinishReason, matched: str | int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished request."""
    if completion_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the cache (their sum is the prompt)."""
    return {"input_tokens": num_prompt_tokens - num_cached_tokens, "output_tokens": num_output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": num_cached_tokens}


class AnthropicErrors(ErrorShape):
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}, also the stream's `error` event."""

    # Any other 4xx is an invalid request, any other 5xx an api_error.
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
             429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}

    def render_error(self, error: ApiError) -> dict[str, Any]:
        kind = self.TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}

    def read_error(self, status: int, body: Any) -> ApiError:
        return ApiError(status, body["error"]["message"])


ANTHROPIC_ERRORS = AnthropicErrors()


class Messages(Endpoint):
    name = "anthropic-messages"
    protocol = "messages"
    path = "/v1/messages"
    body_type = MessagesRequest
    id_prefix = "msg_"
    errors = ANTHROPIC_ERRORS

    def prepare(self, body: MessagesRequest, ctx: ServeContext) -> EngineRequest:
        return engine_request(messages_turn(body), ctx)

    def _message(self, exchange: Exchange, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "id": exchange.id,
            "type": "message",
            "role": "assistant",
            "model": exchange.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(exchange.num_prompt_tokens, output_tokens, cached_tokens),
        }

    def render(self, exchange: Exchange, answer: Answer) -> dict[str, Any]:
        reason, sequence = stop_reason(answer.finish_reason, answer.stop_reason)
        content = [{"type": "text", "text": answer.text}]
        if exchange.request.tool_parser is not None:  # the blocks the stream builds, from the whole text at once
            blocks = at.Blocks(exchange)
            blocks.whole(answer.text)
            blocks.close()
            content = blocks.blocks
            reason = "tool_use" if blocks.num_calls and reason == "end_turn" else reason
        return self._message(exchange, content, reason, sequence, answer.num_output_tokens,
                             answer.num_cached_tokens)

    async def _tool_stream(self, exchange: Exchange, deltas: AsyncIterator[AnswerDelta]) -> AsyncIterator[Event]:
        """The stream of an answer read for tool calls: a block opens when its text or exchange begins."""
        blocks = at.Blocks(exchange)
        last = None
        async for out in deltas:
            if last is None:
                start = self._message(exchange, [], None, None, 0, out.num_cached_tokens)
                yield Event({"type": "message_start", "message": start}, "message_start")
                yield Event({"type": "ping"}, "ping")
            last = out
            for event in blocks.delta(out):
                yield event
        if last is None:
            return
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(last.finish_reason, last.stop_reason)
        reason = "tool_use" if blocks.num_calls and reason == "end_turn" else reason
        yield Event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": usage(exchange.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)},
                    "message_delta")
        yield Event({"type": "message_stop"}, "message_stop")

    async def render_stream(self, exchange: Exchange, deltas: AsyncIterator[AnswerDelta]) -> AsyncIterator[Event]:
        if exchange.request.tool_parser is not None:
            async for event in self._tool_stream(exchange, deltas):
                yield event
            return
        # message_start waits for the first output: only then is the prefix-cache hit (its usage) known. The
        # server has already sent a keep-alive comment at admission, so the stream is not silent meanwhile.
        last = None
        async for out in deltas:
            if last is None:
                start = self._message(exchange, [], None, None, 0, out.num_cached_tokens)
                yield Event({"type": "message_start", "message": start}, "message_start")
                yield Event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                            "content_block_start")
                yield Event({"type": "ping"}, "ping")
            last = out
            if out.new_text:
                delta = {"type": "text_delta", "text": out.new_text}
                yield Event({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
        if last is None:
            return
        yield Event({"type": "content_block_stop", "index": 0}, "content_block_stop")
        reason, sequence = stop_reason(last.finish_reason, last.stop_reason)
        # cumulative usage: newer SDKs take the input counts from here too, older ones only output_tokens
        yield Event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": usage(exchange.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)},
                    "message_delta")
        yield Event({"type": "message_stop"}, "message_stop")

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        body = {**ask.sampling_fields(), "messages": ask.messages(with_system=False), "max_tokens": ask.max_tokens}
        if ask.system:
            body["system"] = ask.system
        if ask.json_schema is not None:
            body["output_config"] = {"format": {"type": "json_schema", "schema": ask.json_schema}}
        return body

    def client_answer(self) -> MessageAnswer:
        return MessageAnswer()


class MessageAnswer(ClientAnswer):
    """A client's view of a message: its text blocks, stop_reason (max_tokens = length) and usage."""

    def unary(self, body: dict[str, Any]) -> None:
        self.parts.append("".join(block.get("text", "") for block in body["content"]))
        self._stopped(body["stop_reason"], body["usage"]["output_tokens"])
        self._input(body["usage"])

    def event(self, data: Any) -> None:
        kind = data["type"]
        if kind == "error":
            raise ClientError(data["error"]["message"])
        if kind == "message_start":
            self._input(data["message"]["usage"])
        elif kind == "content_block_delta":
            self.parts.append(data["delta"].get("text", ""))
        elif kind == "message_delta":
            self._stopped(data["delta"]["stop_reason"], data["usage"]["output_tokens"])  # cumulative

    def _input(self, usage: dict[str, Any]) -> None:
        # Anthropic's input_tokens leaves out the cached ones: the prompt is the sum of the three
        self.cached_tokens = usage.get("cache_read_input_tokens") or 0
        self.prompt_tokens = usage["input_tokens"] + self.cached_tokens + (usage.get("cache_creation_input_tokens") or 0)

    def _stopped(self, stop_reason: str, output_tokens: int) -> None:
        self.finish_reason = "length" if stop_reason == "max_tokens" else "stop"
        self.output_tokens = output_tokens


def make_count_tokens(ctx: RouteContext) -> Callable[..., Any]:
    """The handler of POST /v1/messages/count_tokens."""
    if ctx.serving is None:
        raise RuntimeError("count_tokens needs a served model's tokenizer")
    serving, endpoint = ctx.serving, Messages()

    async def count_tokens(data: JSONBody[dict[str, Any]], request: Request) -> dict[str, int]:
        """Anthropic's token count of a messages request: {"input_tokens": N}."""
        try:  # the messages body, less max_tokens (and stream), which a count does not need
            body = msgspec.convert({**data, "max_tokens": 1, "stream": False}, MessagesRequest)
        except msgspec.ValidationError as exc:
            where = str(exc).rpartition(" - at `$.")[2].rstrip("`") if " - at `$." in str(exc) else None
            raise RequestError(f"{where + ': ' if where else ''}{str(exc).partition(' - at ')[0]}", where) from None
        ctx.resolve_model(request, body.model)  # 404 for a model not served; an adapter counts as its base does
        return {"input_tokens": len(endpoint.prepare(body, serving).prompt_token_ids)}

    return count_tokens


@hookimpl
def pagoda_register_protocols(register):
    register(Messages())


@hookimpl
def pagoda_register_routes(register):
    register(Route("POST", "/v1/messages/count_tokens", make_count_tokens, errors=ANTHROPIC_ERRORS))


@hookimpl
def pagoda_model_card(model: ServedModel) -> dict[str, Any]:
    """Anthropic's fields of the model card (client.models.list and retrieve read them)."""
    created_at = datetime.fromtimestamp(model.created, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"id": model.name, "type": "model", "display_name": model.name, "created_at": created_at}
