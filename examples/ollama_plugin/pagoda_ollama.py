"""Ollama's generation API for pagoda: POST /api/generate and POST /api/chat, NDJSON streams.

A protocol plugin is a set of Endpoint subclasses registered through the
`pagoda_register_protocols` hook; the server does the rest (body validation,
API key, engine calls, disconnects, metrics, error statuses).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

import msgspec

from pagoda.core.request import FinishReason
from pagoda.plugins import hookimpl
from pagoda.plugins.protocol import (
    ApiError,
    Call,
    Completion,
    Endpoint,
    Event,
    Generation,
    RequestError,
    ServeContext,
    make_sampling_params,
)


class Options(msgspec.Struct):
    """Ollama's sampling options (the ones pagoda has a meaning for)."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.8
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 40
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.1
    seed: int | None = None
    num_predict: int | None = None  # -1 or absent = as much as fits
    stop: list[str] | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: str
    prompt: str
    system: str | None = None
    raw: bool = False  # True = the prompt as is, without the chat template
    stream: bool = True
    options: Options = msgspec.field(default_factory=Options)


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[ChatMessage]
    stream: bool = True
    options: Options = msgspec.field(default_factory=Options)


def _params(options: Options, num_prompt_tokens: int, ctx: ServeContext):
    limit = options.num_predict
    max_tokens = ctx.default_max_tokens(num_prompt_tokens) if limit is None or limit < 0 else limit
    if max_tokens == 0:
        raise RequestError("options.num_predict must not be 0", "options.num_predict")
    return make_sampling_params(
        {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty"},
        max_tokens=max_tokens, temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
        min_p=options.min_p, repetition_penalty=options.repeat_penalty, seed=options.seed,
        stop=tuple(options.stop or ()),
    )


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class _OllamaEndpoint(Endpoint):
    stream_format = "ndjson"

    def _piece(self, call: Call, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _done(self, call: Call, reason: FinishReason, num_prompt: int, num_output: int,
              text: str = "") -> dict[str, Any]:
        body = self._piece(call, text)
        body.update(done=True, done_reason="length" if reason is FinishReason.LENGTH else "stop",
                    prompt_eval_count=num_prompt, eval_count=num_output)
        return body

    def render(self, call: Call, completion: Completion) -> dict[str, Any]:
        return self._done(call, completion.finish_reason, completion.num_prompt_tokens, completion.num_output_tokens,
                          completion.text)

    async def render_stream(self, call: Call, outputs: AsyncIterator) -> AsyncIterator[Event]:
        async for out in outputs:
            if out.new_text:
                yield Event(self._piece(call, out.new_text))
            if out.finished:
                yield Event(self._done(call, out.finish_reason, out.num_prompt_tokens, out.num_output_tokens))

    def render_error(self, error: ApiError) -> dict[str, Any]:
        return {"error": error.message}


class Generate(_OllamaEndpoint):
    name = "ollama-generate"
    path = "/api/generate"
    body_type = GenerateRequest

    def prepare(self, body: GenerateRequest, ctx: ServeContext) -> Generation:
        if body.raw:
            ids = ctx.encode(body.prompt)
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            ids = ctx.encode_chat(system + [{"role": "user", "content": body.prompt}])
        return Generation(ids, _params(body.options, len(ids), ctx), stream=body.stream)

    def _piece(self, call: Call, text: str) -> dict[str, Any]:
        return {"model": call.model, "created_at": _now(), "response": text, "done": False}


class Chat(_OllamaEndpoint):
    name = "ollama-chat"
    path = "/api/chat"
    body_type = ChatRequest

    def prepare(self, body: ChatRequest, ctx: ServeContext) -> Generation:
        if not body.messages:
            raise RequestError("messages must hold at least one message", "messages")
        ids = ctx.encode_chat([{"role": m.role, "content": m.content} for m in body.messages])
        return Generation(ids, _params(body.options, len(ids), ctx), stream=body.stream)

    def _piece(self, call: Call, text: str) -> dict[str, Any]:
        return {"model": call.model, "created_at": _now(), "message": {"role": "assistant", "content": text},
                "done": False}


@hookimpl
def pagoda_register_protocols(register):
    register(Generate())
    register(Chat())
