"""The server around the protocols: health, metrics, the API key, the access log, disconnects, failures."""

import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.api.app import create_app
from pagoda.api.server import BackgroundServer
from pagoda.api.settings import ServeSettings
from pagoda.core.async_engine import AsyncEngine
from pagoda.plugins.manager import load_plugins
from tests.helpers import fake_engine, metric_values, wait_for
from tests.server_fixtures import default_model_dir, start_server, tiny_model_dir, tiny_server  # noqa: F401

MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]
HEALTH_KEYS = {"status", "running", "waiting", "kv_blocks_total", "kv_blocks_free", "preemptions_total",
               "recomputed_tokens_total", "aborted_total", "generated_tokens_total", "requests_total"}


# -- health and metrics ----------------------------------------------------------------------------
def test_health_is_answered_by_the_engine_loop(tiny_server):
    before = tiny_server.health()
    assert HEALTH_KEYS <= set(before) and before["status"] == "ok"
    tiny_server.openai().chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, temperature=0)
    after = tiny_server.assert_pool_whole()
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["generated_tokens_total"] == before["generated_tokens_total"] + 5


def test_metrics_cover_latency_tokens_queues_and_kv(tiny_server):
    client = tiny_server.openai()
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, temperature=0)
    list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, temperature=0, stream=True))
    values = metric_values(tiny_server.url)
    assert values["pagoda_time_to_first_token_seconds_count"] >= 2
    assert values["pagoda_inter_token_latency_seconds_count"] >= 10
    assert values["pagoda_e2e_request_latency_seconds_count"] >= 2
    assert values["pagoda_generation_tokens_total"] >= 12 and values["pagoda_prompt_tokens_total"] > 0
    assert values["pagoda_requests_finished_total{reason=length}"] >= 2
    assert values["pagoda_requests_running"] == 0 and values["pagoda_requests_waiting"] == 0
    assert values["pagoda_kv_blocks_total"] == 64 and values["pagoda_kv_cache_usage_ratio"] == 0
    assert "pagoda_preemptions_total" in values and "pagoda_recomputed_tokens_total" in values


def test_health_and_metrics_say_so_when_the_engine_cannot_serve(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, "doomed", num_blocks=16, max_model_len=256)
    try:
        live.async_engine.stop()
        r = httpx.get(f"{live.url}/health", timeout=60)
        assert r.status_code == 503 and r.json()["status"] != "ok"
        assert httpx.get(f"{live.url}/metrics", timeout=60).status_code == 200
        with pytest.raises(openai.InternalServerError) as info:
            live.openai().chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
        assert info.value.status_code == 503 and "engine" in info.value.message
    finally:
        live.server.stop()


# -- the API key -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, "keyed", api_key="sekret", num_blocks=16, max_model_len=256)
    yield live
    live.server.stop()


def test_a_wrong_or_missing_key_is_401_in_each_protocols_shape(keyed_server):
    url = keyed_server.url
    for wrong in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, headers=wrong)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/v1/messages", json={}, headers={**wrong, "anthropic-version": "2023-06-01"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"  # before body validation
        assert httpx.get(f"{url}/v1/models", headers=wrong).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        keyed_server.openai(api_key="nope").responses.create(model="m", input="hi", max_output_tokens=2)
    with pytest.raises(anthropic.AuthenticationError):
        keyed_server.anthropic(api_key="nope").messages.create(model="m", max_tokens=2, messages=MESSAGES)
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200


def test_the_right_key_passes_with_either_header(keyed_server):
    reply = keyed_server.openai().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert reply.usage.completion_tokens == 2
    message = keyed_server.anthropic().messages.create(model="m", max_tokens=2, messages=MESSAGES)
    assert message.usage.output_tokens == 2
    assert [m.id for m in keyed_server.openai().models.list().data] == ["keyed"]


# -- routes outside the protocols ------------------------------------------------------------------
def test_unknown_routes_answer_in_the_default_shape_whatever_the_headers(tiny_server):
    r = httpx.get(f"{tiny_server.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{tiny_server.url}/v1/nothing-here", headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"  # no header picks the shape
    assert httpx.get(f"{tiny_server.url}/v1/chat/completions").status_code == 405


def test_the_model_card_holds_each_familys_fields_and_both_sdks_read_it(tiny_server):
    name = tiny_server.model_name
    card = httpx.get(f"{tiny_server.url}/v1/models/{name}").json()
    assert {"id", "object", "created", "owned_by"} <= set(card)  # OpenAI's, from openai_common
    assert {"type", "display_name", "created_at"} <= set(card)  # Anthropic's, from anthropic_messages
    assert card["id"] == name and card["max_model_len"] == 1024  # pagoda's own, from the models plugin
    assert httpx.get(f"{tiny_server.url}/v1/models").json()["data"] == [card]
    assert tiny_server.openai().models.retrieve(name).owned_by == "pagoda"
    model = tiny_server.anthropic().models.retrieve(name)
    assert (model.id, model.display_name, model.created_at.timestamp()) == (name, name, card["created"])
    assert [m.id for m in tiny_server.anthropic().models.list().data] == [name]
    # The route's owner is OpenAI: its errors are OpenAI's whatever the client sends.
    r = httpx.get(f"{tiny_server.url}/v1/models/nope", headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and name in r.json()["error"]["message"]


# -- access log and disconnects --------------------------------------------------------------------
@pytest.fixture
def access_log(caplog):
    caplog.set_level(logging.INFO, logger="pagoda.access")
    return lambda: [r for r in caplog.records if r.name == "pagoda.access"]


def test_every_request_leaves_one_access_log_line(tiny_server, access_log):
    tiny_server.openai().chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=0)
    httpx.post(f"{tiny_server.url}/v1/messages", json={"model": "m"})
    # (A line is written just after its response went out, so lines of earlier tests may still arrive.)
    def lines(path):
        return [r for r in access_log() if r.path == path]

    wait_for(lambda: lines("/v1/chat/completions") and lines("/v1/messages"), "both access-log lines")
    (ok,), (bad,) = lines("/v1/chat/completions"), lines("/v1/messages")
    assert (ok.method, ok.path, ok.status, ok.completion_tokens) == ("POST", "/v1/chat/completions", 200, 4)
    assert ok.prompt_tokens > 0 and ok.duration_ms > 0
    assert (bad.path, bad.status) == ("/v1/messages", 400)
    assert '"POST /v1/chat/completions" 200' in ok.getMessage()


def _raw_post(url, path, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def test_a_unary_client_that_leaves_is_aborted_and_logged_499(tiny_server, access_log):
    before = tiny_server.assert_pool_whole()
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900, "temperature": 0}'
    sock = _raw_post(tiny_server.url, "/v1/chat/completions", body)
    wait_for(lambda: tiny_server.health()["generated_tokens_total"] > before["generated_tokens_total"] + 3, "decoding")
    sock.close()
    after = tiny_server.assert_pool_whole()
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 900  # stopped early
    wait_for(lambda: any(r.status == 499 for r in access_log()), "the 499 line")
    line = next(r for r in access_log() if r.status == 499)
    assert line.path == "/v1/chat/completions" and 0 < line.completion_tokens < 900
    assert metric_values(tiny_server.url)["pagoda_requests_aborted_total{reason=client_disconnect}"] >= 1


def test_a_stream_client_that_leaves_is_aborted_and_logged_499(tiny_server, access_log):
    before = tiny_server.assert_pool_whole()
    with httpx.stream("POST", f"{tiny_server.url}/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 900, "stream": True, "temperature": 0, "messages": MESSAGES,
    }) as response:
        lines = response.iter_lines()
        deltas = 0
        while deltas < 3:
            deltas += next(lines).startswith("event: content_block_delta")
    after = tiny_server.assert_pool_whole()
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 900
    wait_for(lambda: any(r.status == 499 and r.path == "/v1/messages" for r in access_log()), "the 499 line")


# -- a model step that fails ------------------------------------------------------------------------
class FailingRunner:
    def __init__(self, runner):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.row_multiple = runner.row_multiple

    def execute(self, batch):
        raise RuntimeError("device lost")


def _fail_model(live):
    engine = live.async_engine.engine
    healthy = engine.runner
    engine.runner = FailingRunner(healthy)  # read by the loop thread at its next step
    return lambda: setattr(engine, "runner", healthy)


def test_a_failed_step_is_an_error_body_or_an_in_stream_error_and_the_server_recovers(tiny_server):
    restore = _fail_model(tiny_server)
    try:
        with pytest.raises(openai.InternalServerError, match="device lost"):
            tiny_server.openai().chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
        r = httpx.post(f"{tiny_server.url}/v1/messages", json={"model": "m", "max_tokens": 3, "messages": MESSAGES})
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        assert r.headers["x-should-retry"] == "false"
    finally:
        restore()
    tiny_server.assert_pool_whole()


def test_a_step_failing_mid_stream_sends_the_protocols_error_event(tiny_server):
    client = tiny_server.openai()
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=200, temperature=0, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    restore = _fail_model(tiny_server)
    try:
        with pytest.raises(openai.APIError, match="device lost"):
            for _ in stream:
                pass
    finally:
        restore()
    with tiny_server.anthropic().messages.stream(model="m", max_tokens=200, messages=MESSAGES) as s:
        pieces = s.text_stream
        next(pieces)
        restore = _fail_model(tiny_server)
        try:
            with pytest.raises(anthropic.APIStatusError, match="device lost"):
                list(pieces)
        finally:
            restore()
    tiny_server.assert_pool_whole()


# -- crowd with preemption ---------------------------------------------------------------------------
def test_a_crowd_that_forces_preemption_gets_the_same_answers_as_alone(tiny_model_dir):  # noqa: F811
    # 8 blocks of 16 tokens; each request needs ~5 blocks at its end, three run at once: someone is preempted.
    live = start_server(tiny_model_dir, "crowd", num_blocks=8, block_size=16, max_running=3, max_batched_tokens=64,
                        max_model_len=128)
    try:
        client = live.openai()
        prompts = [f"Story number {i} about a pagoda" for i in range(3)]

        def ask(prompt):
            return client.completions.create(model="m", prompt=prompt, max_tokens=60, temperature=0).choices[0].text

        alone = [ask(p) for p in prompts]
        assert live.health()["preemptions_total"] == 0
        with ThreadPoolExecutor(3) as pool:
            crowd = list(pool.map(ask, prompts))
        stats = live.assert_pool_whole()
        assert stats["preemptions_total"] > 0 and stats["recomputed_tokens_total"] > 0  # the hard case happened
        assert crowd == alone
    finally:
        live.server.stop()


# -- start-up ----------------------------------------------------------------------------------------
def test_a_server_whose_start_up_fails_says_so():
    class BrokenEngine(AsyncEngine):
        def start(self):
            raise RuntimeError("no device")

    app = create_app(BrokenEngine(fake_engine()), None, load_plugins({"PAGODA_PLUGINS": "none"}), ServeSettings())
    server = BackgroundServer(app)
    with pytest.raises(RuntimeError, match="failed to start"):
        server.start(timeout=60)
    assert not server.is_alive


def test_an_unknown_disconnect_policy_is_refused():
    with pytest.raises(ValueError, match="disconnect_policy 'linger' is not registered"):
        create_app(AsyncEngine(fake_engine()), None, load_plugins({"PAGODA_PLUGINS": "none"}),
                   ServeSettings(disconnect_policy="linger"))


@pytest.mark.slow
def test_pagoda_serve_prints_its_url_and_serves(tiny_model_dir):  # noqa: F811
    cmd = [sys.executable, "-m", "pagoda", "serve", "--model", str(tiny_model_dir), "--port", "0", "--num-blocks", "16",
           "--max-model-len", "256", "--served-model-name", "cli", "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _readline_within(proc, 120)
        assert line.startswith("pagoda serving 'cli' at http://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        assert not url.endswith(":0")
        assert httpx.get(f"{url}/health", timeout=60).json()["status"] == "ok"
        assert httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"] == "cli"
    finally:
        proc.send_signal(2)
        proc.wait(60)
    assert proc.returncode == 0, proc.stderr.read()


def _readline_within(proc, timeout):
    result = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert result and result[0], f"no URL printed; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return result[0]
