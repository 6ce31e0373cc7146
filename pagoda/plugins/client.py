"""The client half of a protocol: how a client asks an endpoint for a generation and reads the answer.

An Endpoint serves its route (pagoda/plugins/protocol.py) and also knows how
a client talks to it, so that the live crowd client, the disconnect benchmark
and the test matrix iterate the registered endpoints instead of naming
protocols:

    endpoint.client_request(ask)        -> dict          the JSON body of a generic request
    endpoint.client_answer()            -> ClientAnswer  reads a unary body, or the stream's events one by one
    endpoint.stream_format                               how its stream is framed: "sse" or "ndjson"
    endpoint.errors.read_error(status, body) -> ApiError   an error body read back

and `send(http, endpoint, ask)` drives one exchange over HTTP with them: the one client stack the crowd
harness, the benchmarks (against pagoda and against peers, pagoda.bench.serve.client) and the tests share.

(pagoda.plugins.manager.registered_endpoints: the endpoints a plugin manager serves, by protocol name.)

An answer is normalised across protocols: its text, a finish reason that is
"stop" or "length", and the prompt, cached-prompt and output token counts the
server reported (`prompt_tokens` counts every prompt token, cached or not).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx


@dataclass(frozen=True)
class ClientRequest:
    """A generation request as any protocol's client could ask it; each endpoint renames the fields."""

    prompt: str  # the user's text (a chat endpoint sends it as the last user message)
    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    ignore_eos: bool = False
    model: str = "default"
    cache_salt: str | None = None  # sent as the body's `cache_salt` extension (all four protocols)
    # Earlier turns of a conversation, (user text, assistant answer) each: a chat endpoint sends them as messages
    # before `prompt`; the others prepend their text to it (see `flat_prompt`).
    history: tuple[tuple[str, str], ...] = ()
    # The answer must be JSON valid against this schema: each endpoint sends it in its protocol's own
    # structured-output field (response_format, text.format, output_config.format).
    json_schema: Any = None
    system: str | None = None  # a system prompt before the conversation (a chat endpoint's system message)

    @property
    def flat_prompt(self) -> str:
        """The conversation as one text: the system prompt, each earlier turn's user text and answer, then `prompt`."""
        return (self.system or "") + "".join(user + answer for user, answer in self.history) + self.prompt

    def messages(self, with_system: bool = True) -> list[dict[str, str]]:
        """The conversation as chat messages: the system prompt (unless the protocol sends it apart), each
        earlier turn, then `prompt` as the last user message."""
        system = [{"role": "system", "content": self.system}] if self.system and with_system else []
        turns = [m for user, answer in self.history
                 for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
        return system + turns + [{"role": "user", "content": self.prompt}]

    def sampling_fields(self) -> dict[str, Any]:
        """model, stream and the sampling fields under the names OpenAI's and Anthropic's bodies share."""
        fields: dict[str, Any] = {"model": self.model, "stream": self.stream, "temperature": self.temperature,
                                  "top_p": self.top_p}
        if self.top_k:
            fields["top_k"] = self.top_k
        if self.seed is not None:
            fields["seed"] = self.seed
        if self.ignore_eos:
            fields["ignore_eos"] = True
        if self.cache_salt is not None:
            fields["cache_salt"] = self.cache_salt
        return fields


class ClientError(RuntimeError):
    """The server reported an error inside a stream (after its 200 status line)."""


class ClientAnswer:
    """One answer as a client accumulates it; a protocol's subclass reads its bodies and events."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.finish_reason: Literal["stop", "length"] | None = None
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cached_tokens: int | None = None  # of the prompt tokens, those the server found in its prefix cache

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def unary(self, body: dict[str, Any]) -> None:
        """Read a whole unary response body."""
        raise NotImplementedError

    def event(self, data: Any) -> None:
        """Read one stream event's data (decoded JSON; the raw text when it is not JSON); raise ClientError on an error."""
        raise NotImplementedError


class EndpointClient(Protocol):
    """An endpoint's client half, as `send` uses it (any Endpoint; pagoda.bench.serve.client's peer clients)."""

    path: str
    stream_format: Literal["sse", "ndjson"]

    def client_request(self, ask: ClientRequest) -> dict[str, Any]: ...

    def client_answer(self) -> ClientAnswer: ...


async def send(http: httpx.AsyncClient, endpoint: EndpointClient, ask: ClientRequest, *, base_url: str = "",
               headers: dict[str, str] | None = None, answer: ClientAnswer | None = None,
               on_first_byte: Callable[[], None] | None = None,
               on_text: Callable[[], None] | None = None) -> ClientAnswer:
    """Ask `endpoint` over HTTP and read its answer: a unary body, or the stream to its end.

    `on_first_byte` is called when the response's first line (or body) arrives, `on_text` after each event that
    added text (a streamed token event, as a client sees it). A status other than 200 raises ClientError with the
    body's start; a stream that ends before its answer finished (no finish reason) raises too. `answer`: the
    accumulator to fill (default: a fresh one), so a caller that gives up part-way still holds what came."""
    answer = endpoint.client_answer() if answer is None else answer
    body = endpoint.client_request(ask)
    url = base_url + endpoint.path
    if not ask.stream:
        response = await http.post(url, json=body, headers=headers)
        if on_first_byte is not None:
            on_first_byte()
        if response.status_code != 200:
            raise ClientError(f"HTTP {response.status_code}: {response.text[:300]}")
        answer.unary(response.json())
        return answer
    async with http.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise ClientError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():  # until the server ends the stream
            if on_first_byte is not None:
                on_first_byte()
                on_first_byte = None
            data = line_data(endpoint.stream_format, line)
            if data is None:
                continue
            before = len(answer.parts)
            answer.event(data)
            if on_text is not None and any(answer.parts[before:]):
                on_text()
    if answer.finish_reason is None:
        raise ClientError("the stream ended before its answer finished")
    return answer


def line_data(stream_format: Literal["sse", "ndjson"], line: str) -> Any | None:
    """The event data one line of a stream carries (an SSE `data:` line, an NDJSON line); None for other lines."""
    if stream_format == "sse":
        if not line.startswith("data:"):
            return None  # event names, comments (keep-alives) and the blank lines between events
        line = line[5:].strip()
    elif not line.strip():
        return None
    try:
        return json.loads(line)
    except ValueError:
        return line  # e.g. OpenAI's "[DONE]"
