"""Every failure of a request to a server as an error body in the protocol's own shape, with the right status.

One conversion (`api_error`) from exceptions to `ApiError`, used by the endpoint handlers and by the app's
exception handlers. It starts from the HTTP layer's own refusals (a bad body, the API key, an unknown route:
pagoda.api.http_errors, which imports no engine and which the router shares) and adds what a server's engine
raises: a full queue, a prompt past the context, a constraint it cannot compile, a dead engine. The shape is
the route's owner's (http_errors.errors_of).
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response

from pagoda.api.http_errors import error_response, errors_of, http_error
from pagoda.core.adapters import AdapterError, UnknownAdapter
from pagoda.core.async_engine import EngineDeadError, GenerationError, RequestAborted
from pagoda.core.constraint import ConstraintError
from pagoda.core.scheduler import AdmissionError, ContextLengthExceeded, QueueFull
from pagoda.plugins.protocol import ApiError

logger = logging.getLogger("pagoda.api")


def api_error(exc: BaseException) -> ApiError:
    """The status and message an exception is answered with."""
    refused = http_error(exc)
    if refused is not None:
        return refused
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), None, "queue_full")
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, str(exc), exc.field, "context_length_exceeded")
    if isinstance(exc, ConstraintError):  # a schema, regex or grammar the engine cannot compile
        return ApiError(400, str(exc), exc.field)
    if isinstance(exc, UnknownAdapter):  # unloaded between the model's check and admission: as if never served
        named = f" {exc.name!r}" if exc.name is not None else ""  # (its message lists every adapter: not told)
        return ApiError(404, f"the LoRA adapter{named} is not loaded", "model", "model_not_found")
    if isinstance(exc, AdapterError):  # an adapter refused at load: its config field, tensor, lora_name or lora_path
        return ApiError(400, str(exc), exc.field)
    if isinstance(exc, (AdmissionError, ValueError)):
        return ApiError(400, str(exc))
    if isinstance(exc, (EngineDeadError, RequestAborted)):
        return ApiError(503, f"the engine cannot serve this request: {exc}")
    if isinstance(exc, GenerationError):
        if exc.field is not None:  # the request's own field made it fail (a constraint the vocabulary cannot follow)
            return ApiError(400, f"generation failed: {exc}", exc.field)
        return ApiError(500, f"generation failed: {exc}")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, f"internal server error ({type(exc).__name__})")


def handle_exception(request: Request, exc: Exception) -> Response[Any]:
    """Litestar exception handler: any error outside a handler's own try, in the route's shape."""
    return error_response(errors_of(request), api_error(exc))
