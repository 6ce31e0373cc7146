"""What the protocol unit tests share: a fake tokenizer and ServeContext, bodies decoded as the server decodes
them, engine outputs made by hand, and the server's own SSE/NDJSON encoders to hand a stream to a client half."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from pagoda.api.stream_writer import ENCODERS
from pagoda.core.outputs import RequestOutput, SampledToken
from pagoda.core.request import FinishReason
from pagoda.plugins.client import ClientAnswer, line_data
from pagoda.plugins.protocol import Call, Completion, Endpoint, Event, ServeContext


class FakeTokenizer:
    """One token per character (id = code point); a chat is its messages as `<role>content`, then `<assistant>`."""

    has_chat_template = True

    def __init__(self) -> None:
        self.chats: list[list[dict[str, str]]] = []  # every conversation encode_chat was given

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        self.chats.append([dict(m) for m in messages])
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def context(max_model_len: int = 256, max_kv_tokens: int = 512) -> ServeContext:
    """A ServeContext over a fresh FakeTokenizer."""
    return ServeContext(tokenizer=FakeTokenizer(), model_name="m", max_model_len=max_model_len,
                        max_kv_tokens=max_kv_tokens)


def decode(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    """The JSON body decoded into the endpoint's Struct, as the server's msgspec decoding does (or raises)."""
    return msgspec.json.decode(msgspec.json.encode(body), type=endpoint.body_type)


def prepared(endpoint: Endpoint, body: dict[str, Any], ctx: ServeContext | None = None) -> Call:
    """The Call the renderers see for this body: decoded, prepared, with an id and a model name."""
    ctx = ctx or context()
    struct = decode(endpoint, body)
    generation = endpoint.prepare(struct, ctx)
    return Call(id=endpoint.new_id(), created=1700000000, model=ctx.model_name, body=struct, generation=generation,
                tokenizer=ctx.tokenizer)


def outputs(call: Call, texts: Sequence[str], reason: FinishReason = FinishReason.LENGTH,
            stop_reason: str | int | None = None, logprobs: bool = False) -> list[RequestOutput]:
    """One output per text (one token each, id = its first character), the last one finished with `reason`."""
    outs = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        token = ord(text[0]) if text else 1
        outs.append(RequestOutput(
            request_id=call.id, new_token_ids=[token], new_text=text, finished=last,
            finish_reason=reason if last else None, num_prompt_tokens=call.num_prompt_tokens,
            num_output_tokens=i + 1, stop_reason=stop_reason if last else None,
            logprobs=[SampledToken(token, -0.5, ((token, -0.5), (66, -1.5)))] if logprobs else []))
    return outs


def completion(call: Call, texts: Sequence[str], **kw: Any) -> Completion:
    """The unary renderers' view of the same outputs."""
    return Completion.from_outputs(outputs(call, texts, **kw))


def stream(endpoint: Endpoint, call: Call, outs: Sequence[RequestOutput]) -> list[Event]:
    """Every event render_stream produces from these outputs."""
    async def collect() -> list[Event]:
        async def feed():
            for out in outs:
                yield out

        return [event async for event in endpoint.render_stream(call, feed())]

    return asyncio.run(collect())


def read_stream(endpoint: Endpoint, events: Sequence[Event]) -> ClientAnswer:
    """The endpoint's client half reading these events off the wire: encoded as the server does, split in lines."""
    answer = endpoint.client_answer()
    wire = b"".join(ENCODERS[endpoint.stream_format](event) for event in events).decode()
    for line in wire.splitlines():
        data = line_data(endpoint.stream_format, line)
        if data is not None:
            answer.event(data)
    return answer


def read_unary(endpoint: Endpoint, body: dict[str, Any]) -> ClientAnswer:
    """The endpoint's client half reading a unary body (after a JSON round trip, as a client gets it)."""
    answer = endpoint.client_answer()
    answer.unary(msgspec.json.decode(msgspec.json.encode(body)))
    return answer
