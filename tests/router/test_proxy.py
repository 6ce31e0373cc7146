"""The router passes every route through: the official SDKs, the token and model routes, the key, the bounded queues."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from pagoda.harness.live_server import start_server
from pagoda.plugins.error_shapes import OPENAI_ERRORS
from pagoda.plugins.manager import load_plugins, registered_endpoints
from tests.disconnect.helpers import PLUGINS_ENV, PATHS, RawClient, request_body
from tests.helpers import metric_values, wait_for
from tests.router.helpers import REPLICA_HEADER, live_router, replicas, served_by  # noqa: F401
from tests.server_fixtures import TINY_NAME

PROMPT = "Tell me a story about a pagoda."
MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0}
SDK_PATHS = [(protocol, stream) for protocol in ("completions", "chat", "responses", "messages")
             for stream in (False, True)]
ANTHROPIC_ERRORS = registered_endpoints(load_plugins(PLUGINS_ENV))["messages"].errors


@pytest.fixture(scope="module")
def router(replicas):  # noqa: F811
    with live_router([r.url for r in replicas], policy="round_robin") as live:
        yield live


def sdk_text(target, protocol: str, stream: bool, max_tokens: int = 16) -> str:
    """One greedy answer's text through the official SDK of the protocol, streamed or not."""
    oa, an = target.openai(), target.anthropic()
    if protocol == "completions":
        if stream:
            chunks = oa.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                           stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        reply = oa.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].text
    if protocol == "chat":
        if stream:
            chunks = oa.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=max_tokens,
                                                temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = oa.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].message.content
    if protocol == "responses":
        if stream:
            events = oa.responses.create(model=TINY_NAME, input=PROMPT, max_output_tokens=max_tokens, temperature=0,
                                         stream=True)
            return "".join(e.delta for e in events if e.type == "response.output_text.delta")
        reply = oa.responses.create(model=TINY_NAME, input=PROMPT, max_output_tokens=max_tokens, temperature=0)
        return reply.output_text
    assert protocol == "messages"
    if stream:
        with an.messages.stream(model=TINY_NAME, max_tokens=max_tokens, messages=MESSAGES, extra_body=GREEDY) as s:
            return "".join(s.text_stream)
    message = an.messages.create(model=TINY_NAME, max_tokens=max_tokens, messages=MESSAGES, extra_body=GREEDY)
    return message.content[0].text


@pytest.mark.parametrize(("protocol", "stream"), SDK_PATHS,
                         ids=[f"{p}-{'stream' if s else 'unary'}" for p, s in SDK_PATHS])
def test_the_official_sdks_through_the_router_get_what_a_replica_answers(router, replicas,  # noqa: F811
                                                                         protocol, stream):
    direct = sdk_text(replicas[0], protocol, stream=False)
    assert direct and sdk_text(router, protocol, stream) == direct


def test_round_robin_alternates_and_metrics_count_each_replica(replicas):  # noqa: F811
    with live_router([r.url for r in replicas], policy="round_robin") as router:
        before = [r.health()["requests_total"] for r in replicas]
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        served = [served_by(httpx.post(f"{router.url}/v1/completions", json=body, timeout=60), replicas)
                  for _ in range(5)]
        assert served == [0, 1, 0, 1, 0]
        assert [r.health()["requests_total"] - b for r, b in zip(replicas, before)] == [3, 2]
        metrics = metric_values(router.url)
        a, b = (r.url for r in replicas)
        assert metrics[f"pagoda_router_requests_total{{policy=round_robin,replica={a}}}"] == 3
        assert metrics[f"pagoda_router_requests_total{{policy=round_robin,replica={b}}}"] == 2
        assert metrics[f"pagoda_router_in_flight{{replica={a}}}"] == 0
        assert metrics[f"pagoda_router_replica_healthy{{replica={b}}}"] == 1
        assert metrics["pagoda_router_queue_full_total"] == 0 and metrics["pagoda_router_unavailable_total"] == 0


FIRST_TOKEN = {"completions": b'"text"', "chat": b'"content"', "responses": b"response.output_text.delta",
               "messages": b"content_block_delta"}  # in a protocol's stream: an event that carries text


def open_stream(url: str, protocol: str = "completions", max_tokens: int = 800) -> RawClient:
    """A long stream through `url`, returned once its first token arrived (it is decoding on some replica)."""
    client = RawClient(url).post(PATHS[protocol], request_body(protocol, max_tokens=max_tokens, stream=True))
    client.read_until(FIRST_TOKEN[protocol])
    return client


def test_least_load_picks_the_replica_with_fewer_requests_in_flight(replicas):  # noqa: F811
    with live_router([r.url for r in replicas], policy="least_load") as router:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        stream = open_stream(router.url)  # a tie: replica 0
        assert router.in_flight() == [1, 0]
        served = [served_by(httpx.post(f"{router.url}/v1/completions", json=body, timeout=60), replicas)
                  for _ in range(3)]
        assert served == [1, 1, 1]  # each time 1 in flight on replica 0, none on replica 1
        stream.close()
        wait_for(lambda: router.in_flight() == [0, 0], "the closed stream to leave the router")
        assert served_by(httpx.post(f"{router.url}/v1/completions", json=body, timeout=60), replicas) == 0
    for replica in replicas:
        replica.assert_pool_whole()


def test_when_every_healthy_replica_is_full_the_router_answers_429_in_the_protocols_shape(replicas):  # noqa: F811
    with live_router([r.url for r in replicas], policy="round_robin", max_queue_per_replica=1) as router:
        streams = [open_stream(router.url), open_stream(router.url, "messages")]
        assert router.in_flight() == [1, 1]
        r = httpx.post(f"{router.url}{PATHS['chat']}", json=request_body("chat", max_tokens=4, stream=False))
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and REPLICA_HEADER not in r.headers
        assert r.json() == OPENAI_ERRORS.render_error(OPENAI_ERRORS.read_error(429, r.json()))
        assert r.json()["error"]["code"] == "queue_full"
        r = httpx.post(f"{router.url}{PATHS['messages']}", json=request_body("messages", max_tokens=4, stream=True))
        assert r.status_code == 429 and r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
        assert r.json() == ANTHROPIC_ERRORS.render_error(ANTHROPIC_ERRORS.read_error(429, r.json()))
        with pytest.raises(openai.RateLimitError):
            router.openai().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert metric_values(router.url)["pagoda_router_queue_full_total"] == 3
        for stream in streams:
            stream.close()
        wait_for(lambda: router.in_flight() == [0, 0], "the closed streams to leave the router")
        assert sdk_text(router, "chat", stream=False, max_tokens=2)  # room again
    for replica in replicas:
        replica.assert_pool_whole()


def test_the_token_and_model_routes_and_the_page_pass_through(router, replicas):  # noqa: F811
    direct = replicas[0].url
    for method, path, body in (("POST", "/tokenize", {"model": TINY_NAME, "prompt": PROMPT}),
                               ("POST", "/detokenize", {"model": TINY_NAME, "tokens": [1, 2, 3, 400]}),
                               ("POST", "/v1/messages/count_tokens", {"model": TINY_NAME, "messages": MESSAGES}),
                               ("GET", "/v1/models", None), ("GET", f"/v1/models/{TINY_NAME}", None),
                               ("GET", "/v1/models/nothing", None), ("POST", "/tokenize", {"prompt": 3}),
                               ("GET", "/v1/nothing-here", None)):
        ours = httpx.request(method, f"{router.url}{path}", json=body, timeout=60)
        theirs = httpx.request(method, f"{direct}{path}", json=body, timeout=60)
        assert (ours.status_code, ours.headers["content-type"]) == (theirs.status_code, theirs.headers["content-type"])
        if path.startswith("/v1/models") and ours.status_code == 200:  # the same model, built at another moment
            assert [m["id"] for m in ours.json().get("data", [ours.json()])] == [TINY_NAME], ours.json()
        else:
            assert ours.json() == theirs.json(), path
    page = httpx.get(f"{router.url}/", timeout=60)
    assert page.status_code == 200 and page.text == httpx.get(f"{direct}/", timeout=60).text
    assert [m.id for m in router.openai().models.list().data] == [TINY_NAME]


def test_the_api_key_is_checked_as_pagoda_checks_it_and_forwarded(tiny_model_dir):  # noqa: F811
    keyed = start_server(tiny_model_dir, TINY_NAME, api_key="sekret", num_blocks=16, max_model_len=256)
    try:
        with live_router([keyed.url], api_key="sekret") as router:
            for wrong in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}):
                r = httpx.post(f"{router.url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                               headers=wrong)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert REPLICA_HEADER not in r.headers  # the router's own answer
                r = httpx.post(f"{router.url}/v1/messages", json={},
                               headers={**wrong, "anthropic-version": "2023-06-01"})
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
                assert httpx.get(f"{router.url}/v1/models", headers=wrong).status_code == 401
                assert httpx.post(f"{router.url}/tokenize", json={"prompt": "x"}, headers=wrong).status_code == 401
            with pytest.raises(openai.AuthenticationError):
                router.openai(api_key="nope").responses.create(model="m", input="hi", max_output_tokens=2)
            with pytest.raises(anthropic.AuthenticationError):
                router.anthropic(api_key="nope").messages.create(model="m", max_tokens=2, messages=MESSAGES)
            assert router.health().status_code == 200 and httpx.get(f"{router.url}/metrics").status_code == 200
            # the right key, in either header, passes the router and the replica (which checks it again)
            reply = router.openai(api_key="sekret").chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            assert reply.usage.completion_tokens == 2
            message = router.anthropic(api_key="sekret").messages.create(model="m", max_tokens=2, messages=MESSAGES)
            assert message.usage.output_tokens == 2
        with live_router([keyed.url]) as open_router:  # no key at the router: the replica's own 401 passes through
            r = httpx.post(f"{open_router.url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
            assert r.status_code == 401 and r.headers[REPLICA_HEADER] == keyed.url
    finally:
        keyed.server.stop()


def test_a_body_over_the_limit_is_413_in_the_paths_shape(replicas):  # noqa: F811
    with live_router([r.url for r in replicas], max_body_bytes=200) as router:
        big = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "pagoda " * 100}]}
        r = httpx.post(f"{router.url}/v1/messages", json=big)
        assert r.status_code == 413 and r.json()["type"] == "error"
        r = httpx.post(f"{router.url}/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert router.in_flight() == [0, 0]
