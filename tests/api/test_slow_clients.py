"""Slow clients on a live server: the request read deadline (408, then close) and the connection cap (503).

Real uvicorn on a port the kernel picks; the slow clients are raw sockets that trickle their requests at
their own pace (the only sleeps here are that pace); everything the server does is polled, with a bound.
"""

from __future__ import annotations

import json
import logging
import resource
import selectors
import socket
import statistics
import threading
import time

import httpx
import openai
import pytest

from pagoda.api.server import BackgroundServer
from pagoda.api.settings import ServeSettings
from tests.helpers import wait_for
from tests.server_fixtures import TINY_ENGINE, default_model_dir, start_server, tiny_model_dir  # noqa: F401

READ_TIMEOUT = 2.0  # the deadline of the module's server, seconds
# a slow client's seconds between two pieces of its request: not a divisor of READ_TIMEOUT, so that no piece is
# sent at the deadline itself (a piece that meets the server's close makes the kernel answer with a reset, which can
# discard the 408 before the client reads it)
PACE = 0.3
MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]


@pytest.fixture(scope="module")
def deadline_server(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, "slow", settings=ServeSettings(request_read_timeout=READ_TIMEOUT),
                        **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_errors():
    """uvicorn's and the app's error records (an exception in the app, a failed write); uvicorn's loggers do not
    propagate to the root, so the handler sits on them."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "pagoda")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield lambda: [r for r in handler.records if r.levelno >= logging.ERROR]
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


# -- raw sockets ----------------------------------------------------------------------------------------

def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _read_to_eof(sock: socket.socket, timeout: float = 15.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _trickle(sock: socket.socket, pieces: list[bytes]) -> bytes:
    """Send `pieces` one every PACE seconds until the server answers or closes; then everything it sent."""
    for piece in pieces:
        sock.settimeout(PACE)
        try:
            sock.recv(1, socket.MSG_PEEK)  # returns once the server answered or closed: stop sending, read it all
            break
        except TimeoutError:  # nothing yet: the client's next piece
            sock.sendall(piece)
    else:
        raise AssertionError(f"the server still waited after {len(pieces)} pieces, {len(pieces) * PACE:g} s")
    return _read_to_eof(sock)


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (it has a Content-Length), leaving the connection open."""
    sock.settimeout(15)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < len(data.partition(b"\r\n\r\n")[0]) + 4 + int(
            _parse(data)[1]["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def _parse(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the first response in `answer`, which must be whole."""
    head, _, rest = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, rest[:int(headers.get("content-length", len(rest)))]


def _assert_408(answer: bytes) -> None:
    status, headers, body = _parse(answer)
    assert status == 408 and headers["connection"] == "close", answer
    error = json.loads(body)["error"]  # OpenAI's error shape
    assert error["code"] == "request_timeout" and f"{READ_TIMEOUT:g} seconds" in error["message"], error


# -- the read deadline ----------------------------------------------------------------------------------

def test_a_client_that_trickles_its_headers_gets_408_and_is_closed(deadline_server):
    sock = _connect(deadline_server.url)
    start = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: slow\r\n")
    # one header line every PACE s: each line is progress, but the deadline counts from the first byte
    answer = _trickle(sock, [f"X-Line-{i}: {i}\r\n".encode() for i in range(int(4 * READ_TIMEOUT / PACE))])
    elapsed = time.monotonic() - start
    _assert_408(answer)  # and _read_to_eof saw the connection close
    assert READ_TIMEOUT - 0.1 < elapsed < 2 * READ_TIMEOUT, elapsed
    sock.close()


def test_a_client_that_trickles_its_body_gets_408_and_the_server_is_unharmed(deadline_server, server_errors):
    body = json.dumps({"model": "slow", "messages": MESSAGES, "max_tokens": 3}).encode()
    sock = _connect(deadline_server.url)
    start = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: slow\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    answer = _trickle(sock, [body[i:i + 4] for i in range(10, len(body), 4)])  # the headers are whole; the body crawls
    elapsed = time.monotonic() - start
    _assert_408(answer)
    assert READ_TIMEOUT - 0.1 < elapsed < 2 * READ_TIMEOUT, elapsed
    sock.close()
    deadline_server.assert_pool_whole()
    assert not server_errors(), [r.getMessage() for r in server_errors()]


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(deadline_server):
    sock = _connect(deadline_server.url)
    start = time.monotonic()
    assert _read_to_eof(sock) == b""  # nothing to answer: closed at the deadline, no 408
    assert READ_TIMEOUT - 0.1 < time.monotonic() - start < 2 * READ_TIMEOUT
    sock.close()


def test_a_pipelined_request_that_stops_half_way_gets_408_after_the_first_is_answered(deadline_server):
    sock = _connect(deadline_server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: slow\r\n\r\nGET /health HTTP/1.1\r\nHost: slow\r\n")
    answer = _read_to_eof(sock)
    status, _, body = _parse(answer)
    assert status == 200 and json.loads(body)["status"] == "ok"
    _assert_408(answer[answer.index(b"HTTP/1.1 408"):])
    sock.close()


def test_an_idle_keep_alive_connection_is_governed_by_keep_alive_not_the_deadline(deadline_server):
    sock = _connect(deadline_server.url)
    request = b"GET /health HTTP/1.1\r\nHost: slow\r\n\r\n"
    sock.sendall(request)
    assert _parse(_read_response(sock))[0] == 200
    # idle past the read deadline but within uvicorn's keep-alive (5 s): the connection is still served
    sock.settimeout(READ_TIMEOUT + 1)
    with pytest.raises(TimeoutError):
        sock.recv(1)  # nothing comes: no 408, no close
    sock.sendall(request)
    assert _parse(_read_response(sock))[0] == 200
    sock.close()


def test_a_stream_longer_than_the_deadline_and_ordinary_requests_are_untouched(deadline_server):
    client = deadline_server.openai()
    r = client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].message.content is not None
    engine = deadline_server.async_engine.engine
    healthy = engine.runner
    engine.runner = SlowRunner(healthy, 0.02)  # read by the loop thread at its next step: ~50 tokens a second
    try:
        start = time.monotonic()
        stream = client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=150, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True})
        chunks = list(stream)
        elapsed = time.monotonic() - start
    finally:
        engine.runner = healthy
    assert elapsed > 1.5 * READ_TIMEOUT, elapsed  # the stream outlived the deadline...
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    # ... and the connection it came on serves the next request (the client's pool reuses it)
    r = client.chat.completions.create(model="slow", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    deadline_server.assert_pool_whole()


class SlowRunner:
    """A runner whose every step takes `delay` seconds longer: a stream that lasts as long as the test wants."""

    def __init__(self, runner, delay):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple
        self.delay = delay

    def execute(self, batch):
        threading.Event().wait(self.delay)
        return self.runner.execute(batch)


# -- thousands of slow clients ---------------------------------------------------------------------------

HELD = 2000  # slow connections held at once (fewer where the file-descriptor limit is lower: see _held_count)
BULK_TIMEOUT = 8.0  # long enough to open them all and be served meanwhile on a 2-core machine


def _held_count() -> int:
    """HELD, or what the hard file-descriptor limit allows: this process holds both ends of each connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    count = HELD if limit == resource.RLIM_INFINITY else min(HELD, (limit - 512) // 2)
    if count < HELD:
        logging.getLogger(__name__).warning("RLIMIT_NOFILE %s: holding %d connections, not %d", limit, count, HELD)
    return count


@pytest.mark.slow
def test_thousands_of_slow_clients_hold_nothing_past_the_deadline(tiny_model_dir):  # noqa: F811
    count = _held_count()
    assert count >= 200, "the file-descriptor limit is too low for this test"
    live = start_server(tiny_model_dir, "bulk", settings=ServeSettings(request_read_timeout=BULK_TIMEOUT),
                        **TINY_ENGINE)
    held: list[socket.socket] = []
    selector = selectors.DefaultSelector()
    client = live.http()

    def health_latency() -> float:
        t = time.monotonic()
        r = client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        return time.monotonic() - t

    try:
        idle = [health_latency() for _ in range(10)]
        start = time.monotonic()
        for i in range(count):  # each sends half a request and then nothing
            sock = _connect(live.url)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: bulk\r\nX-Slow: %d\r\n" % i)
            sock.setblocking(False)
            held.append(sock)
            selector.register(sock, selectors.EVENT_READ)
        opened = time.monotonic() - start
        # while they are held, the server still answers: /health and a real completion through the SDK
        latencies = [health_latency() for _ in range(10)]
        reply = live.openai().chat.completions.create(model="bulk", messages=MESSAGES, max_tokens=8)
        assert reply.choices[0].message.content is not None
        served = time.monotonic() - start
        assert served < BULK_TIMEOUT, f"served after {served:.1f} s: the check ran past the deadline"
        assert not selector.select(0), "a slow connection was answered or closed before its deadline"
        # past the deadline every one of them is answered 408 and closed
        answers: dict[int, bytes] = {}
        closed = 0
        bound = time.monotonic() + BULK_TIMEOUT + 30
        while closed < count and time.monotonic() < bound:
            for key, _ in selector.select(1.0):
                sock = key.fileobj
                try:
                    chunk = sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    answers[sock.fileno()] = answers.get(sock.fileno(), b"") + chunk
                else:
                    selector.unregister(sock)
                    closed += 1
        elapsed = time.monotonic() - start
        assert closed == count, f"{count - closed} of {count} connections still open after {elapsed:.1f} s"
        assert sum(a.startswith(b"HTTP/1.1 408") for a in answers.values()) == count
        logging.getLogger(__name__).info(
            "%d slow connections: opened in %.2f s; /health median %.1f ms (idle: %.1f ms), max %.1f ms while held; "
            "all closed after %.1f s", count, opened, statistics.median(latencies) * 1e3,
            statistics.median(idle) * 1e3, max(latencies) * 1e3, elapsed)
        live.assert_pool_whole()
    finally:
        client.close()
        selector.close()
        for sock in held:
            sock.close()
        live.server.stop()


# -- the listening socket --------------------------------------------------------------------------------

def test_a_response_written_in_two_parts_is_not_held_back_by_nagle():
    """Accepted sockets get TCP_NODELAY (asyncio sets it only when the listening socket says IPPROTO_TCP):
    without it every response whose headers and body go out in two writes waited ~40 ms for a delayed ACK."""
    async def app(scope, receive, send):  # headers, then the body: two writes, as every Litestar response
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"{}"})

    with BackgroundServer(app) as live:
        sock = _connect(live.url)
        latencies = []
        for _ in range(20):
            start = time.monotonic()
            sock.sendall(b"GET / HTTP/1.1\r\nHost: nagle\r\n\r\n")
            assert _parse(_read_response(sock))[2] == b"{}"
            latencies.append(time.monotonic() - start)
        sock.close()
    assert statistics.median(latencies) < 0.02, latencies  # ~0.3 ms with TCP_NODELAY, 44 ms without


# -- the connection cap ---------------------------------------------------------------------------------

CAP = 20


def _status(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=30).status_code  # a connection of its own, closed afterwards


def _hold(url: str, n: int) -> list[socket.socket]:
    socks = [_connect(url) for _ in range(n)]
    for sock in socks:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: capped\r\n")  # half a request, then nothing
    return socks


def test_past_the_connection_cap_a_request_gets_503_until_connections_close(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, "capped", settings=ServeSettings(max_connections=CAP), **TINY_ENGINE)
    held: list[socket.socket] = []
    try:
        assert _status(live.url) == 200
        held = _hold(live.url, 30)
        wait_for(lambda: _status(live.url) == 503, "503 once the server has accepted the 30 held connections",
                 timeout=30)
        r = httpx.get(f"{live.url}/health", timeout=30)
        assert r.status_code == 503 and r.headers["connection"] == "close"
        with pytest.raises(openai.InternalServerError) as caught:
            live.openai().chat.completions.create(model="capped", messages=MESSAGES, max_tokens=3)
        assert caught.value.status_code == 503
        # exactly CAP are served: CAP - 1 held plus the request's own ...
        for sock in held[CAP - 1:]:
            sock.close()
        held = held[:CAP - 1]
        wait_for(lambda: _status(live.url) == 200, "a request served beside CAP - 1 held connections", timeout=30)
        # ... and one more held connection refuses it again
        held += _hold(live.url, 1)
        wait_for(lambda: _status(live.url) == 503, "503 beside CAP held connections", timeout=30)
        for sock in held:
            sock.close()
        held = []
        wait_for(lambda: _status(live.url) == 200, "requests served again once the held connections closed",
                 timeout=30)
        reply = live.openai().chat.completions.create(model="capped", messages=MESSAGES, max_tokens=3)
        assert reply.choices[0].finish_reason in ("length", "stop")
        live.assert_pool_whole()
    finally:
        for sock in held:
            sock.close()
        live.server.stop()
