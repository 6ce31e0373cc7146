"""A protocol request's JSON body, decoded strictly before any handler sees it.

Litestar's own body decoding coerces ("8" becomes 8) and lets a deeply nested
body reach the decoder's recursion limit as a 500. So every endpoint route
decodes its body here first, in a `before_request` hook, and answers a bad one
in the protocol's own error shape:

    Content-Type not application/json      415 (a web page cannot POST JSON cross-origin without a preflight)
    not JSON, or nested too deeply         400
    not an object                          400
    a known field pagoda does not serve    400 naming it (the body struct's `unsupported_fields`)
    a value of the wrong type or range     400 naming its path (msgspec, strict: no "8" for 8)

A field the body struct does not know is ignored (forward compatibility) and
logged at debug. The decoded Struct is kept on the request's state for the
handler, so the body is validated once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from litestar import Request, Response

from pagoda.api.http_errors import error_response, http_error
from pagoda.plugins.protocol import Endpoint, ErrorShape
from pagoda.plugins.request_fields import RequestError

logger = logging.getLogger("pagoda.api")

STATE_KEY = "pagoda_body"  # request.state attribute holding the decoded body Struct
JSON_MEDIA_TYPE = "application/json"
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_body(body_type: type, raw: bytes, content_type: str | None = JSON_MEDIA_TYPE) -> Any:
    """The body as `body_type`, decoded strictly; raises RequestError (400 or 415) naming what is wrong."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise RequestError(f"Content-Type must be {JSON_MEDIA_TYPE}, got {media_type or 'none'!r}", status=415)
    try:
        data = msgspec.json.decode(raw)
    except RecursionError:
        raise RequestError("invalid request body: the JSON is nested too deeply") from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"invalid request body: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(f"invalid request body: expected a JSON object, got {type(data).__name__}")
    check_fields(body_type, data)
    try:
        return msgspec.convert(data, body_type)  # strict: a number sent as a string is refused
    except RecursionError:
        raise RequestError("invalid request body: the JSON is nested too deeply") from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        found = _PATH.search(message)
        param = found.group(1) if found and found.group(1) else None
        missing = re.search(r"missing required field `([^`]+)`", message)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        elif param is None and message.split(" ", 1)[0] in body_type.__struct_fields__:
            param = message.split(" ", 1)[0]  # a whole-body check (__post_init__) names its field first
        text = _PATH.sub("", message)
        raise RequestError(f"{param}: {text}" if param else f"invalid request body: {text}", param) from None


def check_fields(body_type: type, data: Mapping[str, Any]) -> None:
    """Refuse the known fields the struct lists as unsupported (unless harmless); log the unknown ones."""
    unsupported: Mapping[str, tuple[Any, ...]] = getattr(body_type, "unsupported_fields", {})
    for name, harmless in unsupported.items():
        if name in data and data[name] not in (None, False, *harmless):
            raise RequestError(f"{name} is not supported by this server", name)
    known = set(getattr(body_type, "__struct_fields__", ())) | set(unsupported)
    unknown = [name for name in data if name not in known]
    if unknown:
        logger.debug("ignoring unknown fields of a %s body: %s", body_type.__name__, ", ".join(unknown))


def strict_body(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response[Any] | None]]:
    """The endpoint route's before_request hook: decode the body, or answer in the protocol's shape."""
    return strict_body_of(endpoint.body_type, endpoint.errors)


def strict_body_of(body_type: type, errors: ErrorShape | None) -> Callable[[Request], Awaitable[Response[Any] | None]]:
    """A POST route's before_request hook: decode the body as `body_type`, or answer in `errors`' shape."""

    async def before_request(request: Request) -> Response[Any] | None:
        try:
            body = decode_body(body_type, await request.body(), request.headers.get("content-type"))
        except RequestError as exc:
            return error_response(errors, http_error(exc))
        setattr(request.state, STATE_KEY, body)
        return None

    return before_request
