"""What the router knows of each path the replicas serve, read from the same plugins the replicas load.

The router forwards every path; it only needs to know, for the answers it gives itself (401, 413,
429, 502, 503), the error shape the path's owner answers in, and for a stream cut short by a dead
replica, how the stream is framed and what its error event is. A protocol endpoint gives all three;
a plugin route gives its shape and whether it is behind the key. A path no plugin names is answered
in the server's default shape (OpenAI's) and is not checked against the key, as pagoda answers an
unknown path (404 whatever the key): the replica it goes to decides. So the router should load the
plugins its replicas load (it reads them as `pagoda serve` does: PAGODA_PLUGINS, PAGODA_DISABLE_PLUGINS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import pluggy

from pagoda.api.http_errors import DEFAULT_ERRORS
from pagoda.api.stream_writer import ENCODERS
from pagoda.plugins.manager import collect_endpoints, collect_routes
from pagoda.plugins.protocol import ApiError, Endpoint, ErrorShape, Exchange, ExchangeState

# a plugin route's path parameter, e.g. "{model_id:str}": one path segment
_PARAMETER = re.compile(r"\\\{[^/]*?\\\}")


@dataclass(frozen=True)
class PathInfo:
    """One path as the router treats it."""

    errors: ErrorShape = DEFAULT_ERRORS
    guarded: bool = False  # behind --api-key when one is set
    endpoint: Endpoint | None = None  # the generation endpoint serving it, if one does

    @property
    def protocol(self) -> str | None:
        return self.endpoint.protocol if self.endpoint is not None else None

    @property
    def stream_format(self) -> Literal["sse", "ndjson"] | None:
        return self.endpoint.stream_format if self.endpoint is not None else None

    @property
    def event_end(self) -> bytes | None:
        """The bytes that end one event of its stream (None: not a stream the router can frame)."""
        return {"sse": b"\n\n", "ndjson": b"\n"}.get(self.stream_format or "")

    def stream_error(self, error: ApiError, num_events: int = 0) -> bytes:
        """The endpoint's in-stream error event(s) after `num_events` events, encoded as the server encodes them."""
        if self.endpoint is None:
            return b""
        # A stand-in exchange: the router has no engine request. An endpoint's stream error reads only the
        # exchange's state (the responses stream numbers its events on from those already sent).
        exchange = Exchange(id="", created=0, model="", body=None, request=None,  # type: ignore[arg-type]
                            tokenizer=None, state=ExchangeState(num_events=num_events))
        events = self.endpoint.render_stream_error(exchange, error)
        return b"".join(ENCODERS[self.endpoint.stream_format](event) for event in events)


UNKNOWN_PATH = PathInfo()  # the default shape, not behind the key


class RouteTable:
    """Path -> PathInfo, for the endpoints and routes a plugin manager registers."""

    def __init__(self, exact: dict[str, PathInfo], patterns: list[tuple[re.Pattern[str], PathInfo]]) -> None:
        self._exact = exact
        self._patterns = patterns

    @classmethod
    def from_plugins(cls, pm: pluggy.PluginManager) -> RouteTable:
        exact: dict[str, PathInfo] = {}
        patterns: list[tuple[re.Pattern[str], PathInfo]] = []
        for endpoint in collect_endpoints(pm):
            exact[endpoint.path] = PathInfo(endpoint.errors, True, endpoint)
        for route in collect_routes(pm):
            info = PathInfo(route.errors or DEFAULT_ERRORS, route.guarded)
            if "{" in route.path:
                patterns.append((re.compile(_PARAMETER.sub("[^/]+", re.escape(route.path)) + "$"), info))
            else:
                exact.setdefault(route.path, info)
        return cls(exact, patterns)

    def lookup(self, path: str) -> PathInfo:
        """What the router knows of `path` (UNKNOWN_PATH when no plugin serves it)."""
        found = self._exact.get(path)
        if found is not None:
            return found
        return next((info for pattern, info in self._patterns if pattern.match(path)), UNKNOWN_PATH)
