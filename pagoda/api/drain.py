"""Graceful shutdown: on SIGTERM (or Ctrl-C) the server drains before it exits.

    draining   new generation requests are refused with 503 (Retry-After), /health answers 503
               {"status": "draining", ...}; the listening socket stays open so that both can be said
    waiting    requests in flight run on, for up to --shutdown-timeout seconds, until the engine is idle
    aborting   what is still running is aborted: a unary request gets a 503, a stream the protocol's
               error event (its engine request ends with finish reason abort)
    exiting    uvicorn closes the connections and runs the app's shutdown; the process exits 0

The signal handling itself is in pagoda.api.server (`_Server.handle_exit`); a
second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pagoda.core.async_engine import AsyncEngine, EngineDeadError

logger = logging.getLogger("pagoda.api")


class DrainState:
    """Whether this server is draining (set once, on the event loop; read by handlers and /health)."""

    def __init__(self) -> None:
        self.since: float | None = None  # time.monotonic() when draining began

    @property
    def draining(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        """Refuse new generation requests from now on."""
        if self.since is None:
            self.since = time.monotonic()


async def drain(state: DrainState, engine: AsyncEngine, timeout: float) -> None:
    """Refuse new work, let the requests in flight finish for up to `timeout` s, then abort the rest."""
    state.begin()
    logger.info("draining: refusing new requests, waiting up to %g s for those in flight", timeout)
    try:
        await asyncio.wait_for(engine.wait_until_idle(), timeout)
    except asyncio.TimeoutError:
        logger.warning("shutdown timeout (%g s): aborting the requests still in flight", timeout)
    except EngineDeadError:
        pass  # nothing left to wait for
    await asyncio.to_thread(engine.stop)  # aborts whatever is left; its callers hear it as an abort
