"""SIGTERM on a real `python -m pagoda serve`: drain (503s, /health "draining"), finish or abort, exit 0."""

import json
import signal
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from tests.helpers import reap, wait_for
from tests.server_fixtures import default_model_dir, tiny_model_dir  # noqa: F401

PROMPT = "Once upon a time, in a pagoda by the river,"


def _serve(model_dir, shutdown_timeout):
    cmd = [sys.executable, "-m", "pagoda", "serve", "--model", str(model_dir), "--port", "0", "--num-blocks", "64",
           "--max-model-len", "1024", "--device", "cpu", "--log-level", "warning",
           "--shutdown-timeout", str(shutdown_timeout), "--served-model-name", "m"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    if not (line and line[0].startswith("pagoda serving")):
        proc.kill()
        pytest.fail(f"the server did not start: {proc.communicate(timeout=30)[1]}")
    return proc, line[0].split(" at ")[1].strip()


def _events(lines):
    """The JSON events of an OpenAI SSE stream, up to [DONE]."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def _draining(url):
    r = httpx.get(f"{url}/health", timeout=10)
    return r.status_code == 503 and r.json()["status"] == "draining"


@pytest.mark.slow
def test_sigterm_drains_the_stream_in_flight_refuses_new_work_and_exits_0(tiny_model_dir):  # noqa: F811
    proc, url = _serve(tiny_model_dir, shutdown_timeout=60)
    try:
        assert psutil.Process(proc.pid).children(recursive=True) == []
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
            events = _events(stream.iter_lines())
            first = next(events)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: _draining(url), "/health says draining")
            refused = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 503 and "retry-after" in refused.headers
            assert refused.json()["error"]["message"].startswith("the server is shutting down")
            rest = list(events)
        choices = [c for e in [first, *rest] for c in e.get("choices", [])]
        assert choices[-1]["finish_reason"] == "length"  # the request in flight ran to its end
        assert len("".join(c["text"] for c in choices)) > 0
        assert proc.wait(60) == 0
    finally:
        reap(proc)


@pytest.mark.slow
def test_sigterm_aborts_what_outlives_the_shutdown_timeout_and_exits_0(tiny_model_dir):  # noqa: F811
    proc, url = _serve(tiny_model_dir, shutdown_timeout=0.5)
    try:
        unary = []
        long = {"model": "m", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        asker = threading.Thread(target=lambda: unary.append(httpx.post(f"{url}/v1/completions", json=long,
                                                                        timeout=120)), daemon=True)
        asker.start()
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=120) as stream:
            events = _events(stream.iter_lines())
            next(events)
            proc.send_signal(signal.SIGTERM)
            rest = list(events)
        assert "error" in rest[-1], rest[-1]  # the stream ends with the protocol's error event
        asker.join(60)
        assert unary and unary[0].status_code == 503, unary
        assert proc.wait(60) == 0
    finally:
        reap(proc)
