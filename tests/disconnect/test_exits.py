"""Every way out of a generation request ends its engine request, counted in engine steps.

The app is called as an ASGI callable with a scripted connection, because
some exits cannot be produced over a uvicorn socket: a send that raises
OSError (the ASGI spec's closed connection; uvicorn returns silently
instead), a send that raises something else (a bug), the handler cancelled
(shutdown). The real-socket versions of the others are in
test_disconnect_paths.py and test_disconnect_phases.py.

Each step of the fake model waits for a permit, so a test knows exactly how
many tokens were made before the exit (k) and can require the abort to land
at the next step: at most k + 1 tokens in all.
"""

import asyncio
import threading

import pytest

from pagoda.api.app import create_app
from pagoda.api.settings import ServeSettings
from pagoda.core.async_engine import AsyncEngine
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from pagoda.plugins import hookimpl
from pagoda.plugins.manager import load_plugins
from pagoda.plugins.protocol import ApiError, Endpoint, EngineRequest, ErrorShape, Event
from tests.helpers import FakeConnection, await_condition, fake_engine

K = 3  # steps allowed before the exit


class PlainErrors(ErrorShape):
    def render_error(self, error: ApiError):
        return {"error": error.message}


class Count(Endpoint):
    """A protocol with one event per generated token, whatever its text."""

    name = "count"
    path = "/count"
    body_type = dict
    errors = PlainErrors()

    def prepare(self, body, ctx):
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True)
        return EngineRequest(body["prompt"], params, stream=body["stream"])

    def render(self, call, completion):
        return {"tokens": completion.num_output_tokens}

    async def render_stream(self, call, outputs):
        async for out in outputs:
            yield Event({"n": out.num_output_tokens})
            if out.num_output_tokens == call.body.get("stop_after"):
                return  # a renderer that stops early, leaving the outputs unconsumed


class CountPlugin:
    @hookimpl
    def pagoda_register_protocols(self, register):
        register(Count())


class GatedRunner:
    """Each step waits for a permit from the test."""

    def __init__(self, runner):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple
        self.allowed = threading.Semaphore(0)

    def execute(self, batch):
        assert self.allowed.acquire(timeout=30), "the test never allowed this step"
        return self.runner.execute(batch)

    def open(self):
        for _ in range(10_000):
            self.allowed.release()


@pytest.fixture
def server():
    engine = fake_engine(num_blocks=64, block_size=4, max_model_len=256)
    runner = GatedRunner(engine.runner)
    engine.runner = runner
    async_engine = AsyncEngine(engine)
    async_engine.start()
    pm = load_plugins({"PAGODA_PLUGINS": "none"})
    pm.register(CountPlugin(), name="count")
    app = create_app(async_engine, None, pm, ServeSettings(send_stall_timeout=0.2))
    yield app, async_engine, runner
    runner.open()
    async_engine.stop()


def scope():
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/count", "raw_path": b"/count", "root_path": "",
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80), "state": {}}


async def the_request(engine):
    await await_condition(lambda: engine.requests, "the request to reach the engine")
    (request,) = engine.requests.values()
    return request


async def make_k_tokens(async_engine, runner, request, conn, stream):
    for _ in range(K):
        runner.allowed.release()
    await await_condition(lambda: request.num_output_tokens >= K and (not stream or conn.events() >= K),
                          f"{K} tokens made and written")


def run_exit(server, stream, exit_, conn_options=None, **body):
    """Start a request for 200 tokens, let K steps run, take `exit_`, then let the engine run freely."""
    app, async_engine, runner = server

    async def main():
        conn = FakeConnection.with_json({"prompt": [1, 2, 3], "max_tokens": 200, "stream": stream, **body},
                                        bodies_only=True, armed=False, **(conn_options or {}))
        call = asyncio.ensure_future(app(scope(), conn.receive, conn.send))
        request = await the_request(async_engine.engine)
        await make_k_tokens(async_engine, runner, request, conn, stream)
        made = await exit_(call, conn, runner) or K  # tokens made before the exit
        runner.open()
        await async_engine.wait_until_idle()
        await async_engine.audit()
        stats = await async_engine.stats()
        return request, conn, made, stats

    request, conn, made, stats = asyncio.run(asyncio.wait_for(main(), 60))
    assert request.finish_reason is FinishReason.ABORT
    assert made <= request.num_output_tokens <= made + 1  # the abort landed at the next step
    assert stats["aborted_total"] == 1 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return conn


async def client_leaves(call, conn, runner):
    conn.leave()
    await call


async def next_write_fails(call, conn, runner, expect=None):
    """Arm the connection and allow one more step: its event is the write that fails."""
    conn.arm()
    runner.allowed.release()
    if expect is None:
        await call
    else:
        with pytest.raises(expect):
            await call
    return K + 1


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_client_that_leaves(server, stream):
    conn = run_exit(server, stream, client_leaves)
    assert conn.status == (200 if stream else 499)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_handler_cancelled(server, stream):
    async def cancel(call, conn, runner):
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    run_exit(server, stream, cancel)


def test_a_write_that_raises_oserror(server):
    conn = run_exit(server, True, next_write_fails, {"fail_with": BrokenPipeError()})
    assert conn.status == 200 and conn.messages[-1]["more_body"]  # never completed


def test_a_write_that_raises_something_else(server):
    async def bug(call, conn, runner):  # it propagates, and the request still ends
        return await next_write_fails(call, conn, runner, expect=Exception)

    run_exit(server, True, bug, {"fail_with": RuntimeError("unexpected ASGI message")})


def test_a_write_that_stalls(server):
    conn = run_exit(server, True, next_write_fails, {"hang_from": 0})  # returns after the 0.2 s deadline
    assert conn.messages[-1]["more_body"]  # never completed: uvicorn closes such a connection


def test_a_renderer_that_stops_early(server):
    async def response_ends(call, conn, runner):
        await call

    conn = run_exit(server, True, response_ends, stop_after=K)
    assert conn.status == 200 and not conn.messages[-1]["more_body"]  # a complete response, and no work left
