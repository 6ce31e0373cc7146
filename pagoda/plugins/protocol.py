"""What a protocol plugin implements, and what the server hands it.

A protocol endpoint is one HTTP route (say POST /v1/chat/completions). It
declares the msgspec Struct its JSON body decodes into, three steps, and the
error shape of its protocol family:

    prepare(body, ctx)               -> EngineRequest   prompt ids and sampling params; or a list, one per
                                                        prompt, each with `n` choices (pagoda.plugins.choices)
    render(exchange, answer)         -> dict            the unary response body
    render_stream(exchange, deltas)  -> Events          the stream, from the engine's answer deltas
    errors: ErrorShape                                  error bodies and stream-error events, shared by a family

and its client half (pagoda/plugins/client.py): `client_request` and
`client_answer`, how a client asks this route and reads what it answers.
The words: a *request* is what is asked (the body, the `EngineRequest` made
from it, the engine's `Request`, a client's `ClientRequest`); an *answer* is
what comes back (each step's `AnswerDelta`, the whole `Answer`, a client's
`ClientAnswer`); an `Exchange` is one request and its response as the
renderers see them (ids that stay the same across its events).

Everything else is the server's (pagoda.api): decoding and validating the
body, the API key, calling the engine, the disconnect race and the abort,
turning exceptions into `ApiError`s rendered by the route's ErrorShape with
the right status, encoding events as SSE or NDJSON, metrics and the access
log. So a protocol module holds only its wire format. The fields a protocol
reads into a request are checked with pagoda.plugins.request_fields; the built-in
protocols read a body into a pagoda.plugins.turn.Turn, which `engine_request`
checks (tools included) and makes the EngineRequest of, and an answer read for
tool calls is rendered through pagoda.plugins.tool_render.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec

from pagoda.core.outputs import AnswerDelta, SampledToken
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from pagoda.plugins.client import ClientAnswer, ClientRequest
from pagoda.plugins.request_fields import DEFAULT_LIMITS, RequestError, RequestLimits
from pagoda.plugins.tools import Tool, ToolParser, plain_messages, require_parser

if TYPE_CHECKING:
    from pagoda.core.tokenizer import Tokenizer


# A body's `cache_salt` (vLLM's name for it): requests share prefix-cache blocks only under an equal salt.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
# A body's `priority` (vLLM's extension): lower runs first under --scheduling-policy priority; absent = the tenant's.
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]


def new_id(prefix: str) -> str:
    """A fresh random id with a protocol's prefix ("chatcmpl-", "call_", "toolu_", ...): the one place ids are made."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ApiError:
    """An error to send in a protocol's own shape; `status` is the HTTP status (or the event's)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class ServeContext:
    """What `prepare` may use: the tokenizer and the server's limits."""

    tokenizer: Tokenizer
    model_name: str  # the name responses report (--served-model-name)
    max_model_len: int  # prompt + output tokens of one request
    max_kv_tokens: int  # KV slots in the whole pool: a request can never hold more
    limits: RequestLimits = DEFAULT_LIMITS  # what one request may ask for (make_sampling_params checks it)
    tool_parser: ToolParser | None = None  # --tool-parser; None = tools are refused

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (with the tokenizer's own special tokens, e.g. BOS)."""
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool] = ()) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the reply.

        With `tools`, or past calls and results in `messages`: a template that renders tools gets them as they
        are; any other gets the tool parser's default prompt and syntax."""
        if not self.tokenizer.has_chat_template:
            raise RequestError("this model has no chat template; use /v1/completions with a plain prompt", "messages")
        if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        if self.tokenizer.chat_template_takes_tools:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                              tools=[t.as_openai() for t in tools] or None)
        plain = plain_messages(messages, tools, require_parser(self.tool_parser))
        return self.tokenizer.encode_chat(plain, add_generation_prompt=True)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """For a request that names no limit: as many tokens as fit the context and the KV pool."""
        # A request holds prompt + max_tokens - 1 KV slots (its last token is never computed).
        fits = min(self.max_model_len - num_prompt_tokens, self.max_kv_tokens - num_prompt_tokens + 1)
        return max(fits, 1)  # a prompt that fills the context is refused by admission, with the numbers


@dataclass
class EngineRequest:
    """What a protocol asks of the engine for one prompt: made by `prepare` from the body."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    cache_salt: str | None = None  # the body's `cache_salt`: prefix-cache blocks are shared only under an equal one
    tool_parser: ToolParser | None = None  # reads the answer's tool calls; None = plain text
    n: int = 1  # choices sampled from this prompt (pagoda.plugins.choices.fan_out makes one engine request each)
    priority: int | None = None  # the body's `priority`; None = the tenant's (pagoda.api.keys_file.Tenant)


@dataclass
class ExchangeState:
    """A renderer's notes on one exchange, kept from its first event to its last (and into the unary body)."""

    ids: dict[tuple[str, int], str] = field(default_factory=dict)  # (prefix, index) -> the id made for it
    num_events: int = 0  # events numbered so far (the responses stream's sequence_number)

    def id(self, prefix: str, index: int = 0) -> str:
        """The id of item `index` of one kind (its prefix: "call_", "msg_", ...): made on first use, then the same."""
        key = (prefix, index)
        if key not in self.ids:
            self.ids[key] = new_id(prefix)
        return self.ids[key]

    def next_event_number(self) -> int:
        """0, 1, 2, ... across the exchange's events."""
        self.num_events += 1
        return self.num_events - 1


@dataclass
class Exchange:
    """One request and its response as the renderers see them: ids and names that stay the same across its events."""

    id: str  # the protocol-visible id, also the engine request id
    created: int  # unix seconds
    model: str
    body: Any  # the decoded body Struct (the endpoint's body_type)
    request: EngineRequest  # the engine request this renderer renders (its choice's)
    tokenizer: Tokenizer
    state: ExchangeState = field(default_factory=ExchangeState)
    index: int = 0  # the choice this exchange renders (a response's `choices[index]`)
    choices: list[EngineRequest] = field(default_factory=list)  # every choice's engine request, in index order

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs), special tokens included."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class Answer:
    """A finished answer, as unary renderers get it."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stop_reason: str | int | None  # the stop string or token id that matched
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[SampledToken] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (usage's cached tokens)
    prompt_logprobs: list[SampledToken] | None = None  # one per prompt token, when asked (AnswerDelta's)

    @classmethod
    def from_deltas(cls, deltas: Sequence[AnswerDelta]) -> Answer:
        """Join a request's answer deltas (the last one is the finished one)."""
        last = deltas[-1]
        assert last.finished and last.finish_reason is not None, last
        return cls(
            text="".join(d.new_text for d in deltas),
            token_ids=[t for d in deltas for t in d.new_token_ids],
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            num_prompt_tokens=last.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens,
            logprobs=[lp for d in deltas for lp in d.logprobs],
            num_cached_tokens=last.num_cached_tokens,
            prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
        )


@dataclass(frozen=True)
class Event:
    """One stream event: `data` is sent as JSON unless it is a str; `name` is SSE's `event:` line."""

    data: Any
    name: str | None = None


class ErrorShape:
    """How one protocol family writes an error: a body for a status, and the events that end a broken stream.

    A family's endpoints share one instance (OpenAI's three endpoints: OPENAI_ERRORS); a route
    that belongs to no protocol answers in its owner's shape, or in OpenAI's by default.
    """

    def render_error(self, error: ApiError) -> dict[str, Any]:
        """An error body in the family's own shape."""
        raise NotImplementedError

    def render_stream_error(self, error: ApiError) -> list[Event]:
        """Events that report a failure after the stream began (the status line has gone out)."""
        return [Event(self.render_error(error), name="error")]

    def read_error(self, status: int, body: Any) -> ApiError:
        """The client half: an error body of this shape read back (status, message and what else it carries)."""
        raise NotImplementedError


class Endpoint:
    """One protocol route; subclass it, set the class attributes and implement the three steps."""

    name: ClassVar[str]  # unique, e.g. "openai-chat"
    protocol: ClassVar[str]  # unique, the short name crowd plans use, e.g. "chat"
    path: ClassVar[str]  # e.g. "/v1/chat/completions" (always POST)
    body_type: ClassVar[type]  # a msgspec.Struct the JSON body decodes into
    errors: ClassVar[ErrorShape]  # the family's error shape, e.g. OPENAI_ERRORS
    id_prefix: ClassVar[str] = ""  # e.g. "chatcmpl-"
    stream_format: ClassVar[Literal["sse", "ndjson"]] = "sse"

    def new_id(self) -> str:
        """A fresh id for one request, with the protocol's prefix."""
        return new_id(self.id_prefix)

    def prepare(self, body: Any, ctx: ServeContext) -> EngineRequest | list[EngineRequest]:
        """Turn the decoded body into engine requests (one per prompt); raise RequestError naming a bad field."""
        raise NotImplementedError

    def render(self, exchange: Exchange, answer: Answer) -> dict[str, Any]:
        """The unary response body for a finished answer."""
        raise NotImplementedError

    def render_stream(self, exchange: Exchange, deltas: AsyncIterator[AnswerDelta]) -> AsyncIterator[Event]:
        """The stream's events, produced while iterating the engine's answer deltas."""
        raise NotImplementedError

    def render_choices(self, exchange: Exchange, answers: list[Answer]) -> dict[str, Any]:
        """The unary body for several choices (one Answer each, in index order); one choice: `render`."""
        if len(answers) != 1:
            raise NotImplementedError(f"{self.name} renders one choice")
        return self.render(exchange, answers[0])

    def render_stream_choices(self, exchange: Exchange,
                              deltas: list[AsyncIterator[AnswerDelta]]) -> AsyncIterator[Event]:
        """The stream of several choices (one engine stream each, in index order); one choice: `render_stream`."""
        if len(deltas) != 1:
            raise NotImplementedError(f"{self.name} streams one choice")
        return self.render_stream(exchange, deltas[0])

    def render_stream_error(self, exchange: Exchange, error: ApiError) -> list[Event]:
        """Events that report a failure after the stream began: the family's, unless the exchange shapes them."""
        return self.errors.render_stream_error(error)

    # -- the client half ----------------------------------------------------
    def client_request(self, ask: ClientRequest) -> dict[str, Any]:
        """The JSON body a client sends this route for a generic request."""
        raise NotImplementedError

    def client_answer(self) -> ClientAnswer:
        """A fresh accumulator for one answer from this route (a unary body or the stream's events)."""
        raise NotImplementedError
