"""The client watch and the job's end (pagoda.api.client_watch), without a server."""

import asyncio

import pytest

from tests.helpers import FakeConnection, run
from pagoda.api.client_watch import CLIENT_DISCONNECT, ClientGone, ClientWatch, end_job, wait_for_disconnect


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_other_messages_do_not_look_like_a_disconnect():
    async def main():
        # A pipelined request on a keep-alive connection arrives as http.request messages.
        conn = FakeConnection({"type": "http.request", "body": b"", "more_body": False}, {"type": "http.request"})
        watcher = asyncio.ensure_future(wait_for_disconnect(conn.receive))
        await settle()
        assert not watcher.done() and conn.reads == 3  # both messages read and ignored, waiting for more
        conn.leave()
        await watcher

    run(main())


def test_work_that_finishes_first_wins_and_the_watch_stops():
    async def main():
        conn = FakeConnection({"type": "http.request"})
        watch = ClientWatch(conn.receive)
        job = asyncio.ensure_future(asyncio.sleep(0, result=42))
        await watch.first(job)
        assert job.result() == 42 and not watch.gone
        watch.close()
        conn.leave()  # nobody is listening any more
        await settle()
        assert conn.incoming.qsize() == 1 and not watch.gone

    run(main())


def test_the_works_exception_is_not_taken_for_a_disconnect():
    async def main():
        async def refused():
            raise ValueError("prompt is too long")

        watch = ClientWatch(FakeConnection().receive)
        job = asyncio.ensure_future(refused())
        await watch.first(job)  # returns: the work decided
        with pytest.raises(ValueError, match="too long"):
            job.result()
        watch.close()

    run(main())


def test_a_client_that_leaves_first_raises_client_gone_and_calls_back():
    async def main():
        conn = FakeConnection()
        watch = ClientWatch(conn.receive)
        called = []
        watch.on_gone(lambda: called.append(True))
        job = asyncio.ensure_future(asyncio.sleep(3600))
        race = asyncio.ensure_future(watch.first(job))
        await settle()
        assert not race.done()
        conn.leave()
        with pytest.raises(ClientGone) as info:
            await race
        assert info.value.reason == CLIENT_DISCONNECT and watch.gone and called == [True]
        assert not job.done()  # the watch decides nothing about the work: end_job does
        await end_job(job)
        assert job.cancelled()

    run(main())


def test_a_receive_that_fails_counts_as_gone():
    async def main():
        async def broken():
            raise OSError("connection reset")

        watch = ClientWatch(broken)
        with pytest.raises(ClientGone):
            await watch.first(asyncio.ensure_future(asyncio.sleep(3600)))

    run(main())


def test_end_job_cancels_a_running_job_and_waits_for_its_cleanup():
    async def main():
        started, cleaned_up = asyncio.Event(), asyncio.Event()

        async def work():
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0)  # cleanup that itself awaits, like an abort being queued
                cleaned_up.set()

        job = asyncio.ensure_future(work())
        await started.wait()
        await end_job(job)
        assert job.cancelled() and cleaned_up.is_set()  # returned only after the job's finally ran

    run(main())


def test_end_job_leaves_a_finished_job_alone():
    async def main():
        job = asyncio.ensure_future(asyncio.sleep(0, result="done"))
        await job
        await end_job(job)
        assert job.result() == "done"

        failed = asyncio.ensure_future(asyncio.sleep(0))
        failed.cancel()
        await end_job(failed)  # a job that already ended any way at all is fine
        assert failed.cancelled()

    run(main())
