"""Ollama's generation API for pagoda: POST /api/generate and POST /api/chat, NDJSON streams.

A protocol plugin is a set of Endpoint subclasses registered through the
`pagoda_register_protocols` hook; the server does the rest (body validation,
API key, engine calls, disconnects, metrics, error statuses). Each endpoint
has both halves: the server's (prepare, render, render_stream, its error
shape) and the client's (client_request, client_answer), which is what lets
pagoda's crowd harness and disconnect matrix drive these routes unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

import msgspec

from pagoda.core.request import FinishReason
from pagoda.plugins import hookimpl
from pagoda.plugins.client import ClientAnswer, ClientError, ClientRequest
from pagoda.plugins.protocol import Answer, ApiError, Endpoint, ErrorShape, Exchange
from pagoda.plugins.protocol import EngineRequest, Event, ServeContext
from pagoda.plugins.request_fields import RequestError, make_sampling_params


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
    ignore_eos: bool = False  # a pagoda extension: run to num_predict whatever the model says


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
    return make_sampling_params(
        {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
         "stop": "options.stop"},
        max_tokens=max_tokens, temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
        min_p=options.min_p, repetition_penalty=options.repeat_penalty, seed=options.seed, stop=options.stop,
        ignore_eos=options.ignore_eos,
    )


class OllamaErrors(ErrorShape):
    """Ollama's error shape: {"error": message}, in the body or as the stream's last line."""

    def render_error(self, error: ApiError) -> dict[str, Any]:
        return {"error": error.message}

    def read_error(self, status: int, body: Any) -> ApiError:
        return ApiError(status, body["error"])


OLLAMA_ERRORS = OllamaErrors()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class _OllamaEndpoint(Endpoint):
    stream_format = "ndjson"
    errors = OLLAMA_ERRORS

    def _piece(self, exchange: Exchange, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _done(self, exchange: Exchange, reason: FinishReason, num_prompt: int, num_output: int,
              text: str = "") -> dict[str, Any]:
        body = self._piece(exchange, text)
        body.update(done=True, done_reason="length" if reason is FinishReason.LENGTH else "stop",
                    prompt_eval_count=num_prompt, eval_count=num_output)
        return body

    def render(self, exchange: Exchange, answer: Answer) -> dict[str, Any]:
        return self._done(exchange, answer.finish_reason, answer.num_prompt_tokens, answer.num_output_tokens,
                          answer.text)

    async def render_stream(self, exchange: Exchange, outputs: AsyncIterator) -> AsyncIterator[Event]:
        async for out in outputs:
            if out.new_text:
                yield Event(self._piece(exchange, out.new_text))
            if out.finished:
                yield Event(self._done(exchange, out.finish_reason, out.num_prompt_tokens, out.num_output_tokens))

    # -- the client half ----------------------------------------------------
    def _client_options(self, ask: ClientRequest) -> dict[str, Any]:
        # Every option named, so Ollama's own defaults (top_k 40, repeat_penalty 1.1) do not apply.
        options = {"num_predict": ask.max_tokens, "temperature": ask.temperature, "top_p": ask.top_p,
                   "top_k": ask.top_k, "repeat_penalty": 1.0, "seed": ask.seed, "ignore_eos": ask.ignore_eos}
        return {"model": ask.model, "stream": ask.stream, "options": options}

    def client_answer(self) -> OllamaAnswer:
        return OllamaAnswer(self._text_of)

    def _text_of(self, line: dict[str, Any]) -> str:
        raise NotImplementedError


class OllamaAnswer(ClientAnswer):
    """A client's view of an Ollama answer: the pieces' text, then the `done` line's reason and counts."""

    def __init__(self, text_of) -> None:
        super().__init__()
        self.text_of = text_of  # the endpoint's: a line -> its text

    def unary(self, body: dict[str, Any]) -> None:
        self.event(body)  # a unary body is the stream's last line with the whole text

    def event(self, data: Any) -> None:
        if "error" in data:
            raise ClientError(data["error"])
        self.parts.append(self.text_of(data))
        if data["done"]:
            self.finish_reason = "length" if data["done_reason"] == "length" else "stop"
            self.prompt_tokens, self.output_tokens = data["prompt_eval_count"], data["eval_count"]


class Generate(_OllamaEndpoint):
    name = "ollama-generate"
    protocol = "ollama-generate"
    path = "/api/generate"
    body_type = GenerateRequest

    def prepare(self, body: GenerateRequest, ctx: ServeContext) -> EngineRequest:
        if body.raw:
            ids = ctx.encode(body.prompt)
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            ids = ctx.encode_chat(system + [{"role": "user", "content": body.prompt}])
        return EngineRequest(ids, _params(body.options, len(ids), ctx), stream=body.stream)

    def _piece(self, exchange: Exchange, text: str) -> dict[str, Any]:
        return {"model": exchange.model, "created_at": _now(), "response": text, "done": False}

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        return {**self._client_options(ask), "prompt": ask.flat_prompt}

    def _text_of(self, line: dict[str, Any]) -> str:
        return line["response"]


class Chat(_OllamaEndpoint):
    name = "ollama-chat"
    protocol = "ollama-chat"
    path = "/api/chat"
    body_type = ChatRequest

    def prepare(self, body: ChatRequest, ctx: ServeContext) -> EngineRequest:
        if not body.messages:
            raise RequestError("messages must hold at least one message", "messages")
        ids = ctx.encode_chat([{"role": m.role, "content": m.content} for m in body.messages])
        return EngineRequest(ids, _params(body.options, len(ids), ctx), stream=body.stream)

    def _piece(self, exchange: Exchange, text: str) -> dict[str, Any]:
        return {"model": exchange.model, "created_at": _now(), "message": {"role": "assistant", "content": text},
                "done": False}

    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        return {**self._client_options(ask), "messages": ask.messages()}

    def _text_of(self, line: dict[str, Any]) -> str:
        return line["message"]["content"]


@hookimpl
def pagoda_register_protocols(register):
    register(Generate())
    register(Chat())
