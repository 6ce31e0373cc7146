"""The response writer (pagoda.api.stream_writer): failed and stalled writes, keep-alives, batching."""

import asyncio

import pytest

from pagoda.api import stream_writer
from pagoda.api.client_watch import CLIENT_DISCONNECT, SEND_STALL, ClientGone
from pagoda.api.stream_writer import END, GONE, ResponseWriter, encode_ndjson, encode_sse
from pagoda.plugins.protocol import Event
from tests.helpers import FakeConnection, run


def test_a_send_that_raises_oserror_is_a_disconnect():
    writer = ResponseWriter(FakeConnection(fail_with=ConnectionResetError()).send, stall_timeout=2.0)
    with pytest.raises(ClientGone) as info:
        run(writer.start(200, []))
    assert info.value.reason == CLIENT_DISCONNECT and not writer.started


def test_a_send_that_makes_no_progress_is_a_stall():
    conn = FakeConnection(hang_from=1)
    writer = ResponseWriter(conn.send, stall_timeout=0.05)

    async def main():
        await writer.start(200, [])
        await writer.body(b"data: 1\n\n", more=True)

    with pytest.raises(ClientGone) as info:
        run(main())
    assert info.value.reason == SEND_STALL and writer.started and not writer.complete
    assert len(conn.messages) == 1


def test_other_send_errors_are_bugs_not_departures():
    writer = ResponseWriter(FakeConnection(fail_with=RuntimeError("unexpected message")).send, stall_timeout=2.0)
    with pytest.raises(RuntimeError):
        run(writer.start(200, []))


def test_a_stream_starts_with_a_comment_and_batches_what_waits():
    conn = FakeConnection()
    writer = ResponseWriter(conn.send, stall_timeout=2.0)
    mailbox = asyncio.Queue()
    for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", END):
        mailbox.put_nowait(chunk)
    run(writer.stream("sse", mailbox))
    start = conn.messages[0]
    assert start["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert conn.bodies == [b": keep-alive\n\n", b"data: 1\n\ndata: 2\n\ndata: 3\n\n", b""]
    assert writer.complete and not conn.messages[-1]["more_body"]


def test_ndjson_streams_get_no_comment():
    conn = FakeConnection()
    mailbox = asyncio.Queue()
    mailbox.put_nowait(b'{"a": 1}\n')
    mailbox.put_nowait(END)
    run(ResponseWriter(conn.send, stall_timeout=2.0).stream("ndjson", mailbox))
    assert conn.bodies == [b'{"a": 1}\n', b""]
    assert (b"content-type", b"application/x-ndjson") in conn.messages[0]["headers"]


def test_a_silence_gets_keep_alives_and_a_departure_ends_the_stream(monkeypatch):
    monkeypatch.setattr(stream_writer, "KEEPALIVE_SECONDS", 0.01)
    conn = FakeConnection()
    mailbox = asyncio.Queue()

    async def main():
        writer = asyncio.ensure_future(ResponseWriter(conn.send, stall_timeout=2.0).stream("sse", mailbox))
        while conn.bodies.count(stream_writer.KEEPALIVE) < 3:  # nothing to say: a comment every interval
            await asyncio.sleep(0.01)
        mailbox.put_nowait(b"data: 1\n\n")
        mailbox.put_nowait(GONE)
        with pytest.raises(ClientGone) as info:
            await writer
        return info.value.reason

    assert run(main()) == CLIENT_DISCONNECT
    assert b"data: 1\n\n" not in conn.bodies  # found gone before it was written
    assert conn.bodies[-1] == stream_writer.KEEPALIVE  # and the response was never completed


def test_events_are_encoded_as_sse_and_ndjson():
    assert encode_sse(Event({"a": 1}, "delta")) == b'event: delta\ndata: {"a":1}\n\n'
    assert encode_sse(Event("[DONE]")) == b"data: [DONE]\n\n"
    assert encode_ndjson(Event({"a": 1})) == b'{"a":1}\n'
