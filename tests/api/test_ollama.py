"""A third-party protocol plugin (examples/ollama_plugin), installed through its entry point, served unchanged."""

import json

import httpx
import pytest

from tests.server_fixtures import default_model_dir, tiny_model_dir, tiny_server  # noqa: F401  (fixtures)

MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]


def ndjson(url, body):
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


def test_chat_streams_ndjson_by_default_and_matches_the_unary_reply(tiny_server):
    body = {"model": "m", "messages": MESSAGES, "options": {"temperature": 0, "num_predict": 12}}
    lines = ndjson(f"{tiny_server.url}/api/chat", body)
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 12
    streamed = "".join(line["message"]["content"] for line in lines)
    unary = httpx.post(f"{tiny_server.url}/api/chat", json={**body, "stream": False}, timeout=60).json()
    assert unary["done"] and unary["message"] == {"role": "assistant", "content": streamed}
    # The same conversation through OpenAI chat gives the same greedy text: one engine, two protocols.
    reply = tiny_server.openai().chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == streamed


def test_generate_raw_and_templated(tiny_server):
    raw = httpx.post(f"{tiny_server.url}/api/generate", timeout=60, json={
        "model": "m", "prompt": "Once upon a time", "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": 8}})
    completion = tiny_server.openai().completions.create(model="m", prompt="Once upon a time", max_tokens=8,
                                                         temperature=0)
    assert raw.json()["response"] == completion.choices[0].text
    lines = ndjson(f"{tiny_server.url}/api/generate", {"model": "m", "prompt": "Hi", "system": "Be brief.",
                                                       "options": {"temperature": 0, "num_predict": 5}})
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 5 and lines[-1]["prompt_eval_count"] > 5


@pytest.mark.parametrize("body, field", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "options": {"top_p": 5}}, "options.top_p"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "prompt": "x", "options": {"num_predict": 0}}, "options.num_predict"),
])
def test_errors_use_the_plugins_own_shape(tiny_server, body, field):
    path = "/api/generate" if "prompt" in body else "/api/chat"
    r = httpx.post(f"{tiny_server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400 and set(r.json()) == {"error"} and field in r.json()["error"]
    tiny_server.assert_pool_whole()
