"""The client half of a protocol: how a client asks an endpoint for a generation and reads the answer.

An Endpoint serves its route (pagoda/plugins/protocol.py) and also knows how
a client talks to it, so that the live crowd client, the disconnect benchmark
and the test matrix iterate the registered endpoints instead of naming
protocols:

    endpoint.client_request(ask)        -> dict          the JSON body of a generic request
    endpoint.client_answer()            -> ClientAnswer  reads a unary body, or the stream's events one by one
    endpoint.stream_format                               how its stream is framed: "sse" or "ndjson"
    endpoint.errors.read_error(status, body) -> ApiError   an error body read back

An answer is normalised across protocols: its text, a finish reason that is
"stop" or "length", and the prompt, cached-prompt and output token counts the
server reported (`prompt_tokens` counts every prompt token, cached or not).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pluggy

from pagoda.plugins.manager import collect_endpoints

if TYPE_CHECKING:
    from pagoda.plugins.protocol import Endpoint


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

    @property
    def flat_prompt(self) -> str:
        """The conversation as one text: each earlier turn's user text and answer, then `prompt`."""
        return "".join(user + answer for user, answer in self.history) + self.prompt

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages: each earlier turn, then `prompt` as the last user message."""
        turns = [m for user, answer in self.history
                 for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
        return turns + [{"role": "user", "content": self.prompt}]

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


def endpoints_by_protocol(endpoints: Iterable[Endpoint]) -> dict[str, Endpoint]:
    """The endpoints by the protocol name crowds use ("chat", "ollama-chat"); two with one name is an error."""
    found: dict[str, Endpoint] = {}
    for endpoint in endpoints:
        if endpoint.protocol in found:
            raise ValueError(f"two endpoints share the protocol name {endpoint.protocol!r}:"
                             f" {found[endpoint.protocol].name} and {endpoint.name}")
        found[endpoint.protocol] = endpoint
    return found


def registered_endpoints(pm: pluggy.PluginManager) -> dict[str, Endpoint]:
    """The endpoints a plugin manager's plugins register, by protocol name."""
    return endpoints_by_protocol(collect_endpoints(pm))
