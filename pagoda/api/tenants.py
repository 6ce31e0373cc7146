"""Tenants: which caller a request is, from the key it presents (`--api-key`, `--api-keys-file`).

Design note. The table holds an immutable tuple of `Tenant`s, swapped whole by `reload` (SIGHUP), so a
request sees one version of it and a stream in flight keeps going on the tenant it was admitted as. A
presented key is hashed (SHA-256) and compared with `hmac.compare_digest` against every tenant's hash, with
no early exit, so the time a request takes does not tell how many hashes, or which, a key came close to.
The guard stores the tenant it found in the request's scope (`TENANT_KEY`) for the handler. A server with
no keys has one tenant, "default", with no key, no limits and a shared prefix cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import signal
import threading
from pathlib import Path

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler

from pagoda.api.auth import offered_keys
from pagoda.api.keys_file import DEFAULT_TENANT, KeysFileError, Tenant, read_keys_file, single_key_tenant

logger = logging.getLogger("pagoda.api")
TENANT_KEY = "pagoda.tenant"  # scope key of the Tenant the guard matched
OPEN = Tenant(DEFAULT_TENANT, None, manage_adapters=True)  # the one tenant of a server that needs no key


class TenantTable:
    """The tenants one server knows, matched by key; re-read from the keys file by `reload`."""

    def __init__(self, api_key: str | None = None, keys_file: str | Path | None = None) -> None:
        """`api_key`: one tenant, "default"; `keys_file`: its tenants (read now: KeysFileError if unusable)."""
        self.keys_file = Path(keys_file) if keys_file is not None else None
        self._extra = (single_key_tenant(api_key),) if api_key else ()
        self.tenants = self._read()

    @property
    def needs_key(self) -> bool:
        """Whether requests must present a key (any tenant has one)."""
        return bool(self.tenants)

    def _read(self) -> tuple[Tenant, ...]:
        tenants = read_keys_file(self.keys_file) if self.keys_file is not None else ()
        if self._extra and any(t.name == DEFAULT_TENANT for t in tenants):
            raise KeysFileError(f"keys file {self.keys_file}: tenant name {DEFAULT_TENANT!r} is --api-key's")
        return (*self._extra, *tenants)

    def reload(self) -> bool:
        """Re-read the keys file; a file that cannot be used leaves the tenants as they were (logged)."""
        if self.keys_file is None:
            return False
        try:
            tenants = self._read()
        except KeysFileError as exc:
            logger.error("keys file not reloaded, the previous keys stay in force: %s", exc)
            return False
        self.tenants = tenants
        logger.warning("keys file %s reloaded: %d tenants (%s)", self.keys_file, len(tenants),
                       ", ".join(t.name for t in tenants))
        return True

    def match(self, keys: list[str]) -> Tenant | None:
        """The tenant whose key is among `keys`, compared in constant time over every tenant; None if none."""
        tenants = self.tenants  # one version for the whole comparison
        found = None
        for key in keys:
            digest = hashlib.sha256(key.encode()).digest()
            for tenant in tenants:
                if hmac.compare_digest(digest, tenant.key_digest or b"") and found is None:
                    found = tenant
        return found

    def guard(self, connection: ASGIConnection, _: BaseRouteHandler) -> None:
        """A Litestar guard: 401 (in the route's error shape) without a known key; the tenant kept in the scope."""
        tenant = self.match(offered_keys(connection))
        if tenant is None:
            raise NotAuthorizedException(
                detail="invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        connection.scope[TENANT_KEY] = tenant  # type: ignore[literal-required]

    def of(self, connection: ASGIConnection) -> Tenant:
        """The tenant of a request the guard let through (OPEN on a server without keys)."""
        tenant = connection.scope.get(TENANT_KEY)
        if isinstance(tenant, Tenant):
            return tenant
        if not self.needs_key:
            return OPEN
        self.guard(connection, None)  # type: ignore[arg-type]  # a route the guard did not run on
        return connection.scope[TENANT_KEY]  # type: ignore[literal-required]


def reload_on_sighup(table: TenantTable) -> None:
    """Re-read `table`'s keys file on SIGHUP (the running loop's handler; only the main thread can have one)."""
    if table.keys_file is None or threading.current_thread() is not threading.main_thread():
        return
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, table.reload)
