"""Finding out that a client left while nothing is being written to it.

uvicorn reports a closed connection as an `http.disconnect` message from the
ASGI `receive`; a handler that is awaiting a result is not reading messages
and never learns of it. So every wait that writes nothing (a whole unary
generation; a stream's admission and prefill, before its first event) runs
as a race between the work and a watcher on `receive`. The first to finish
decides: the work's result (or its exception: an admission error stays a
400), or the disconnect, after which the disconnect policy decides the work's
fate and the handler answers 499 for the access log.

Once a stream is under way, Litestar's `Stream` watches `receive` itself and
cancels the body iterator when the client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pagoda.plugins.disconnect import DisconnectPolicy

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]


class ClientGone:
    """The result of a race the client lost by leaving."""

    def __repr__(self) -> str:
        return "CLIENT_GONE"


CLIENT_GONE = ClientGone()


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects; every other message (a pipelined request...) is ignored."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_client_leaves(work: Awaitable[T], receive: Receive, policy: DisconnectPolicy) -> T | ClientGone:
    """Await `work` unless the client leaves first; start this only after the body was read."""
    job = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((job, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (shutdown): the work goes with it
        job.cancel()
        watcher.cancel()
        raise
    if job.done():  # the work decides even when both finished at once
        watcher.cancel()
        return job.result()
    watcher.exception()  # retrieved, so asyncio does not warn: a receive that fails is a connection gone too
    await policy.client_gone(job)
    return CLIENT_GONE
