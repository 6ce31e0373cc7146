"""Finding out that a client left, and making sure its request's work ends with it.

Three ways a client goes, each with its reason (the label of the 499 in the
access log and of `pagoda_requests_aborted_total`):

    client_disconnect  uvicorn saw the connection close and says so on `receive`
                       (an `http.disconnect`), or a write raised (the ASGI spec's
                       OSError for a closed connection)
    send_stall         a write made no progress for the stall deadline: the client
                       is connected but has stopped reading

A handler awaiting a result is not reading `receive`, so a `ClientWatch` reads
it for the whole life of a request, from the moment its body was read, and
ignores everything but `http.disconnect` (a pipelined follow-up request on a
keep-alive connection is not a disconnect). Whoever finds the client gone
raises `ClientGone`; the handler catches it in one place and hands the job
to the disconnect policy.

The request's work is one asyncio task, its *job*: the only consumer of the
engine's outputs, whose cancellation aborts the engine request (the abort
lives in `AsyncEngine.generate`'s `finally`). `end_job` runs in the handler's
`finally`: a job still running when the handler ends is cancelled and awaited,
whatever the exit was (a return, an exception, the handler's own cancellation,
a failed write), so no exit leaves work running for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("pagoda.api")

CLIENT_DISCONNECT = "client_disconnect"
SEND_STALL = "send_stall"

Receive = Callable[[], Awaitable[dict[str, Any]]]


class ClientGone(Exception):
    """The client left before its response was complete; `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects; every other message (a pipelined request...) is ignored."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientWatch:
    """A watcher on one request's `receive`; start it only after the body was read (it swallows messages)."""

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.ensure_future(wait_for_disconnect(receive))
        self._task.add_done_callback(_retrieve)

    @property
    def gone(self) -> bool:
        """True once the connection reported a disconnect (a receive that fails counts too)."""
        return self._task.done() and not self._task.cancelled()

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, when the client leaves (never after `close`)."""
        self._task.add_done_callback(lambda task: None if task.cancelled() else callback())

    async def first(self, *futures: asyncio.Future[Any]) -> None:
        """Wait until one of `futures` is done; raise ClientGone if the client leaves first (work wins ties)."""
        await asyncio.wait({self._task, *futures}, return_when=asyncio.FIRST_COMPLETED)
        if not any(f.done() for f in futures):
            raise ClientGone(CLIENT_DISCONNECT)

    def close(self) -> None:
        """Stop watching (the response is complete, or the handler is ending)."""
        self._task.cancel()


async def end_job(job: asyncio.Future[Any]) -> None:
    """Cancel `job` unless it finished, and wait until it stopped (its engine request's abort is queued then)."""
    if not job.done():
        job.cancel()
    await asyncio.wait([job])
    _retrieve(job)


def _retrieve(task: asyncio.Future[Any]) -> None:
    # The outcome was acted on elsewhere (or there is nobody left to tell): keep asyncio from warning.
    if not task.cancelled() and task.exception() is not None:
        logger.debug("ended with %r", task.exception())
