"""Anthropic messages: POST /v1/messages (system + messages, named SSE events)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

import msgspec

from pagoda.core.outputs import RequestOutput
from pagoda.core.request import FinishReason
from pagoda.plugins.client import ClientAnswer, ClientError, ClientRequest
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import ApiError, Call, Completion, Endpoint, ErrorShape
from pagoda.plugins.protocol import Event, Generation, RequestError, ServeContext, join_text_parts, make_sampling_params
from pagoda.plugins.route import ServedModel


class TextBlock(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(msgspec.Struct, kw_only=True):
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


def blocks_text(content: str | list[TextBlock] | None, field: str) -> str:
    return join_text_parts(content, field, index=".{}")


def conversation(body: MessagesRequest) -> list[dict[str, str]]:
    system = blocks_text(body.system, "system")
    messages = [{"role": "system", "content": system}] if system else []
    if not body.messages:
        raise RequestError("messages: at least one message is required", "messages")
    for i, m in enumerate(body.messages):
        messages.append({"role": m.role, "content": blocks_text(m.content, f"messages.{i}.content")})
    return messages


def stop_reason(completion_reason: FinishReason, matched: str | int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished request."""
    if completion_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


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

    def prepare(self, body: MessagesRequest, ctx: ServeContext) -> Generation:
        ids = ctx.encode_chat(conversation(body))
        params = make_sampling_params(
            {"stop": "stop_sequences"},
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            ignore_eos=body.ignore_eos,
            seed=body.seed,
            stop=body.stop_sequences,
        )
        return Generation(ids, params, stream=body.stream)

    def _message(self, call: Call, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 output_tokens: int) -> dict[str, Any]:
        return {
            "id": call.id,
            "type": "message",
            "role": "assistant",
            "model": call.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": call.num_prompt_tokens, "output_tokens": output_tokens},
        }

    def render(self, call: Call, completion: Completion) -> dict[str, Any]:
        reason, sequence = stop_reason(completion.finish_reason, completion.stop_reason)
        content = [{"type": "text", "text": completion.text}]
        return self._message(call, content, reason, sequence, completion.num_output_tokens)

    async def render_stream(self, call: Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[Event]:
        yield Event({"type": "message_start", "message": self._message(call, [], None, None, 0)}, "message_start")
        yield Event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                    "content_block_start")
        yield Event({"type": "ping"}, "ping")
        last = None
        async for out in outputs:
            last = out
            if out.new_text:
                delta = {"type": "text_delta", "text": out.new_text}
                yield Event({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
        if last is None:
            return
        yield Event({"type": "content_block_stop", "index": 0}, "content_block_stop")
        reason, sequence = stop_reason(last.finish_reason, last.stop_reason)
        yield Event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": {"output_tokens": last.num_output_tokens}}, "message_delta")
        yield Event({"type": "message_stop"}, "message_stop")

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        return {**ask.sampling_fields(), "messages": [{"role": "user", "content": ask.prompt}],
                "max_tokens": ask.max_tokens}

    def client_answer(self) -> MessageAnswer:
        return MessageAnswer()


class MessageAnswer(ClientAnswer):
    """A client's view of a message: its text blocks, stop_reason (max_tokens = length) and usage."""

    def unary(self, body: dict[str, Any]) -> None:
        self.parts.append("".join(block.get("text", "") for block in body["content"]))
        self._stopped(body["stop_reason"], body["usage"]["output_tokens"])
        self.prompt_tokens = body["usage"]["input_tokens"]

    def event(self, data: Any) -> None:
        kind = data["type"]
        if kind == "error":
            raise ClientError(data["error"]["message"])
        if kind == "message_start":
            self.prompt_tokens = data["message"]["usage"]["input_tokens"]
        elif kind == "content_block_delta":
            self.parts.append(data["delta"].get("text", ""))
        elif kind == "message_delta":
            self._stopped(data["delta"]["stop_reason"], data["usage"]["output_tokens"])  # cumulative

    def _stopped(self, stop_reason: str, output_tokens: int) -> None:
        self.finish_reason = "length" if stop_reason == "max_tokens" else "stop"
        self.output_tokens = output_tokens


@hookimpl
def pagoda_register_protocols(register):
    register(Messages())


@hookimpl
def pagoda_model_card(model: ServedModel) -> dict[str, Any]:
    """Anthropic's fields of the model card (client.models.list and retrieve read them)."""
    created_at = datetime.fromtimestamp(model.created, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"id": model.name, "type": "model", "display_name": model.name, "created_at": created_at}
