"""Writing a response to a connection that may be gone, or whose client may have stopped reading.

Every ASGI `send` of a generation response goes through `ResponseWriter.send`,
which turns the two ways a write can fail into `ClientGone`:

- it raises OSError: the ASGI spec's answer to a send on a closed connection
  (uvicorn itself does not raise: on a closed connection its send returns
  without writing, and the disconnect is reported on `receive` instead);
- it makes no progress for the stall deadline. A transport write never blocks;
  uvicorn pauses writing once the transport's buffer is past its high-water
  mark (64 KiB), and its `send` then waits for the buffer to drain. A client
  that stopped reading keeps that wait going forever; the deadline ends it.
  What the deadline cannot see is output that still fits in the buffers: the
  transport's 64 KiB plus the kernel's socket buffers (which Linux autotunes
  up to megabytes unless `pagoda serve --send-buffer-size` bounds ours), so a
  client that stops reading is found out once that much of its output is unread.

A stream's chunks reach the writer through a mailbox (an asyncio.Queue) that
three parties fill: the job (encoded events, in order), the job's end (END,
from its done-callback, whatever the way it ended), and the client watch
(GONE). The writer sends what has accumulated in one write, so a slow reader
gets fewer, larger writes, and, when nothing arrives for a while (a long
prefill, a queue), an SSE comment: it keeps proxies and clients from timing
out, and a write is what finds a dead peer on servers whose send raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from pagoda.api.client_watch import CLIENT_DISCONNECT, SEND_STALL, ClientGone
from pagoda.plugins.protocol import Event

Send = Callable[[dict[str, Any]], Awaitable[None]]

MEDIA_TYPES = {"sse": "text/event-stream; charset=utf-8", "ndjson": "application/x-ndjson"}
STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: every SSE parser skips it
KEEPALIVE_SECONDS = 1.0  # silence after which a stream gets a keep-alive comment



class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


END = _Marker("END")  # mailbox: the job ended; everything it produced is ahead of this
GONE = _Marker("GONE")  # mailbox: the client disconnected


def encode_sse(event: Event) -> bytes:
    """One server-sent event: an optional `event:` line, one `data:` line, a blank line."""
    data = event.data if isinstance(event.data, str) else msgspec.json.encode(event.data).decode()
    head = f"event: {event.name}\n" if event.name else ""
    return f"{head}data: {data}\n\n".encode()


def encode_ndjson(event: Event) -> bytes:
    """One line of newline-delimited JSON."""
    data = event.data.encode() if isinstance(event.data, str) else msgspec.json.encode(event.data)
    return data + b"\n"


ENCODERS = {"sse": encode_sse, "ndjson": encode_ndjson}


class ResponseWriter:
    """Sends one response; a write that fails or stalls raises ClientGone."""

    def __init__(self, send: Send, stall_timeout: float | None) -> None:
        self._send = send
        self.stall_timeout = stall_timeout  # seconds without write progress; None = wait forever
        self.started = False  # the status line went out
        self.complete = False  # the last body message went out

    async def send(self, message: dict[str, Any]) -> None:
        """Send one ASGI message within the stall deadline."""
        try:
            async with asyncio.timeout(self.stall_timeout):
                await self._send(message)
        except TimeoutError:  # (an OSError subclass: caught first)
            raise ClientGone(SEND_STALL) from None
        except OSError:
            raise ClientGone(CLIENT_DISCONNECT) from None
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.complete = True

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, *, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def stream(self, stream_format: str, mailbox: asyncio.Queue[Any]) -> None:
        """Start a 200 stream and write the mailbox's chunks until END; raise ClientGone if the client goes."""
        keepalive = KEEPALIVE if stream_format == "sse" else None  # NDJSON has no comment syntax
        await self.start(200, [(b"content-type", MEDIA_TYPES[stream_format].encode()), *STREAM_HEADERS])
        if keepalive:
            await self.body(keepalive, more=True)  # sent before the prefill: a dead stream is found before decode
        while True:
            data, ended = await self._next_write(mailbox, keepalive)
            if data:
                await self.body(data, more=True)
            if ended:
                break
        await self.body(b"", more=False)

    async def _next_write(self, mailbox: asyncio.Queue[Any], keepalive: bytes | None) -> tuple[bytes, bool]:
        """What to write next: every chunk waiting now (or a keep-alive after a silence), and whether it ended."""
        if mailbox.empty():
            try:
                async with asyncio.timeout(KEEPALIVE_SECONDS if keepalive else None):
                    first = await mailbox.get()
            except TimeoutError:
                return keepalive or b"", False
            items = [first]
        else:
            items = []
        while not mailbox.empty():
            items.append(mailbox.get_nowait())
        if any(item is GONE for item in items):
            raise ClientGone(CLIENT_DISCONNECT)
        ended = any(item is END for item in items)
        return b"".join(item for item in items if item is not END), ended
