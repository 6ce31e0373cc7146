"""Tenants served: keys from a keys file name tenants, the logs and /metrics name them (never a key), their
prefix caches stay apart, their limits answer 429 with Retry-After in each protocol's shape while others are
served, `priority` and `weight` reach the engine, and the file is re-read on SIGHUP (a bad one refused)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import signal
import subprocess
import sys
import threading

import anthropic
import httpx
import openai
import pytest

from pagoda.api.settings import ServeSettings
from tests.helpers import metric_values, reap, wait_for
from tests.server_fixtures import TINY_ENGINE, start_server, tiny_model_dir  # noqa: F401  (a fixture)

KEYS = {"team-a": "key-a-7f3e9c", "team-b": "key-b-51d0aa", "tight": "key-t-c4e2b8", "metered": "key-m-0b9d61"}
LONG = " ".join(f"Fact {i}: the pagoda on hill {i} has {i + 3} storeys and a bell." for i in range(12))
MESSAGES = [{"role": "user", "content": "Say hi."}]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_keys(path, **extra_tenants: str) -> None:
    tenants = [{"name": "team-a", "key_sha256": sha(KEYS["team-a"]), "priority": 5, "weight": 2},
               {"name": "team-b", "key_sha256": sha(KEYS["team-b"])},
               {"name": "tight", "key_sha256": sha(KEYS["tight"]), "max_concurrent": 1},
               {"name": "metered", "key_sha256": sha(KEYS["metered"]), "requests_per_minute": 2}]
    tenants += [{"name": name, "key_sha256": sha(key)} for name, key in extra_tenants.items()]
    path.write_text(json.dumps({"tenants": tenants}))


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(path)
    return path


@pytest.fixture(scope="module")
def server(tiny_model_dir, keys_path):  # noqa: F811
    live = start_server(tiny_model_dir, "tenanted", settings=ServeSettings(api_keys_file=str(keys_path)),
                        **TINY_ENGINE)
    yield live
    live.server.stop()


@pytest.fixture
def access_log(caplog):
    caplog.set_level(logging.INFO, logger="pagoda.access")
    return lambda: "\n".join(r.getMessage() + " " + str(getattr(r, "tenant", "")) for r in caplog.records
                             if r.name == "pagoda.access")


def test_two_keys_are_two_tenants_named_in_the_log_and_metrics_never_by_key(server, access_log):
    for name in ("team-a", "team-b"):
        reply = server.openai(api_key=KEYS[name]).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert reply.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="key-a-7f3e9").chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    with pytest.raises(anthropic.AuthenticationError):
        server.anthropic(api_key="nope").messages.create(model="m", max_tokens=2, messages=MESSAGES)
    log = access_log()
    assert "tenant=team-a" in log and "tenant=team-b" in log
    metrics = httpx.get(f"{server.url}/metrics", timeout=60).text
    values = metric_values(server.url)
    assert values['pagoda_tenant_requests_total{tenant=team-a}'] >= 1
    assert values['pagoda_tenant_requests_total{tenant=team-b}'] >= 1
    assert values['pagoda_tenant_tokens_total{kind=completion,tenant=team-b}'] >= 2
    for key in KEYS.values():
        for text in (log, metrics):
            assert key not in text and sha(key) not in text


def test_a_tenants_prefix_cache_is_its_own(server):
    a, b = server.openai(api_key=KEYS["team-a"]), server.openai(api_key=KEYS["team-b"])
    prompt = "Isolation. " + LONG
    first = a.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    other = b.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    again = a.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # the same prompt, another tenant: nothing shared
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].text == other.choices[0].text == again.choices[0].text


def _in_flight(server, tenant: str) -> float:
    return metric_values(server.url).get(f"pagoda_tenant_requests_in_flight{{tenant={tenant}}}", 0.0)


def test_max_concurrent_is_429_with_retry_after_in_both_shapes_while_others_are_served(server):
    tight = server.openai(api_key=KEYS["tight"])
    stream = tight.completions.create(model="m", prompt="Count.", max_tokens=900, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # admitted and generating: its one slot is taken
        with pytest.raises(openai.RateLimitError) as info:
            tight.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "rate_limit_exceeded" and "max_concurrent" in info.value.message
        with pytest.raises(anthropic.RateLimitError) as info:
            server.anthropic(api_key=KEYS["tight"]).messages.create(model="m", max_tokens=2, messages=MESSAGES)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "rate_limit_error"
        reply = server.openai(api_key=KEYS["team-b"]).chat.completions.create(model="m", messages=MESSAGES,
                                                                               max_tokens=2)
        assert reply.usage.completion_tokens == 2  # another tenant is untouched
    finally:
        stream.close()
    wait_for(lambda: _in_flight(server, "tight") == 0, "the closed stream to leave flight")
    assert tight.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2
    assert metric_values(server.url)["pagoda_tenant_rejected_total{reason=max_concurrent,tenant=tight}"] == 2


def test_requests_per_minute_is_429_with_retry_after_in_both_shapes(server):
    metered = server.openai(api_key=KEYS["metered"])
    for _ in range(2):
        metered.completions.create(model="m", prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        metered.completions.create(model="m", prompt="hi", max_tokens=1)
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 61 and "requests_per_minute" in info.value.message
    with pytest.raises(anthropic.RateLimitError) as info:
        server.anthropic(api_key=KEYS["metered"]).messages.create(model="m", max_tokens=2, messages=MESSAGES)
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 61
    assert server.openai(api_key=KEYS["team-b"]).completions.create(model="m", prompt="hi", max_tokens=1).choices


def test_priority_and_weight_reach_the_engine(server, monkeypatch):
    engine = server.async_engine.engine
    seen = []
    add_request = engine.add_request

    def spy(*args, **kwargs):
        seen.append((kwargs.get("priority"), kwargs.get("weight")))
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    a = server.openai(api_key=KEYS["team-a"])
    a.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)  # the tenant's priority from the file
    a.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1, extra_body={"priority": -1})
    server.anthropic(api_key=KEYS["team-b"]).messages.create(model="m", max_tokens=1, messages=MESSAGES,
                                                              extra_body={"priority": 3})
    assert seen == [(5, 2.0), (-1, 2.0), (3, 1.0)]
    with pytest.raises(openai.BadRequestError) as info:
        a.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1, extra_body={"priority": "high"})
    assert info.value.body["param"] == "priority"


def test_a_reload_adds_a_key_and_a_bad_file_keeps_the_old_keys(server, keys_path, caplog):
    tenants = server.server.app.state.services.tenants
    new = server.openai(api_key="key-n-93ab10")
    with pytest.raises(openai.AuthenticationError):
        new.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    original = keys_path.read_text()
    try:
        write_keys(keys_path, newcomer="key-n-93ab10")
        assert tenants.reload()
        assert new.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1).usage.completion_tokens == 1
        keys_path.write_text('{"tenants": [\n  {"name": "x",\n   "key_sha256": 7}\n]}')
        with caplog.at_level(logging.ERROR, logger="pagoda.api"):
            assert not tenants.reload()
        assert "tenants[0].key_sha256" in caplog.text
        assert new.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1).usage.completion_tokens == 1
    finally:
        keys_path.write_text(original)
        tenants.reload()


# -- `pagoda serve --api-keys-file` ------------------------------------------------------------------------------
def _serve_command(model_dir, keys_file) -> list[str]:
    return [sys.executable, "-m", "pagoda", "serve", "--model", str(model_dir), "--port", "0", "--num-blocks", "64",
            "--max-model-len", "512", "--device", "cpu", "--log-level", "warning", "--served-model-name", "m",
            "--api-keys-file", str(keys_file)]


def test_a_malformed_keys_file_is_refused_at_start_up_naming_line_and_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"tenants": [\n  {"name": "a",\n   "key_sha256": }\n]}')
    done = subprocess.run(_serve_command("/nonexistent-model", bad), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "line 3" in done.stderr and str(bad) in done.stderr
    bad.write_text(json.dumps({"tenants": [{"name": "a", "key_sha256": sha("k"), "weight": -1}]}))
    done = subprocess.run(_serve_command("/nonexistent-model", bad), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tenants[0].weight" in done.stderr


@pytest.mark.slow
def test_sighup_rereads_the_keys_file_without_dropping_a_stream(tiny_model_dir, tmp_path):  # noqa: F811
    keys = tmp_path / "keys.json"
    write_keys(keys)
    proc = subprocess.Popen(_serve_command(tiny_model_dir, keys), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        assert line and line[0].startswith("pagoda serving"), proc.poll()
        url = line[0].split(" at ")[1].strip()
        newcomer = {"Authorization": "Bearer key-n-93ab10"}
        body = {"model": "m", "prompt": "Count.", "max_tokens": 480, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEYS['team-a']}"}) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 1},
                              headers=newcomer, timeout=60).status_code == 401
            write_keys(keys, newcomer="key-n-93ab10")
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 1},
                                        headers=newcomer, timeout=60).status_code == 200, "the new key to be served")
            assert metric_values(url)["pagoda_tenant_requests_in_flight{tenant=team-a}"] == 1  # across the reload
            rest = [line for line in lines if line.startswith("data: ")]
        events = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
        assert rest[-1] == "data: [DONE]" and all("error" not in event for event in events)  # parsed: "error" is a word too
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        reap(proc)
