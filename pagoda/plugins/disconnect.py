"""The plugin type for what happens to a request whose client went away.

The server finds out that a client is gone (pagoda.api.client_watch: the
connection closed, a write failed, or a stream made no write progress for the
stall deadline) and hands the request's still-running job to the policy that
`pagoda serve --disconnect-policy NAME` chose. The job is the asyncio task
that consumes the request's engine outputs; cancelling it aborts the engine
request (in `AsyncEngine.generate`'s `finally`).

A policy can only choose *when* the work ends, never to leave it running:
whatever the job is still doing when `client_gone` returns is cancelled by the
server. The built-in policies: "abort" (the default, pagoda.plugins.builtin.disconnect_abort)
cancels at once; "finish" (pagoda.plugins.builtin.disconnect_finish) waits for the generation to complete.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar


class DisconnectPolicy:
    """Decides the fate of a generation whose client is gone; subclass and register it."""

    name: ClassVar[str]

    def send_stall_timeout(self, configured: float) -> float | None:
        """Seconds a write may make no progress before the client counts as gone (None: no deadline).

        `configured` is the server's --send-stall-timeout; the default keeps it.
        """
        return configured

    async def client_gone(self, job: asyncio.Future[Any], reason: str) -> None:
        """Called once when the client left ("client_disconnect" or "send_stall") while `job` may still run.

        When this returns, the server cancels what is left of the job; the default returns at once.
        """
