"""One line per HTTP request on the logger "pagoda.access": method, path, status, duration, tokens, tenant.

An ASGI middleware: it sees the status the response starts with, and the
handler fills in an `AccessRecord` it finds in the scope (token counts, and
why the client left, if it did). A request whose client left is logged with
499 and the reason (client_disconnect, send_stall), also when a stream had
already sent its 200. A generation request names its tenant (pagoda.api.tenants), never its key.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.api.metrics import AccessRecord

logger = logging.getLogger("pagoda.access")
RECORD_KEY = "pagoda.access"  # scope key of the request's AccessRecord
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; only the access log ever sees it


def access_record(scope: Scope | dict[str, Any]) -> AccessRecord:
    """The request's record (a throwaway one outside the middleware, e.g. in unit tests)."""
    record = scope.get(RECORD_KEY)
    return record if isinstance(record, AccessRecord) else AccessRecord()


def access_log_middleware(app: ASGIApp) -> ASGIApp:
    """Wrap an ASGI app so that each HTTP request leaves one access-log line."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        record = AccessRecord()
        scope[RECORD_KEY] = record  # type: ignore[literal-required]
        status = 500  # what a crash before the response started amounts to
        start = time.monotonic()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_status)
        finally:
            logged = CLIENT_CLOSED_REQUEST if record.client_gone else status
            duration_ms = (time.monotonic() - start) * 1000
            client = scope.get("client")
            logger.info(
                '%s "%s %s" %d %.1fms prompt_tokens=%d completion_tokens=%d%s%s',
                f"{client[0]}:{client[1]}" if client else "-", scope["method"], scope["path"], logged, duration_ms,
                record.prompt_tokens, record.completion_tokens,
                f" tenant={record.tenant}" if record.tenant else "",
                f" reason={record.client_gone}" if record.client_gone else "",
                extra={"method": scope["method"], "path": scope["path"], "status": logged, "duration_ms": duration_ms,
                       "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                       "reason": record.client_gone, "tenant": record.tenant},
            )

    return middleware
