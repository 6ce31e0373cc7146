"""The prefix cache on the wire, per protocol without a server: `cache_salt` in, cached prompt tokens out.

Each protocol reports the prompt tokens found in the cache in its own usage field (OpenAI's
`prompt_tokens_details.cached_tokens` / `input_tokens_details.cached_tokens`, Anthropic's
`cache_read_input_tokens`), in the unary body and in the stream, and its client half reads them back.
"""

import msgspec
import pytest

from pagoda.plugins.builtin.anthropic_messages import Messages
from pagoda.plugins.builtin.openai_chat import ChatCompletions
from pagoda.plugins.builtin.openai_completions import Completions
from pagoda.plugins.builtin.openai_responses import Responses
from pagoda.plugins.client import ClientRequest
from tests.helpers import completion, decode, outputs, prepared, read_stream, read_unary, stream

MESSAGES = [{"role": "user", "content": "hi"}]
BODIES = {
    "completions": (Completions(), {"model": "m", "prompt": "a long shared prompt"}),
    "chat": (ChatCompletions(), {"model": "m", "messages": MESSAGES}),
    "responses": (Responses(), {"model": "m", "input": "hi"}),
    "messages": (Messages(), {"model": "m", "max_tokens": 8, "messages": MESSAGES}),
}
PROTOCOLS = sorted(BODIES)
CACHED = 7  # prompt tokens the engine found in its prefix cache


def call_for(protocol, **fields):
    endpoint, body = BODIES[protocol]
    return endpoint, prepared(endpoint, {**body, **fields})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cache_salt_reaches_the_engine_request(protocol):
    _, call = call_for(protocol, cache_salt="tenant-a")
    assert call.request.cache_salt == "tenant-a"
    _, call = call_for(protocol)
    assert call.request.cache_salt is None


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("bad", ["", 5])
def test_a_bad_cache_salt_is_refused_naming_the_field(protocol, bad):
    endpoint, body = BODIES[protocol]
    with pytest.raises(msgspec.ValidationError, match=r"cache_salt"):
        decode(endpoint, {**body, "cache_salt": bad})


def unary_cached(protocol, body):
    usage = body["usage"]
    if protocol == "messages":
        return usage["cache_read_input_tokens"]
    details = usage["input_tokens_details"] if protocol == "responses" else usage["prompt_tokens_details"]
    return details["cached_tokens"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_unary_usage_reports_the_cached_prompt_tokens_and_the_client_reads_them(protocol):
    endpoint, call = call_for(protocol)
    body = endpoint.render(call, completion(call, ["a", "b"], cached=CACHED))
    assert unary_cached(protocol, body) == CACHED
    answer = read_unary(endpoint, body)
    assert answer.cached_tokens == CACHED and answer.prompt_tokens == call.num_prompt_tokens  # cached ones included


def test_anthropic_input_tokens_leave_the_cached_ones_out():
    endpoint, call = call_for("messages")
    usage = endpoint.render(call, completion(call, ["a"], cached=CACHED))["usage"]
    assert usage == {"input_tokens": call.num_prompt_tokens - CACHED, "output_tokens": 1,
                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": CACHED}


def test_openai_prompt_tokens_count_the_cached_ones_too():
    endpoint, call = call_for("chat")
    usage = endpoint.render(call, completion(call, ["a"], cached=CACHED))["usage"]
    assert usage["prompt_tokens"] == call.num_prompt_tokens and usage["total_tokens"] == call.num_prompt_tokens + 1
    endpoint, call = call_for("responses")
    usage = endpoint.render(call, completion(call, ["a"], cached=CACHED))["usage"]
    assert usage["input_tokens"] == call.num_prompt_tokens
    assert usage["input_tokens_details"] == {"cached_tokens": CACHED, "cache_write_tokens": 0}


STREAM_FIELDS = {"completions": {"stream_options": {"include_usage": True}},
                 "chat": {"stream_options": {"include_usage": True}}, "responses": {}, "messages": {}}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_stream_reports_the_cached_prompt_tokens_and_the_client_reads_them(protocol):
    endpoint, call = call_for(protocol, stream=True, **STREAM_FIELDS[protocol])
    events = stream(endpoint, call, outputs(call, ["a", "b", "c"], cached=CACHED))
    answer = read_stream(endpoint, events)
    assert answer.text == "abc" and answer.cached_tokens == CACHED and answer.prompt_tokens == call.num_prompt_tokens
    if protocol in ("completions", "chat"):
        usage = [e.data["usage"] for e in events if isinstance(e.data, dict) and e.data.get("usage")]
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [CACHED]  # the include_usage chunk


def test_anthropic_message_start_and_message_delta_both_carry_the_cache_read():
    endpoint, call = call_for("messages", stream=True)
    events = stream(endpoint, call, outputs(call, ["a", "b"], cached=CACHED))
    start = next(e for e in events if e.name == "message_start").data["message"]["usage"]
    delta = next(e for e in events if e.name == "message_delta").data["usage"]
    assert start["cache_read_input_tokens"] == delta["cache_read_input_tokens"] == CACHED
    assert start["input_tokens"] == delta["input_tokens"] == call.num_prompt_tokens - CACHED
    assert (start["output_tokens"], delta["output_tokens"]) == (0, 2)
    assert events[0].name == "message_start"  # still the first event


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_client_half_sends_the_salt_and_the_earlier_turns(protocol):
    endpoint, _ = BODIES[protocol]
    ask = ClientRequest(prompt="and now?", max_tokens=4, cache_salt="s1", history=(("first", " answer one"),))
    body = endpoint.client_request(ask)
    assert body["cache_salt"] == "s1"
    call = prepared(endpoint, body)  # the server accepts what its client half sends
    assert call.request.cache_salt == "s1"
    if protocol == "completions":
        assert body["prompt"] == "first answer oneand now?"
    else:
        chat = call.tokenizer.chats[-1]
        assert [(m["role"], m["content"]) for m in chat][-3:] == [
            ("user", "first"), ("assistant", " answer one"), ("user", "and now?")]
