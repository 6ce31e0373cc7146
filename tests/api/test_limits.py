"""Limits and backpressure on a live server: 413, 431, 429 with Retry-After, /health between steps, a dead loop."""

import threading

import anthropic
import httpx
import openai
import pytest

from pagoda.api.settings import ServeSettings
from tests.helpers import metric_values, wait_for
from tests.server_fixtures import TINY_ENGINE, default_model_dir, start_server, tiny_model_dir  # noqa: F401

MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]
CHAT = {"model": "limited", "max_tokens": 3, "messages": MESSAGES}
MAX_BODY, MAX_HEADERS = 4096, 2048


@pytest.fixture(scope="module")
def limited(tiny_model_dir):  # noqa: F811
    settings = ServeSettings(max_body_bytes=MAX_BODY, max_header_bytes=MAX_HEADERS, health_timeout=0.5)
    live = start_server(tiny_model_dir, "limited", settings=settings,
                        **{**TINY_ENGINE, "max_running": 1, "max_waiting": 2})
    try:
        yield live
    finally:
        live.server.stop()


class BlockedRunner:
    """A runner whose next step waits until `release` is set: a step that takes as long as the test wants."""

    def __init__(self, runner):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple
        self.entered = threading.Event()
        self.release = threading.Event()

    def execute(self, batch):
        self.entered.set()
        assert self.release.wait(60), "the test never released the step"
        return self.runner.execute(batch)


class SlowRunner:
    """A runner whose every step takes `delay` seconds longer: a slow model, so that requests pile up."""

    def __init__(self, runner, delay):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple
        self.delay = delay

    def execute(self, batch):
        threading.Event().wait(self.delay)
        return self.runner.execute(batch)


def _block_steps(live):
    engine = live.async_engine.engine
    blocked = BlockedRunner(engine.runner)
    engine.runner = blocked  # read by the loop thread at its next step

    def restore():
        engine.runner = blocked.runner
        blocked.release.set()

    return blocked, restore


def test_a_body_over_the_limit_is_413_in_each_protocols_shape(limited):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (2 * MAX_BODY)}]}
    r = httpx.post(f"{limited.url}/v1/chat/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert str(MAX_BODY) in r.json()["error"]["message"]
    r = httpx.post(f"{limited.url}/v1/messages", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as caught:
        limited.openai().chat.completions.create(model="limited", messages=big["messages"], max_tokens=3)
    assert caught.value.status_code == 413
    # a chunked body (no Content-Length) is stopped by the app while it streams in
    def chunks():
        yield httpx.Request("POST", "/", json=big).content

    r = httpx.post(f"{limited.url}/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert metric_values(limited.url)["pagoda_requests_rejected_total{reason=body_too_large}"] >= 3
    small = httpx.post(f"{limited.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert small.status_code == 200


def test_headers_over_the_limit_are_431_in_the_routes_shape(limited):
    fat = {"x-padding": "y" * (MAX_HEADERS + 100)}
    r = httpx.post(f"{limited.url}/v1/chat/completions", json=CHAT, headers=fat, timeout=60)
    assert r.status_code == 431 and r.json()["error"]["type"] == "invalid_request_error"
    assert str(MAX_HEADERS) in r.json()["error"]["message"]
    r = httpx.post(f"{limited.url}/v1/messages", json=CHAT, headers=fat, timeout=60)
    assert r.status_code == 431 and r.json()["type"] == "error"
    assert metric_values(limited.url)["pagoda_requests_rejected_total{reason=headers_too_large}"] >= 2
    assert httpx.post(f"{limited.url}/v1/messages", json=CHAT, timeout=60).status_code == 200


def test_a_full_queue_refuses_at_once_with_429_and_retry_after(limited):
    engine = limited.async_engine.engine
    healthy = engine.runner
    engine.runner = SlowRunner(healthy, 0.05)  # max_running = 1: the first request holds the only slot
    client = httpx.Client(base_url=limited.url, timeout=60)

    def ask(prompt, max_tokens):
        threading.Thread(target=client.post, args=("/v1/completions",), daemon=True,
                         kwargs={"json": {"model": "limited", "prompt": prompt, "max_tokens": max_tokens}}).start()

    try:
        ask("the long one", 400)
        wait_for(lambda: limited.async_engine.latest_stats(60)["running"] == 1, "the first request running")
        ask("wait 0", 2)
        ask("wait 1", 2)
        wait_for(lambda: limited.async_engine.latest_stats(60)["waiting"] == 2, "two requests waiting (the limit)")
        r = client.post("/v1/completions", json={"model": "limited", "prompt": "three", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        r = client.post("/v1/messages", json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and "retry-after" in r.headers
        with pytest.raises(anthropic.RateLimitError):
            limited.anthropic().messages.create(model="limited", max_tokens=3, messages=MESSAGES)
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            assert s.status_code == 429
        assert limited.async_engine.latest_stats(60)["running"] == 1  # the refusals came while the queue was full
    finally:
        engine.runner = healthy
    assert metric_values(limited.url)["pagoda_requests_rejected_total{reason=queue_full}"] >= 4
    limited.assert_pool_whole()


def test_health_answers_while_a_step_runs_and_503_once_it_is_stuck(limited):
    blocked, restore = _block_steps(limited)
    try:
        threading.Thread(target=httpx.post, args=(f"{limited.url}/v1/completions",), daemon=True,
                         kwargs={"json": {"model": "limited", "prompt": "x", "max_tokens": 2}, "timeout": 60}).start()
        assert blocked.entered.wait(60)
        r = httpx.get(f"{limited.url}/health", timeout=5)  # answered from the snapshot, not after the step
        assert not blocked.release.is_set() and r.status_code in (200, 503)
        # health_timeout is 0.5 s: a step blocked longer than that is a loop that cannot serve
        wait_for(lambda: httpx.get(f"{limited.url}/health", timeout=5).status_code == 503, "/health says stuck")
    finally:
        restore()
    wait_for(lambda: httpx.get(f"{limited.url}/health", timeout=5).status_code == 200, "/health recovers")
    limited.assert_pool_whole()


def test_a_dead_engine_loop_is_503_at_once_on_health_and_generation(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, "doomed", **TINY_ENGINE)
    try:
        live.async_engine.stop()
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 503
        r = httpx.post(f"{live.url}/v1/chat/completions", json=CHAT, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["type"]
        r = httpx.post(f"{live.url}/v1/messages", json=CHAT, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        assert metric_values(live.url)["pagoda_requests_rejected_total{reason=engine_unavailable}"] == 2
    finally:
        live.server.stop()
