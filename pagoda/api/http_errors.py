"""Errors as HTTP answers: a body in the route's own shape with the right status, and the HTTP layer's own refusals.

The shape is the route's owner's: a route carries its `ErrorShape` in its handler's opt (`ERRORS_OPT`; a
protocol endpoint's is its family's). A route without one (an unknown path, a route that names no shape)
answers in DEFAULT_ERRORS, OpenAI's shape, as vLLM does. No request header picks the shape: the route decides.

`http_error` converts what the HTTP layer refuses before any engine is involved (a bad body, a missing key, an
unknown route). This module imports no engine, so the router answers its own refusals with it exactly as a
server does; a server's failures that come from its engine (a full queue, a dead engine) are added by
pagoda.api.errors.api_error.
"""

from __future__ import annotations

import re
from typing import Any, overload

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.protocol import ApiError, ErrorShape
from pagoda.plugins.request_fields import RequestError

ERRORS_OPT = "pagoda_errors"  # route handler opt key holding the route's ErrorShape
DEFAULT_ERRORS: ErrorShape = OPENAI_ERRORS  # the shape of routes that name none
RETRY_AFTER = {429: "1", 503: "5"}  # seconds, by status: a full queue drains fast, a restart takes longer
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


@overload
def http_error(exc: RequestError | HTTPException) -> ApiError: ...


@overload
def http_error(exc: BaseException) -> ApiError | None: ...


def http_error(exc: BaseException) -> ApiError | None:
    """The error a refusal of the HTTP layer is answered with (a bad body, the API key, an unknown route); None
    for any other exception."""
    if isinstance(exc, RequestError):
        return ApiError(exc.status, exc.message, exc.param, exc.code)
    if isinstance(exc, ValidationException):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        return ApiError(exc.status_code, str(exc.detail))
    if isinstance(exc, RecursionError):  # a body nested past the decoder's depth: bad input, not a server fault
        return ApiError(400, "invalid request body: the JSON is nested too deeply")
    return None


def _validation_error(exc: ValidationException) -> ApiError:
    """Name the field: Litestar reports [{'message', 'key', 'source'}] from msgspec."""
    problems = exc.extra if isinstance(exc.extra, list) else []
    if not problems:
        return ApiError(400, str(exc.detail))
    first = problems[0]
    message, key = str(first.get("message", exc.detail)), first.get("key")
    missing = _MISSING_FIELD.search(message)
    if missing:
        key = missing.group(1)
    elif key == "data":  # the body as a whole
        key = None
    text = f"{key}: {message}" if key else f"invalid request body: {message}"
    return ApiError(400, text, key)


def error_response(shape: ErrorShape | None, error: ApiError) -> Response[Any]:
    """An error Response in `shape` (DEFAULT_ERRORS when None), with the error's status."""
    body = (shape or DEFAULT_ERRORS).render_error(error)
    headers = {"x-should-retry": "false"} if error.status >= 500 else None  # SDKs would otherwise retry twice
    if error.status in RETRY_AFTER:  # a full queue or a draining server: the client may come back
        headers = {**(headers or {}), "retry-after": RETRY_AFTER[error.status]}
    return Response(body, status_code=error.status, headers=headers)


def errors_of(request: Request) -> ErrorShape | None:
    """The error shape of the route a request was routed to, if it names one."""
    handler = request.scope.get("route_handler")
    return handler.opt.get(ERRORS_OPT) if handler is not None else None
