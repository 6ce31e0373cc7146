"""The API key: a Litestar guard on generation and model routes (/health and /metrics stay open).

OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`;
either header is accepted on every guarded route.

The key a request presented also names its prefix-cache tenant (`key_tenant`): requests under different
keys never share cached blocks, so one key's holder cannot learn from timing what another's sent.
The server matches keys to tenants with pagoda.api.tenants (its guard, for one key or a keys file); this
module keeps the single-key guard and hash that the router shares.
"""

from __future__ import annotations

import hashlib
import hmac

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard


def api_key_guard(api_key: str) -> Guard:
    """A guard refusing requests without `api_key` (401 in the route's own error shape)."""
    expected = api_key.encode()

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if not any(hmac.compare_digest(expected, offered.encode()) for offered in offered_keys(connection)):
            raise NotAuthorizedException(
                detail="invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )

    return guard


def key_tenant(connection: ASGIConnection, api_key: str | None) -> str | None:
    """The request's prefix-cache tenant: a hash of the server key it presented (None when no key is set)."""
    if api_key is None:
        return None
    expected = api_key.encode()
    for offered in offered_keys(connection):
        if hmac.compare_digest(expected, offered.encode()):
            return key_hash(offered)
    return None  # the guard refuses such a request before it gets here


def key_hash(api_key: str) -> str:
    """The prefix-cache tenant of requests presenting `api_key` (a hash: the key itself is kept nowhere)."""
    return hashlib.blake2b(api_key.encode(), digest_size=16, person=b"pagoda-tenant").hexdigest()


def offered_keys(connection: ASGIConnection) -> list[str]:
    """The keys a request presents: its bearer token and its x-api-key header, either or both."""
    keys = []
    authorization = connection.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if connection.headers.get("x-api-key"):
        keys.append(connection.headers["x-api-key"])
    return keys
