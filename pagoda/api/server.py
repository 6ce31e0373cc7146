"""Running the app under uvicorn: in the foreground (`pagoda serve`) or on a background thread.

We bind the listening socket ourselves, so that port 0 (the kernel picks a
free port) works and the caller knows the port before anything connects, and
readiness means uvicorn's `started` (set after the lifespan start-up ran, i.e.
after the engine loop started), not merely "the port accepts".

In the foreground, SIGTERM and SIGINT start the app's drain (pagoda.api.drain)
instead of uvicorn's immediate shutdown; uvicorn's shutdown follows once the
drain is done, and the signal is not raised again afterwards, so a drained
server exits 0. A second signal stops at once.

A pagoda app's connections are served by `ReadDeadlineProtocol` (uvicorn's h11
protocol with a deadline on reading each request: slow clients) and capped by
uvicorn's `limit_concurrency` when `max_connections` is set; docs/reliability.md,
"Slow clients".
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagoda.api.http_errors import DEFAULT_ERRORS
from pagoda.plugins.protocol import ApiError

logger = logging.getLogger("pagoda.api")


class _Server(uvicorn.Server):
    """uvicorn's server, calling `on_ready` once start-up has finished."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None],
                 drain: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._drain = drain  # run on the first exit signal, before uvicorn's shutdown
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            self._on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain, then shut down; a second: shut down now. Never re-raised at exit (exit 0)."""
        if self._drain is None or self._loop is None or self._draining is not None or self.should_exit:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._draining is None and self._drain is not None:
            self._draining = asyncio.ensure_future(self._drain_then_exit(self._drain))

    async def _drain_then_exit(self, drain: Callable[[], Awaitable[None]]) -> None:
        try:
            await drain()
        except Exception:
            logging.getLogger("pagoda.api").exception("the drain failed; shutting down now")
        finally:
            self.should_exit = True


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with `read_timeout` seconds for each request to arrive whole (headers and body).

    Design note. uvicorn bounds the idle time between requests (`timeout_keep_alive`) but not the time a
    request takes to arrive, so a client that sends a header line every few seconds holds its connection,
    a file descriptor and a slot of `limit_concurrency` forever (slowloris). One timer per connection is
    armed when the connection opens and when a request's first bytes arrive, and disarmed once h11 holds
    the client's whole message: from then on the app may take as long as it likes (a stream may last
    minutes); between requests uvicorn's keep-alive timeout governs. Whether a request is arriving is read
    from h11's state after every event that moves it (`_arriving`: data received, a response completed
    and pipelined bytes started the next request), one rule rather than a flag per path. On expiry a
    request that has sent bytes and been sent nothing gets a 408 with `Connection: close`; the connection
    then closes (an app still waiting for the body sees `http.disconnect`). A connection that never sent
    a byte is closed without a 408: there is no request to answer, and a client that picked it from its
    pool at that moment would read the 408 as the answer to its own request.
    """

    def __init__(self, *args: Any, read_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_deadline: asyncio.TimerHandle | None = None
        self._upgraded = False  # handed to a WebSocket protocol: no longer ours to time

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._settle_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._settle_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._settle_read_deadline()  # pipelined bytes may have started the next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True
        self._disarm_read_deadline()
        super().handle_websocket_upgrade(event)

    def _arriving(self) -> bool:
        """Whether a request is on its way: the first one of a fresh connection, a request's headers or its body."""
        if self._upgraded or self.transport.is_closing():
            return False
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return True
        return state is h11.IDLE and (self.cycle is None or bool(self.conn.trailing_data[0]))

    def _settle_read_deadline(self) -> None:
        if not self._arriving():
            self._disarm_read_deadline()
        elif self._read_deadline is None:  # the deadline counts from the first byte (or the opening), not the last
            self._read_deadline = self.loop.call_later(self.read_timeout, self._on_read_deadline)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_read_deadline(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        began = self.conn.their_state is not h11.IDLE or bool(self.conn.trailing_data[0])
        if began and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # nothing sent for this request yet
            self._send_408()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() says http.disconnect; its own answer goes nowhere
            self.cycle.message_event.set()
        logger.debug("closed %s: no whole request within %g s", self.client, self.read_timeout)
        self.transport.close()

    def _send_408(self) -> None:
        error = ApiError(408, f"the request did not arrive whole within {self.read_timeout:g} seconds",
                         None, "request_timeout")
        body = json.dumps(DEFAULT_ERRORS.render_error(error)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
        self.transport.write(out + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))


def bind_socket(host: str, port: int, send_buffer: int | None = None) -> socket.socket:
    """A bound (not yet listening) TCP socket; port 0 lets the kernel choose.

    `send_buffer` (bytes) fixes SO_SNDBUF, which accepted connections inherit: it bounds how much
    unread output a client can leave in our socket before the send-stall deadline starts counting
    (None keeps the kernel's autotuning, up to megabytes).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP, and
    # without it a response written as headers then body waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def h11_buffer_for(max_header_bytes: int) -> int:
    """uvicorn's `h11_max_incomplete_event_size`: room for headers well past our limit, so we can answer 431."""
    return 2 * max_header_bytes + 64 * 1024


def _config(app: Any, **overrides: Any) -> uvicorn.Config:
    # Our own access log replaces uvicorn's; graceful shutdown must not wait forever on open streams.
    options = {"log_level": "info", "access_log": False, "lifespan": "on", "timeout_graceful_shutdown": 5}
    settings = getattr(getattr(app, "state", None), "settings", None)  # a pagoda app's ServeSettings
    if settings is not None:
        # h11 must buffer past our header limit for the app to answer 431 (api/limits.py)
        options["h11_max_incomplete_event_size"] = h11_buffer_for(settings.max_header_bytes)
        # slow clients: each request must arrive whole within request_read_timeout (408, then closed)
        options["http"] = functools.partial(ReadDeadlineProtocol, read_timeout=settings.request_read_timeout)
        if settings.max_connections is not None:
            # uvicorn refuses a request when open connections >= limit_concurrency, its own connection
            # included: + 1 makes max_connections connections served and the next one refused (503).
            options["limit_concurrency"] = settings.max_connections + 1
    options.update(overrides)
    return uvicorn.Config(app, **options)


def run_server(app: Any, host: str, port: int, on_ready: Callable[[str], None], send_buffer: int | None = None,
               drain: Callable[[], Awaitable[None]] | None = None, **uvicorn_options: Any) -> None:
    """Serve `app` in the foreground until interrupted; `on_ready(url)` once it accepts requests.

    `drain` (a coroutine function) runs on the first SIGTERM/SIGINT, before uvicorn shuts down.
    """
    sock = bind_socket(host, port, send_buffer)
    url = url_of(sock)
    server = _Server(_config(app, **uvicorn_options), lambda: on_ready(url), drain)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after its shutdown
        pass


class BackgroundServer:
    """uvicorn serving `app` on its own thread and event loop, on 127.0.0.1 and a port the kernel picks."""

    def __init__(self, app: Any, host: str = "127.0.0.1", send_buffer: int | None = None,
                 **uvicorn_options: Any) -> None:
        self.app = app
        self.host = host
        self.send_buffer = send_buffer
        self.uvicorn_options = {"log_level": "warning", "timeout_graceful_shutdown": 2, **uvicorn_options}
        self.url = ""
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        """Start serving and return once the app's start-up has run (raises if it failed)."""
        sock = bind_socket(self.host, 0, self.send_buffer)
        self.url = url_of(sock)
        self._server = _Server(_config(self.app, **self.uvicorn_options), self._ready.set)
        self._thread = threading.Thread(target=self._serve, args=(sock,), name=f"pagoda-server {self.url}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"the server at {self.url} did not start within {timeout} s")
        if not self._server.started:  # the serve call ended before start-up finished
            self._thread.join(timeout)
            raise RuntimeError(f"the server at {self.url} failed to start") from self._failure
        return self

    def _serve(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[sock]))
        except BaseException as exc:  # a failed lifespan start-up ends in SystemExit
            self._failure = exc
        finally:
            sock.close()
            self._ready.set()  # wake start() whether or not start-up finished

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down (lifespan shutdown runs, open streams get `timeout_graceful_shutdown`) and join."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not stop within {timeout} s")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
