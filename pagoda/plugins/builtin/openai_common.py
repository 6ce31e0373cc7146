"""What the three OpenAI endpoints share: sampling fields, roles, usage, logprobs, finish reasons, model card fields,
and the client half's common parts (the request fields, reading `choices`). A library of theirs, not a plugin: each
endpoint module registers itself (and the card fields), so any one of them can be left out alone. Their error
shape is the interface's (pagoda.plugins.error_shapes)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Annotated, Any

import msgspec

from pagoda.core.outputs import AnswerDelta, SampledToken
from pagoda.core.request import FinishReason
from pagoda.plugins.choices import choice_exchange, merge
from pagoda.plugins.client import ClientAnswer, ClientError, ClientRequest
from pagoda.plugins.protocol import Answer, CacheSalt, Event, Exchange, Priority
from pagoda.plugins.request_fields import RequestError
from pagoda.plugins.route import ServedModel

# Value ranges are declared on the fields, so a bad value is refused while decoding, naming the field.
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0)]
Stop = str | list[str]  # non-empty strings: SamplingParams checks them; how many and how long: RequestLimits


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Sampling(msgspec.Struct, kw_only=True):
    """The sampling fields of all three OpenAI bodies, with the extensions OpenAI's schema lacks."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    stop: Stop | None = None  # an extension on /v1/responses
    seed: int | None = None  # likewise; a 64-bit integer, signed or not (SamplingParams checks the range)
    # Extensions (as vLLM accepts them):
    top_k: TopK = 0  # 0 or -1 = off
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    cache_salt: CacheSalt | None = None  # not sampling: the prefix cache's key (EngineRequest.cache_salt)
    priority: Priority | None = None  # not sampling: lower runs first (EngineRequest.priority)

    def sampling_fields(self) -> dict[str, Any]:
        """These fields as SamplingParams keywords (a None takes SamplingParams' default)."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
                    seed=self.seed, stop=self.stop, repetition_penalty=self.repetition_penalty,
                    ignore_eos=self.ignore_eos)


class SamplingFields(Sampling, kw_only=True):
    """What completions and chat add: n, usage in the stream, OpenAI's penalties and logit bias."""

    n: PositiveInt = 1
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    user: str | None = None

    def __post_init__(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")

    def sampling_fields(self) -> dict[str, Any]:
        return dict(super().sampling_fields(), presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, logit_bias=logit_bias(self.logit_bias))

    @property
    def include_usage(self) -> bool:
        """The stream ends with a chunk holding only the usage (stream_options.include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage


def logit_bias(raw: Mapping[str, float] | None) -> dict[int, float]:
    """Token id -> bias; JSON object keys are strings, so each must read as an id."""
    if not raw:
        return {}
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except ValueError:
        raise RequestError("logit_bias keys must be token ids", "logit_bias") from None


def template_message(role: str, text: str) -> dict[str, str]:
    """One message as the chat template reads it: OpenAI's `developer` role is the template's `system`."""
    return {"role": "system" if role == "developer" else role, "content": text}


def finish_reason(reason: FinishReason) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """Completions and chat usage; `prompt_tokens` counts cached tokens too, as OpenAI's does."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def summed_usage(usages: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """The usage of several choices (index order, n per prompt): each prompt counted once, every output."""
    prompts = [u for k, u in enumerate(usages) if k % n == 0]
    return usage(sum(u["prompt_tokens"] for u in prompts), sum(u["completion_tokens"] for u in usages),
                 sum(u["prompt_tokens_details"]["cached_tokens"] for u in prompts))


class Choices:
    """Completions' and chat's several choices: each rendered as alone (with its `index`), then merged."""

    def render_choices(self, exchange: Exchange, answers: list[Answer]) -> dict[str, Any]:
        bodies = [self.render(choice_exchange(exchange, k), c) for k, c in enumerate(answers)]
        return {**bodies[0], "choices": [b["choices"][0] for b in bodies],
                "usage": summed_usage([b["usage"] for b in bodies], exchange.body.n)}

    async def render_stream_choices(self, exchange: Exchange,
                                    outputs: list[AsyncIterator[AnswerDelta]]) -> AsyncIterator[Event]:
        if len(outputs) == 1:
            async for event in self.render_stream(exchange, outputs[0]):
                yield event
            return
        lasts: dict[int, AnswerDelta] = {}
        streams = [self.render_stream(choice_exchange(exchange, k), _noting(out, lasts, k)) for k, out in enumerate(outputs)]
        # Each choice's stream ends with its own usage chunk and [DONE]: the request's come once, at the end.
        chunk: dict[str, Any] = {}  # the last choice chunk: the usage chunk shares its id, object, created, model
        async for event in merge(streams):
            if event.data != "[DONE]" and not (isinstance(event.data, dict) and event.data.get("choices") == []):
                chunk = event.data
                yield event
        if exchange.body.include_usage and len(lasts) == len(outputs):
            usages = [usage(o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens)
                      for _, o in sorted(lasts.items())]
            yield Event({**chunk, "choices": [], "usage": summed_usage(usages, exchange.body.n)})
        yield Event("[DONE]")


async def _noting(outputs: AsyncIterator[AnswerDelta], lasts: dict[int, AnswerDelta],
                  k: int) -> AsyncIterator[AnswerDelta]:
    """`outputs` passed through, the last one noted as choice k's (its usage)."""
    async for out in outputs:
        lasts[k] = out
        yield out


def usage_chunk(chunk: dict[str, Any], last: AnswerDelta) -> dict[str, Any]:
    """The stream's last chunk under include_usage: no choices, the request's usage."""
    return {**chunk, "choices": [], "usage": usage(last.num_prompt_tokens, last.num_output_tokens,
                                                    last.num_cached_tokens)}


def token_logprob(exchange: Exchange, token_id: int, logprob: float) -> dict[str, Any]:
    text = exchange.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(exchange: Exchange, tokens: Sequence[SampledToken]) -> list[dict[str, Any]]:
    """Chat/responses shape: one entry per token, each with its top alternatives."""
    entries = []
    for t in tokens:
        entry = token_logprob(exchange, t.token_id, _finite(t.logprob))
        entry["top_logprobs"] = [token_logprob(exchange, i, _finite(lp)) for i, lp in (t.top_logprobs or ())]
        entries.append(entry)
    return entries


def completion_logprobs(exchange: Exchange, tokens: Sequence[SampledToken], text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions shape: parallel lists of tokens, logprobs, top alternatives and offsets (a token with no
    logprob, an echoed prompt's first, has null for both)."""
    texts = [exchange.token_text(t.token_id) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None if t.logprob is None else _finite(t.logprob) for t in tokens],
        "top_logprobs": [None if t.logprob is None else
                         {exchange.token_text(i): _finite(lp) for i, lp in (t.top_logprobs or ())} for t in tokens],
        "text_offset": offsets,
    }


def joined_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several legacy logprobs objects as one (an echoed prompt's, then the answer's): their lists end to end."""
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                     "text_offset")}


def prompt_logprobs(exchange: Exchange, entries: Sequence[SampledToken]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else its own and its position's top k, by
    token id: `{"logprob", "rank", "decoded_token"}` (rank 1 = the most likely)."""
    out: list[dict[str, Any] | None] = []
    for t in entries:
        if t.logprob is None:
            out.append(None)
            continue
        entry = {str(t.token_id): _ranked(exchange, t.token_id, t.logprob, t.rank)}
        for rank, (i, lp) in enumerate(t.top_logprobs or (), start=1):
            entry.setdefault(str(i), _ranked(exchange, i, lp, rank))
        out.append(entry)
    return out


def _ranked(exchange: Exchange, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": exchange.token_text(token_id)}


# -- the client half ---------------------------------------------------------------------------
def client_fields(ask: ClientRequest) -> dict[str, Any]:
    """The body fields of a generic request that completions and chat share; a stream asks for its usage."""
    body = {**ask.sampling_fields(), "max_tokens": ask.max_tokens}
    if ask.stream:
        body["stream_options"] = {"include_usage": True}
    return body


class ChoicesAnswer(ClientAnswer):
    """Completions and chat answers: `choices[0]` and `usage`, in one body or over chunks ending with [DONE]."""

    def choice_text(self, choice: dict[str, Any], unary: bool) -> str:
        """The text a choice carries (a unary body's whole text, or a chunk's delta)."""
        raise NotImplementedError

    def unary(self, body: dict[str, Any]) -> None:
        choice = body["choices"][0]
        self.parts.append(self.choice_text(choice, unary=True))
        self.finish_reason = choice["finish_reason"]
        self._usage(body["usage"])

    def event(self, data: Any) -> None:
        if data == "[DONE]":
            return
        if "error" in data:
            raise ClientError(data["error"]["message"])
        for choice in data["choices"]:
            self.parts.append(self.choice_text(choice, unary=False))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if data.get("usage"):
            self._usage(data["usage"])

    def _usage(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens, self.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _finite(value: float | None) -> float:
    # JSON has no -inf; a token the filters made impossible still needs a number.
    if value is None or value != value:
        return -9999.0
    return max(value, -9999.0)


def model_card(model: ServedModel) -> dict[str, Any]:
    """OpenAI's fields of the model card (client.models.list and retrieve read them); each OpenAI endpoint adds them."""
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "pagoda"}
