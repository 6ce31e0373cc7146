"""The strict body decoding every protocol route runs first (pagoda/api/body.py), one refusal per class."""

from __future__ import annotations

import json
import logging

import pytest

from pagoda.api.body import decode_body
from pagoda.plugins.builtin.anthropic_messages import MessagesRequest
from pagoda.plugins.builtin.openai_chat import ChatRequest
from pagoda.plugins.builtin.openai_completions import CompletionRequest
from pagoda.plugins.builtin.openai_responses import ResponsesRequest
from pagoda.plugins.request_fields import RequestError

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": USER}
RESPONSES = {"model": "m", "input": "hi"}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": USER}


def refused(body_type: type, body: object, content_type: str = "application/json") -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        decode_body(body_type, raw, content_type)
    return info.value


@pytest.mark.parametrize(("body_type", "body", "param"), [
    (ChatRequest, {**CHAT, "max_tokens": "8"}, "max_tokens"),  # strict: no numbers as strings
    (CompletionRequest, {"model": "m", "prompt": "x", "temperature": "0.5"}, "temperature"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user"}]}, "messages[0]"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0]"),
    (ChatRequest, {"model": "m", "messages": [{"role": "tool", "content": "42"}]}, "messages[0]"),
    (ChatRequest, {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    (ResponsesRequest, {"model": "m", "input": ""}, "input"),
    (ResponsesRequest, {"model": "m", "input": [{}]}, "input[0]"),
    (ResponsesRequest, {"model": "m", "input": []}, "input"),
    (MessagesRequest, {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0]"),
    (ChatRequest, {"messages": USER}, "model"),
])
def test_what_the_real_apis_refuse_is_refused_naming_the_field(body_type, body, param):
    error = refused(body_type, body)
    assert (error.status, error.param) == (400, param), error.message


@pytest.mark.parametrize(("body_type", "body", "field"), [
    (ChatRequest, CHAT, "audio"), (ChatRequest, CHAT, "prediction"), (ChatRequest, CHAT, "web_search_options"),
    (ChatRequest, CHAT, "modalities"), (ChatRequest, CHAT, "reasoning_effort"),
    (ResponsesRequest, RESPONSES, "previous_response_id"), (ResponsesRequest, RESPONSES, "reasoning"),
    (ResponsesRequest, RESPONSES, "background"), (MessagesRequest, MESSAGES, "thinking"),
    (MessagesRequest, MESSAGES, "container"),
])
def test_known_fields_pagoda_does_not_serve_are_refused_by_name(body_type, body, field):
    value = ["text", "audio"] if field == "modalities" else {"type": "enabled", "budget_tokens": 64}
    error = refused(body_type, {**body, field: value})
    assert (error.status, error.param) == (400, field) and "not supported" in error.message


def test_harmless_values_of_unsupported_fields_pass():
    assert decode_body(ChatRequest, json.dumps({**CHAT, "modalities": ["text"], "store": False}).encode())
    assert decode_body(MessagesRequest, json.dumps({**MESSAGES, "thinking": {"type": "disabled"}}).encode())


def test_unknown_fields_are_ignored_and_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="pagoda.api"):
        body = decode_body(ChatRequest, json.dumps({**CHAT, "x_future_field": 1}).encode())
    assert body.messages[0].content == "hi"
    assert "x_future_field" in caplog.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "", None])
def test_only_a_json_body_is_read(content_type):
    error = refused(ChatRequest, CHAT, content_type)
    assert error.status == 415 and "application/json" in error.message
    assert decode_body(ChatRequest, json.dumps(CHAT).encode(), "Application/JSON; charset=utf-8")


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000,
                                 b'{"model": "m", "messages": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
                                 b"{", b"null", b'"text"', b"\xff\xfe"])
def test_malformed_or_deeply_nested_json_is_a_400(raw):
    assert refused(ChatRequest, raw).status == 400
