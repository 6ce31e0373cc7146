"""API keys as a request offers them (the guard on generation and model routes: pagoda.api.tenants).

OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`;
either header is accepted on every guarded route.

The key a request presented also names its prefix-cache tenant: requests under different keys never
share cached blocks, so one key's holder cannot learn from timing what another's sent. Servers and routers
match keys to tenants with pagoda.api.tenants (its guard, for one key or a keys file); this module keeps
what reads the keys a request offers and the hash an `--api-key` tenant's cache is keyed by.
"""

from __future__ import annotations

import hashlib

from litestar.connection import ASGIConnection


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
