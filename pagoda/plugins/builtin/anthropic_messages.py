"""Anthropic messages: POST /v1/messages (system + messages, named SSE events)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec

from pagoda.core.outputs import RequestOutput
from pagoda.core.request import FinishReason
from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.protocol import (
    ApiError,
    Call,
    Completion,
    Endpoint,
    Event,
    Generation,
    RequestError,
    ServeContext,
    join_text_parts,
    make_sampling_params,
)


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


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class Messages(Endpoint):
    name = "anthropic-messages"
    path = "/v1/messages"
    body_type = MessagesRequest
    id_prefix = "msg_"

    def prepare(self, body: MessagesRequest, ctx: ServeContext) -> Generation:
        ids = ctx.encode_chat(conversation(body))
        stops = body.stop_sequences or []
        if not all(stops):
            raise RequestError("stop_sequences: each sequence must be a non-empty string", "stop_sequences")
        params = make_sampling_params(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            stop=tuple(stops),
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

    def render_stream_error(self, call: Call, error: ApiError) -> list[Event]:
        return [Event(self.render_error(error), "error")]

    def render_error(self, error: ApiError) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}


@hookimpl
def pagoda_register_protocols(register):
    register(Messages())
