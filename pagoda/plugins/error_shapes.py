"""The error shape that is shared: OpenAI's, which the OpenAI endpoints and every route that names no shape answer in.

A protocol family's errors are its `ErrorShape` (pagoda/plugins/protocol.py). OpenAI's is the interface's own
because more than one plugin answers in it (the three OpenAI endpoints, /v1/models, the token routes) and the
server falls back to it (an unknown path, a route that names no shape), as vLLM does; a family only one plugin
uses keeps its shape in that plugin (Anthropic's in anthropic_messages).
"""

from __future__ import annotations

from typing import Any

from pagoda.plugins.protocol import ApiError, ErrorShape, Event


class OpenAIErrors(ErrorShape):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; a stream error is a data event."""

    # HTTP status -> (type, code); any other 4xx is an invalid request, any other 5xx a server error.
    TYPES = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
             403: ("permission_error", None), 404: ("invalid_request_error", "not_found"),
             413: ("invalid_request_error", "request_too_large"), 415: ("invalid_request_error", None),
             422: ("invalid_request_error", None), 429: ("rate_limit_error", "rate_limit_exceeded"),
             431: ("invalid_request_error", None)}

    def render_error(self, error: ApiError) -> dict[str, Any]:
        default = ("server_error", None) if error.status >= 500 else ("invalid_request_error", None)
        kind, code = self.TYPES.get(error.status, default)
        return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code or code}}

    def render_stream_error(self, error: ApiError) -> list[Event]:
        return [Event(self.render_error(error))]  # a data: object with "error" makes the SDK raise

    def read_error(self, status: int, body: Any) -> ApiError:
        error = body["error"]
        return ApiError(status, error["message"], error.get("param"), error.get("code"))


OPENAI_ERRORS = OpenAIErrors()
