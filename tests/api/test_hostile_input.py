"""Hostile input over a real server: a clear 4xx in the protocol's shape, and no bystander ever pays for it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from pagoda.api.settings import ServeSettings
from tests.helpers import FaultySampler
from tests.server_fixtures import TINY_ENGINE, start_server, tiny_model_dir, tiny_server  # noqa: F401

NAME, ALIAS = "tiny-hostile", "tiny-alias"
GOOD_ORIGIN = "https://good.example"
USER = [{"role": "user", "content": "Tell me about pagodas."}]
FAULT_SEED = 4242  # the fault hook fails the sampling of requests with this seed
ROUTES = {"/v1/chat/completions": {"model": NAME, "messages": USER, "max_tokens": 3},
          "/v1/completions": {"model": NAME, "prompt": "Hi", "max_tokens": 3},
          "/v1/responses": {"model": NAME, "input": "Hi", "max_output_tokens": 3},
          "/v1/messages": {"model": NAME, "messages": USER, "max_tokens": 3}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811
    settings = ServeSettings(served_model_aliases=(ALIAS,), allowed_origins=(GOOD_ORIGIN,))
    live = start_server(tiny_model_dir, NAME, settings=settings, refuse_unknown_models=True, **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


def assert_shape(route: str, response: httpx.Response, status: int) -> dict:
    """The status, and the error body in the route's protocol's own shape."""
    assert response.status_code == status, response.text
    body = response.json()
    if route == "/v1/messages":
        assert body["type"] == "error" and body["error"]["message"], body
    else:
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body


def bystander_text(server) -> tuple[list[str], str]:
    """A greedy stream's text chunks and finish reason, read as the SDK reads them."""
    stream = server.openai().completions.create(model=NAME, prompt="Once upon a time", max_tokens=40,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks, reason = [], None
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
    return chunks, reason


# -- one request's failure is its own ---------------------------------------------------------------

def test_a_sampling_failure_fails_that_request_alone_and_the_bystander_is_byte_identical(server):
    solo = bystander_text(server)
    engine = server.async_engine.engine
    original = engine.sampler
    engine.sampler = FaultySampler(original, lambda r: r.sampling_params.seed == FAULT_SEED)
    try:
        client = server.openai()
        stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks, reason = [next(iter(stream)).choices[0].text], None  # the bystander is running now

        def faulty(i: int) -> int:
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": NAME, "messages": USER, "max_tokens": 8, "temperature": 0.9, "seed": FAULT_SEED})
            return r.status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(faulty, range(4)))
        for chunk in stream:
            chunks.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        with pytest.raises(openai.APIError, match="injected sampling fault"):
            list(client.chat.completions.create(model=NAME, messages=USER, max_tokens=8, temperature=0.9,
                                                seed=FAULT_SEED, stream=True))
    finally:
        engine.sampler = original
    assert statuses == [500] * 4  # the failing request's own answer: a server fault, in OpenAI's shape
    assert "".join(chunks).encode() == "".join(solo[0]).encode() and reason == solo[1] == "length"
    assert server.health()["failed_total"] >= 5
    server.assert_pool_whole()


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**64])
def test_a_seed_beyond_64_bits_is_a_400_naming_seed(server, seed):
    for route, body in ROUTES.items():
        body = assert_shape(route, httpx.post(f"{server.url}{route}", json={**body, "seed": seed}), 400)
        assert "seed" in json.dumps(body)


def test_every_64_bit_seed_is_served(server):
    for seed in (2**64 - 1, -(2**63), -1):
        reply = server.openai().completions.create(model=NAME, prompt="Hi", max_tokens=2, seed=seed)
        assert reply.choices[0].finish_reason == "length"


# -- bodies ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", list(ROUTES))
def test_a_body_that_is_not_json_is_a_415_in_the_protocols_shape(server, route):
    raw = json.dumps(ROUTES[route])
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(f"{server.url}{route}", content=raw, headers={"content-type": content_type})
        assert "application/json" in json.dumps(assert_shape(route, r, 415))


@pytest.mark.parametrize("route", list(ROUTES))
def test_deeply_nested_json_is_a_400(server, route):
    raw = b'{"model": "x", "metadata": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    r = httpx.post(f"{server.url}{route}", content=raw, headers={"content-type": "application/json"})
    assert_shape(route, r, 400)


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("/v1/chat/completions", {"max_tokens": "8"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1"}]}, "messages[0]"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"logit_bias": {"999999": 5}}, None),
    ("/v1/chat/completions", {"stop": [str(i) for i in range(1000)]}, "stop"),
    ("/v1/chat/completions", {"stop": ["x" * 100_000]}, "stop"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("/v1/responses", {"input": ""}, "input"),
    ("/v1/responses", {"input": [{}]}, "input[0]"),
    ("/v1/responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, None),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 64}}, None),
    ("/v1/messages", {"stop_sequences": [str(i) for i in range(1000)]}, None),
])
def test_what_the_real_apis_refuse_is_a_400_naming_the_field(server, route, extra, param):
    body = assert_shape(route, httpx.post(f"{server.url}{route}", json={**ROUTES[route], **extra}), 400)
    if param is not None:
        assert body["error"]["param"] == param, body
    if "logit_bias" in extra:
        assert "logit_bias" in body["error"]["message"]


def test_unknown_fields_are_ignored(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**ROUTES["/v1/chat/completions"], "x_new": {"a": 1}})
    assert r.status_code == 200, r.text


# -- model names ------------------------------------------------------------------------------------

def test_an_unknown_model_is_a_404_model_not_found_in_each_protocols_shape(server):
    with pytest.raises(openai.NotFoundError) as info:
        server.openai().chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    assert info.value.code == "model_not_found" and "gpt-4o" in info.value.message
    with pytest.raises(anthropic.NotFoundError) as info:
        server.anthropic().messages.create(model="claude-x", max_tokens=2, messages=USER)
    assert info.value.body["error"]["type"] == "not_found_error"
    for route, body in ROUTES.items():
        assert_shape(route, httpx.post(f"{server.url}{route}", json={**body, "model": "nope"}), 404)


def test_an_alias_is_served_and_reported_as_asked(server):
    assert server.openai().chat.completions.create(model=ALIAS, messages=USER, max_tokens=2).model == ALIAS
    assert server.anthropic().messages.create(model=NAME, max_tokens=2, messages=USER).model == NAME
    assert server.openai().models.retrieve(ALIAS).id == ALIAS
    assert [m.id for m in server.openai().models.list()] == [NAME]


# -- cross-origin ----------------------------------------------------------------------------------

def test_cross_origin_access_only_for_the_allowed_origins(server):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    good = httpx.options(f"{server.url}/v1/chat/completions", headers={"origin": GOOD_ORIGIN, **preflight})
    assert good.headers.get("access-control-allow-origin") == GOOD_ORIGIN
    evil = httpx.options(f"{server.url}/v1/chat/completions", headers={"origin": "https://evil.example", **preflight})
    assert evil.headers.get("access-control-allow-origin") is None
    r = httpx.post(f"{server.url}/v1/chat/completions", json=ROUTES["/v1/chat/completions"],
                   headers={"origin": "https://evil.example"})
    assert r.headers.get("access-control-allow-origin") is None


def test_no_cross_origin_access_by_default(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                   headers={"origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
