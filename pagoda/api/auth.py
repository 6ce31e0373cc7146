"""The API key: a Litestar guard on generation and model routes (/health and /metrics stay open).

OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`;
either header is accepted on every guarded route.
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard


def api_key_guard(api_key: str) -> Guard:
    """A guard refusing requests without `api_key` (401 in the route's own error shape)."""
    expected = api_key.encode()

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if not any(hmac.compare_digest(expected, offered.encode()) for offered in _offered_keys(connection)):
            raise NotAuthorizedException(
                detail="invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )

    return guard


def _offered_keys(connection: ASGIConnection) -> list[str]:
    keys = []
    authorization = connection.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if connection.headers.get("x-api-key"):
        keys.append(connection.headers["x-api-key"])
    return keys
