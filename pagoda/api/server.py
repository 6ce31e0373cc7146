"""Running the app under uvicorn: in the foreground (`pagoda serve`) or on a background thread.

We bind the listening socket ourselves, so that port 0 (the kernel picks a
free port) works and the caller knows the port before anything connects, and
readiness means uvicorn's `started` (set after the lifespan start-up ran, i.e.
after the engine loop started), not merely "the port accepts".

In the foreground, SIGTERM and SIGINT start the app's drain (pagoda.api.drain)
instead of uvicorn's immediate shutdown; uvicorn's shutdown follows once the
drain is done, and the signal is not raised again afterwards, so a drained
server exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from pagoda.api.limits import h11_buffer_for


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


def bind_socket(host: str, port: int, send_buffer: int | None = None) -> socket.socket:
    """A bound (not yet listening) TCP socket; port 0 lets the kernel choose.

    `send_buffer` (bytes) fixes SO_SNDBUF, which accepted connections inherit: it bounds how much
    unread output a client can leave in our socket before the send-stall deadline starts counting
    (None keeps the kernel's autotuning, up to megabytes).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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


def _config(app: Any, **overrides: Any) -> uvicorn.Config:
    # Our own access log replaces uvicorn's; graceful shutdown must not wait forever on open streams.
    options = {"log_level": "info", "access_log": False, "lifespan": "on", "timeout_graceful_shutdown": 5}
    settings = getattr(getattr(app, "state", None), "settings", None)  # a pagoda app's ServeSettings
    if settings is not None:  # h11 must buffer past our header limit for the app to answer 431 (api/limits.py)
        options["h11_max_incomplete_event_size"] = h11_buffer_for(settings.max_header_bytes)
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
