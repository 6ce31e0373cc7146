"""What happens to a request whose client went away, and the built-in answer: abort it.

The server finds out that a client is gone in one place (pagoda.api.disconnect:
a watcher on the connection's `receive` raced against the generation) and then
hands the still-running generation job to the configured policy. The default,
"abort", cancels the job; the cancellation lands in `AsyncEngine.generate`'s
`finally`, which aborts the engine request, and the policy waits for that to
happen so the request's blocks are on their way back when it returns.

A stream needs no watcher: its body iterator is the job, and the HTTP layer
cancels it when the client disconnects.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from pagoda.plugins.hookspecs import hookimpl


class DisconnectPolicy:
    """Decides the fate of a generation whose client is gone; subclass and register it."""

    name: ClassVar[str]

    async def client_gone(self, job: asyncio.Future[Any]) -> None:
        """Called once when the client left while `job` (the request's generation) still runs."""
        raise NotImplementedError


class AbortOnDisconnect(DisconnectPolicy):
    """Cancel the generation and wait until the cancellation has been delivered."""

    name = "abort"

    async def client_gone(self, job: asyncio.Future[Any]) -> None:
        job.cancel()
        # The abort runs inside the job when the cancellation is delivered; wait for it, and
        # swallow the job's own outcome (there is nobody to tell).
        await asyncio.wait([job])
        if not job.cancelled():
            job.exception()


@hookimpl
def pagoda_register_disconnect_policies(register):
    register(AbortOnDisconnect())
