"""The default disconnect policy: abort the generation as soon as its client is gone."""

from __future__ import annotations

import asyncio
from typing import Any

from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.hookspecs import hookimpl


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
