"""POST /tokenize, /detokenize (vLLM's shapes) and /v1/messages/count_tokens (Anthropic's) on a live server."""

import httpx

from tests.server_fixtures import TINY_NAME, default_model_dir, tiny_model_dir, tiny_server  # noqa: F401

MESSAGES = [{"role": "user", "content": "Tell me a story about a pagoda."}]


def test_tokenize_and_detokenize_round_trip_a_prompt(tiny_server):
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"model": TINY_NAME, "prompt": "A pagoda by the river"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 3 and body["max_model_len"] == 1024
    plain = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "A pagoda by the river",
                                                              "add_special_tokens": False}).json()["tokens"]
    back = httpx.post(f"{tiny_server.url}/detokenize", json={"model": TINY_NAME, "tokens": plain})
    assert back.status_code == 200 and back.json() == {"prompt": "A pagoda by the river"}


def test_tokenize_messages_counts_the_prompt_a_chat_request_is_generated_from(tiny_server):
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": MESSAGES}).json()
    chat = tiny_server.openai().chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens


def test_count_tokens_matches_the_messages_usage_through_the_sdk(tiny_server):
    client = tiny_server.anthropic()
    counted = client.messages.count_tokens(model=TINY_NAME, messages=MESSAGES, system="Be brief.")
    message = client.messages.create(model=TINY_NAME, messages=MESSAGES, system="Be brief.", max_tokens=1)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0


def test_bad_token_requests_are_4xx_naming_the_field(tiny_server):
    url = tiny_server.url
    r = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
    r = httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": MESSAGES})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/tokenize", json={"prompt": 3})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    r = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": TINY_NAME, "messages": [{"role": "robot"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "messages" in r.json()["error"]["message"]
