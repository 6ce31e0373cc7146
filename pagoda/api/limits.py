"""Size limits on what a client sends: 431 for headers over `max_header_bytes`, 413 for a body over `max_body_bytes`.

A Litestar middleware, so it runs once the route is known and answers in that
route's own error shape (an unknown path is a 404 before any limit applies).
Headers are counted as the sum of their names and values; the body by its
Content-Length, refused before a byte of it is read. A chunked body carries no
length: Litestar's `request_max_body_size` (set to the same limit in the app)
stops it while it streams in, with the same 413 through the app's exception
handler. uvicorn's own h11 buffer is set above `max_header_bytes`
(pagoda.api.server.h11_buffer_for), so that headers between the two limits get our 431 rather
than its bare 400; beyond it the connection is refused by uvicorn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from litestar.types import ASGIApp, Receive, Scope, Send

from pagoda.api.http_errors import DEFAULT_ERRORS, ERRORS_OPT
from pagoda.api.metrics import Metrics
from pagoda.plugins.protocol import ApiError


@dataclass(frozen=True)
class Limits:
    """The limits of one server (ServeSettings' fields)."""

    max_body_bytes: int
    max_header_bytes: int


def limits_middleware(limits: Limits, metrics: Metrics):  # -> a Litestar middleware factory
    """Refuse requests whose headers or declared body are over the limits, in the route's error shape."""

    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            refusal = _refusal(scope, limits)
            if refusal is None:
                await app(scope, receive, send)
                return
            reason, error = refusal
            metrics.rejected.labels(reason=reason).inc()
            await _send_error(scope, send, error)

        return middleware

    return factory


def _refusal(scope: Scope, limits: Limits) -> tuple[str, ApiError] | None:
    """(metric reason, error) when the request is over a limit, else None."""
    headers = scope["headers"]
    size = sum(len(name) + len(value) for name, value in headers)
    if size > limits.max_header_bytes:
        return "headers_too_large", ApiError(
            431, f"request headers are {size} bytes; this server accepts at most {limits.max_header_bytes}")
    length = next((value for name, value in headers if name == b"content-length"), None)
    if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
        return "body_too_large", ApiError(
            413, f"request body is {int(length)} bytes; this server accepts at most {limits.max_body_bytes}")
    return None


async def _send_error(scope: Scope, send: Send, error: ApiError) -> None:
    handler = scope.get("route_handler")
    shape = (handler.opt.get(ERRORS_OPT) if handler is not None else None) or DEFAULT_ERRORS
    body = json.dumps(shape.render_error(error)).encode()
    # The body (if any) is left unread, so the connection cannot carry another request.
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
