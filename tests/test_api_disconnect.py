"""The race between a request's work and its client leaving (pagoda.api.disconnect), without a server."""

import asyncio

import pytest

from pagoda.api.disconnect import CLIENT_GONE, run_until_client_leaves, wait_for_disconnect
from pagoda.plugins.disconnect import AbortOnDisconnect


class Connection:
    """A fake ASGI receive: hands out queued messages, then waits."""

    def __init__(self, *messages):
        self.queue = asyncio.Queue()
        for m in messages:
            self.queue.put_nowait(m)
        self.reads = 0

    async def receive(self):
        self.reads += 1
        return await self.queue.get()

    def leave(self):
        self.queue.put_nowait({"type": "http.disconnect"})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_other_messages_do_not_look_like_a_disconnect():
    async def main():
        conn = Connection({"type": "http.request", "body": b"", "more_body": False}, {"type": "http.request"})
        watcher = asyncio.ensure_future(wait_for_disconnect(conn.receive))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not watcher.done() and conn.reads == 3  # both messages read and ignored, waiting for more
        conn.leave()
        await watcher

    run(main())


def test_work_that_finishes_first_returns_its_result_and_stops_the_watcher():
    async def main():
        conn = Connection({"type": "http.request"})

        async def work():
            await asyncio.sleep(0)
            return 42

        assert await run_until_client_leaves(work(), conn.receive, AbortOnDisconnect()) == 42
        conn.leave()  # nobody is listening any more
        await asyncio.sleep(0)
        assert conn.queue.qsize() == 1

    run(main())


def test_the_works_exception_is_raised_not_taken_for_a_disconnect():
    async def main():
        async def refused():
            raise ValueError("prompt is too long")

        with pytest.raises(ValueError, match="too long"):
            await run_until_client_leaves(refused(), Connection().receive, AbortOnDisconnect())

    run(main())


def test_a_client_that_leaves_first_cancels_the_work_and_waits_for_its_cleanup():
    async def main():
        conn = Connection()
        cleaned_up = asyncio.Event()
        started = asyncio.Event()

        async def work():
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0)  # cleanup that itself awaits, like an abort being queued
                cleaned_up.set()

        race = asyncio.ensure_future(run_until_client_leaves(work(), conn.receive, AbortOnDisconnect()))
        await started.wait()
        conn.leave()
        assert await race is CLIENT_GONE
        assert cleaned_up.is_set()  # the policy returned only after the work's finally ran

    run(main())


def test_a_cancelled_handler_takes_the_work_with_it():
    async def main():
        cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        race = asyncio.ensure_future(run_until_client_leaves(work(), Connection().receive, AbortOnDisconnect()))
        await asyncio.sleep(0)
        race.cancel()
        with pytest.raises(asyncio.CancelledError):
            await race
        await asyncio.wait_for(cancelled.wait(), 5)

    run(main())
