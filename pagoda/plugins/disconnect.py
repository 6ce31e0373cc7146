"""What happens to a request whose client went away, and the built-in answer: abort it.

The server finds out that a client is gone (pagoda.api.disconnect: the
connection closed, a write failed, or a stream made no write progress for the
stall deadline) and hands the request's still-running job to the policy that
`pagoda serve --disconnect-policy NAME` chose. The job is the asyncio task
that consumes the request's engine outputs; cancelling it aborts the engine
request (in `AsyncEngine.generate`'s `finally`).

A policy can only choose *when* the work ends, never to leave it running:
whatever the job is still doing when `client_gone` returns is cancelled by the
server. "abort" (the default) cancels at once; "finish"
(pagoda.plugins.disconnect_finish) waits for the generation to complete.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from pagoda.plugins.hookspecs import hookimpl


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


class AbortOnDisconnect(DisconnectPolicy):
    """Cancel the generation and wait until the cancellation has been delivered."""

    name = "abort"

    async def client_gone(self, job: asyncio.Future[Any], reason: str) -> None:
        job.cancel()
        # The abort runs inside the job when the cancellation is delivered; wait for it, and
        # swallow the job's own outcome (there is nobody to tell).
        await asyncio.wait([job])
        if not job.cancelled():
            job.exception()


@hookimpl
def pagoda_register_disconnect_policies(register):
    register(AbortOnDisconnect())
