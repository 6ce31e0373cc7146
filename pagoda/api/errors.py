"""Every failure as an error body in the protocol's own shape, with the right status.

One conversion (`api_error`) from exceptions to `ApiError`, used by the
endpoint handlers and by the app's exception handlers (body validation, the
API key, unknown routes). Routes that belong to no protocol (/v1/models, a
404) answer in OpenAI's shape, or in Anthropic's when the request carries the
`anthropic-version` header its SDK always sends.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from pagoda.core.async_engine import EngineDeadError, GenerationError, RequestAborted
from pagoda.core.scheduler import AdmissionError, ContextLengthExceeded
from pagoda.plugins.protocol import ApiError, Endpoint, RequestError

logger = logging.getLogger("pagoda.api")

ENDPOINT_OPT = "pagoda_endpoint"  # route handler opt key holding the Endpoint
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def api_error(exc: BaseException) -> ApiError:
    """The status and message an exception is answered with."""
    if isinstance(exc, RequestError):
        return ApiError(exc.status, exc.message, exc.param, exc.code)
    if isinstance(exc, ValidationException):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        return ApiError(exc.status_code, str(exc.detail))
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, str(exc), "max_tokens", "context_length_exceeded")
    if isinstance(exc, (AdmissionError, ValueError)):
        return ApiError(400, str(exc))
    if isinstance(exc, (EngineDeadError, RequestAborted)):
        return ApiError(503, f"the engine cannot serve this request: {exc}")
    if isinstance(exc, GenerationError):
        return ApiError(500, f"generation failed: {exc}")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, f"internal server error ({type(exc).__name__})")


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


def error_response(endpoint: Endpoint | None, error: ApiError, request: Request | None = None) -> Response[Any]:
    """An error Response rendered by the endpoint (or the fallback shape for other routes)."""
    body = endpoint.render_error(error) if endpoint is not None else fallback_error_body(error, request)
    headers = {"x-should-retry": "false"} if error.status >= 500 else None  # SDKs would otherwise retry twice
    return Response(body, status_code=error.status, headers=headers)


def fallback_error_body(error: ApiError, request: Request | None) -> dict[str, Any]:
    """The error shape of routes that belong to no protocol: OpenAI's, or Anthropic's for its SDK."""
    if request is not None and "anthropic-version" in request.headers:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(error.status, "invalid_request_error")
        kind = "api_error" if error.status >= 500 else kind
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    kind = "server_error" if error.status >= 500 else "invalid_request_error"
    code = error.code or {401: "invalid_api_key", 404: "not_found"}.get(error.status)
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def endpoint_of(request: Request) -> Endpoint | None:
    """The protocol endpoint a request was routed to, if any."""
    handler = request.scope.get("route_handler")
    return handler.opt.get(ENDPOINT_OPT) if handler is not None else None


def handle_exception(request: Request, exc: Exception) -> Response[Any]:
    """Litestar exception handler: any error outside a handler's own try, in the route's shape."""
    return error_response(endpoint_of(request), api_error(exc), request)
