"""Clients that hang up, stop reading or pipeline, over raw sockets, and servers configured for them.

The matrix is every endpoint the installed plugins register (the four built-in protocols, and the Ollama
example's two when its package is installed), stream and not: bodies come from each endpoint's client half.

A client that leaves is a socket that closes: no HTTP library in between
decides when the connection really goes. The engine is read directly (this
process holds it): a test takes the live `Request` object of its request and
reads its counters after the fact, which is the engine's own account of the
work it spent, not a clock.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.api.settings import ServeSettings
from pagoda.core.request import Request
from tests.helpers import metric_values, wait_for  # noqa: F401  (re-exported to the disconnect tests)
from pagoda.harness.live_server import LiveServer, start_server
from pagoda.plugins.client import ClientRequest
from pagoda.plugins.manager import registered_endpoints
from pagoda.plugins.manager import load_plugins

PLUGINS_ENV: dict[str, str] = {}  # PAGODA_PLUGINS unset: the built-in plugins and every installed one
ENDPOINTS = registered_endpoints(load_plugins(PLUGINS_ENV))  # protocol name -> Endpoint, as the servers have them
PROTOCOLS = tuple(ENDPOINTS)
PATHS = {protocol: endpoint.path for protocol, endpoint in ENDPOINTS.items()}
EVERY_PATH = [(protocol, stream) for protocol in PROTOCOLS for stream in (False, True)]
PROMPT = "Tell me a long story about a pagoda."


def start_live(model_dir: Path, name: str, *, settings: dict[str, Any] | None = None,
               environ: dict[str, str] | None = None, **engine_options: Any) -> LiveServer:
    """A live server with these ServeSettings fields and the matrix's plugins (unless `environ` says)."""
    server = start_server(model_dir, name, settings=ServeSettings(**(settings or {})),
                          environ=environ or PLUGINS_ENV, **engine_options)
    assert environ is not None or set(server.endpoints) == set(ENDPOINTS), (set(server.endpoints), set(ENDPOINTS))
    return server


def request_body(protocol: str, *, max_tokens: int, stream: bool, prompt: str = PROMPT,
                 **extra: Any) -> dict[str, Any]:
    """A greedy request that runs its whole budget (ignore_eos), in the protocol's shape (its client half's)."""
    ask = ClientRequest(prompt, max_tokens, stream=stream, temperature=0.0, ignore_eos=True, model="m")
    return {**ENDPOINTS[protocol].client_request(ask), **extra}


def new_request(live: LiveServer, known: set[str] | frozenset[str] = frozenset()) -> Request:
    """The engine's live Request object of a request not in `known` (waits for it to be admitted)."""
    found: list[Request] = []

    def admitted() -> bool:
        fresh = [r for rid, r in dict(live.async_engine.engine.requests).items() if rid not in known]
        found[:] = fresh
        return bool(fresh)

    wait_for(admitted, "the request to reach the engine")
    assert len(found) == 1, [r.request_id for r in found]
    return found[0]


def engine_counters(live: LiveServer) -> tuple[int, int]:
    """(generated tokens, steps) so far: plain ints read from this thread, a snapshot good to one step."""
    counters = live.async_engine.engine.counters
    return counters.generated_tokens_total, counters.steps_total


class RawClient:
    """One HTTP/1.1 connection on a plain socket."""

    def __init__(self, url: str, *, rcvbuf: int | None = None) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host = host
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so that the window is small from the start
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(60)
        self.sock.connect((host, int(port)))
        self.buffer = b""

    def request_bytes(self, path: str, body: dict[str, Any]) -> bytes:
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n")
        return head.encode() + data

    def post(self, path: str, body: dict[str, Any]) -> RawClient:
        self.sock.sendall(self.request_bytes(path, body))
        return self

    def read_until(self, marker: bytes, timeout: float = 60.0) -> bytes:
        """Read until `marker` has arrived; returns everything read so far."""
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"the connection closed before {marker!r}; got {self.buffer[-300:]!r}")
            self.buffer += chunk
        return self.buffer

    def _recv_into_buffer(self, need: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.buffer) < need:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the connection closed in the middle of a response")
            self.buffer += chunk

    def read_response(self, timeout: float = 60.0) -> tuple[int, bytes]:
        """One whole response, sized or chunked: (status, body); leaves what follows in the buffer."""
        self.read_until(b"\r\n\r\n", timeout)
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
        status = int(lines[0].split()[1])
        if "content-length" in headers:
            length = int(headers["content-length"])
            self._recv_into_buffer(length, timeout)
            body, self.buffer = self.buffer[:length], self.buffer[length:]
            return status, body
        assert headers.get("transfer-encoding") == "chunked", headers
        body = b""
        while True:
            self.read_until(b"\r\n", timeout)
            size_line, _, self.buffer = self.buffer.partition(b"\r\n")
            size = int(size_line, 16)
            self._recv_into_buffer(size + 2, timeout)
            body, self.buffer = body + self.buffer[:size], self.buffer[size + 2:]
            if size == 0:
                return status, body

    def read_to_eof(self, timeout: float = 60.0) -> bytes:
        """Everything until the server closes the connection (raises on timeout: it did not close)."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                return self.buffer
            self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


# One slot: a second request can only start once the first is gone, so "the next request was not kept
# waiting" is a fact about the engine, not about a clock. 8 new tokens a step: a long prompt's prefill
# spans a hundred steps, so a client can leave in the middle of it.
ONE_SLOT_ENGINE = dict(num_blocks=64, block_size=16, max_running=1, max_batched_tokens=8, max_model_len=1024)


@pytest.fixture(scope="module")
def one_slot_server(tiny_model_dir: Path):
    """A live tiny-model server with one running slot, for a whole test module."""
    live = start_live(tiny_model_dir, "one-slot", **ONE_SLOT_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


@pytest.fixture
def access_log(caplog):
    """The access-log records of this test (the server logs from its own thread)."""
    caplog.set_level(logging.INFO, logger="pagoda.access")
    return lambda: [r for r in caplog.records if r.name == "pagoda.access"]


