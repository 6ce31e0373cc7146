"""The "finish" disconnect policy: a departed client's generation runs to its end anyway.

For deployments that want the work even when nobody reads it: to keep the
request's KV for a later prefix hit, or to log the complete generation for
audit. The request still costs its full generation, so the access log says
499 (with the complete token counts) and `pagoda_client_departures_total`
counts the departure, but `pagoda_requests_aborted_total` does not move: the
engine request was not aborted. If the server shuts down meanwhile, the
handler is cancelled and the job with it, as on any other exit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagoda.plugins.disconnect import DisconnectPolicy
from pagoda.plugins.hookspecs import hookimpl


class FinishOnDisconnect(DisconnectPolicy):
    """Wait for the generation to complete; its output goes nowhere."""

    name = "finish"

    async def client_gone(self, job: asyncio.Future[Any], reason: str) -> None:
        await asyncio.wait([job])
        if not job.cancelled():
            job.exception()  # retrieved: there is nobody to tell


@hookimpl
def pagoda_register_disconnect_policies(register):
    register(FinishOnDisconnect())
